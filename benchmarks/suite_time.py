"""How long the README's test command takes, and where the time goes (issue #42).

Runs ``NBDDP_CI=1 pytest -n N --dist loadgroup`` (the README's command; ``--workers`` changes
N) ``--runs`` times in a row, watching each test's start, end and CPU on its worker
(``suite_observer.py``, a plugin that only records), the machine's CPU (``/proc/stat``,
before and after) and every process's, by kind (``machine_cpu.py``). For each run: the wall
time, pytest's exit, how busy the cores were, when each worker ended, the files that took
longest and cost most, and what each kind of process spent. Then the wall times' p50 and max.

    .venv/bin/python benchmarks/suite_time.py --runs 3 [--workers 2] [--out DIR] [-- PATHS]

Why the CPU: a suite whose cores idle while tests wait (Slurm's clock, stall thresholds)
gains from one more worker; one that keeps them busy gains only from less work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine_cpu import MachineCPU

ROOT = Path(__file__).resolve().parent.parent


def cpu_ticks() -> tuple[int, int]:
    """(busy, idle) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    return user + nice + system + irq + softirq, idle + iowait


def one_run(workers: int, folder: Path, selection: list[str]) -> dict:
    folder.mkdir(parents=True)
    env = {
        **os.environ,
        "NBDDP_CI": "1",
        "NBDDP_SUITE_TIMELINE": str(folder),
        # the observer alone on the path (not benchmarks/, whose modules' names are common)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
    }
    shutil.copy(Path(__file__).with_name("suite_observer.py"), folder)
    command = [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadgroup"]
    command += ["-p", "suite_observer", "-p", "no:cacheprovider", *selection]
    machine = MachineCPU().start()
    busy_before, idle_before = cpu_ticks()
    started = time.monotonic()
    with open(folder / "pytest.log", "w") as log:
        rc = subprocess.call(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    machine.stop()
    busy_after, idle_after = cpu_ticks()
    busy, idle = busy_after - busy_before, idle_after - idle_before
    lines = [line for f in folder.glob("*.jsonl") for line in f.read_text().splitlines()]
    tests = [json.loads(line) for line in lines if line.strip()]
    first = min((t["start"] for t in tests), default=0.0)
    ends = collections.defaultdict(float)
    by_file: collections.Counter[str] = collections.Counter()
    cpu_by_file: collections.Counter[str] = collections.Counter()
    for t in tests:
        ends[t["worker"]] = max(ends[t["worker"]], t["end"] - first)
        by_file[t["id"].split("::")[0]] += t["end"] - t["start"]
        cpu_by_file[t["id"].split("::")[0]] += t.get("cpu", 0.0)
    summary = (folder / "pytest.log").read_text().strip().splitlines()[-1:]
    return {
        "wall": wall,
        "rc": rc,
        "busy": busy / max(1, busy + idle),
        "core_seconds": busy / os.sysconf("SC_CLK_TCK"),
        "worker_ends": dict(sorted(ends.items())),
        "test_seconds": sum(by_file.values()),
        "test_cpu": sum(cpu_by_file.values()),
        "files": [(name, seconds, cpu_by_file[name]) for name, seconds in by_file.most_common(8)],
        "cpu_files": cpu_by_file.most_common(12),
        "cpu_kinds": machine.by_kind(),
        "summary": summary[0] if summary else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3)  # the README's -n 3
    parser.add_argument("--out", type=Path, default=None, help="a folder (default: a new one)")
    parser.add_argument("selection", nargs="*", help="pytest's paths or -k (default: all)")
    options = parser.parse_args()
    out = options.out or Path(tempfile.mkdtemp(prefix="suite-time-"))
    results = []
    for index in range(options.runs):
        result = one_run(options.workers, out / f"run{index + 1}", options.selection)
        results.append(result)
        ends = ", ".join(f"{w} {e:.0f} s" for w, e in result["worker_ends"].items())
        print(
            f"run {index + 1}: {result['wall']:.0f} s, exit {result['rc']}, cores "
            f"{result['busy']:.0%} busy ({result['core_seconds']:.0f} core-s), "
            f"{result['test_seconds']:.0f} s of test time; workers ended at {ends}",
            flush=True,
        )
        print(f"  {result['summary']}")
        print("  the longest files (wall, CPU seen in their process trees):")
        for name, seconds, cpu in result["files"]:
            print(f"  {seconds:6.1f} s  {cpu:6.1f} core-s  {name}")
        print(f"  the costliest files ({result['test_cpu']:.0f} core-s seen in all):")
        for name, cpu in result["cpu_files"]:
            print(f"  {cpu:6.1f} core-s  {name}")
        print("  every process on the machine, by kind (machine_cpu.py):")
        for what, cpu, processes in result["cpu_kinds"]:
            print(f"  {cpu:6.1f} core-s  {processes:5d} processes  {what}")
    walls = [r["wall"] for r in results]
    print(
        f"\n{len(walls)} runs of -n {options.workers}: p50 {statistics.median(walls):.0f} s, "
        f"max {max(walls):.0f} s; {sum(r['rc'] == 0 for r in results)} passed"
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"(each run's log and timeline: {out})")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
