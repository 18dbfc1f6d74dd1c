"""A torchrun script run from the notebook: ``nbddp.run_script`` against ``torchrun`` started
as a subprocess (what ``!torchrun ...`` in a cell does), issue #46.

    python benchmarks/run_script.py [--runs 20] [--tutorial-runs 6] [--pause 0.5]

Two scripts, each run by both launchers alternately (ABBA order, ``--pause`` seconds apart),
from one process with nbddp's pre-warmed helper ready, as in a kernel:

* a trivial script on 2 CPU ranks whose first line writes ``time.time()`` to a file per rank,
  then ``init_process_group("gloo")``, a barrier, ``destroy_process_group()``: the time from
  the call to the script's first line on every rank (the slowest rank's), and to the call's
  return (the whole run);
* the PyTorch examples' ``multigpu_torchrun.py`` (vendored under ``tests/_scripts``), 2 epochs
  on 2 CPU ranks: the whole run.

Prints a Markdown section for ``benchmarks/RESULTS.md``: p50 / p90 / p99 / max in ms, the
machine, versions, commit and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
TUTORIAL = HERE / "tests" / "_scripts" / "ddp_tutorial_series" / "multigpu_torchrun.py"

FIRST_LINE = """\
import os, time; FIRST = time.time()
open(os.path.join(os.environ["BENCH_DIR"], "first-" + os.environ["RANK"]), "w").write(repr(FIRST))
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def quantiles(values: list[float]) -> list[float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return [at(0.5), at(0.9), at(0.99), ordered[-1]]


def by_nbddp(script: Path, args: list[str], env: dict[str, str]) -> None:
    import nbddp

    with contextlib.redirect_stdout(io.StringIO()):  # rank 0's output, kept as torchrun's is
        code = nbddp.run_script(script, args, num_workers=2, device="cpu", display="none", env=env)
    assert code == 0


def by_torchrun(script: Path, args: list[str], env: dict[str, str]) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*command, "--nproc-per-node", "2", str(script), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]


LAUNCHERS: dict[str, Callable[[Path, list[str], dict[str, str]], None]] = {
    "nbddp.run_script (warm)": by_nbddp,
    "torchrun (subprocess)": by_torchrun,
}


def first_line(folder: Path, runs: int, pause: float) -> dict[str, dict[str, list[float]]]:
    script = folder / "first_line.py"
    script.write_text(FIRST_LINE)
    times: dict[str, dict[str, list[float]]] = {
        name: {"first line": [], "return": []} for name in LAUNCHERS
    }
    for index in range(runs):
        order = list(LAUNCHERS) if index % 2 == 0 else list(reversed(LAUNCHERS))
        for name in order:
            out = Path(tempfile.mkdtemp(dir=folder))
            time.sleep(pause)
            start = time.time()
            LAUNCHERS[name](script, [], {"BENCH_DIR": str(out)})
            returned = time.time()
            firsts = [float((out / f"first-{rank}").read_text()) for rank in (0, 1)]
            times[name]["first line"].append(max(firsts) - start)
            times[name]["return"].append(returned - start)
    return times


def tutorial(folder: Path, runs: int, pause: float) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    for index in range(runs):
        order = list(LAUNCHERS) if index % 2 == 0 else list(reversed(LAUNCHERS))
        for name in order:
            work = Path(tempfile.mkdtemp(dir=folder))
            os.chdir(work)  # its snapshot.pt: a fresh one each run (no resume)
            time.sleep(pause)
            start = time.time()
            LAUNCHERS[name](TUTORIAL, ["2", "1"], {})
            times[name].append(time.time() - start)
    return times


def machine(load: tuple[float, float]) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"_Measured {now} on {cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, no GPU; Python "
        f"{platform.python_version()}, torch {torch.__version__}; commit {commit}; load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end. Command: `python "
        f"benchmarks/run_script.py {' '.join(sys.argv[1:])}`._"
    )


def row(script: str, launcher: str, until: str, values: list[float]) -> str:
    cells = " | ".join(f"{1000 * v:.0f}" for v in quantiles(values))
    return f"| {script} | {launcher} | {until} | {len(values)} | {cells} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--tutorial-runs", type=int, default=6)
    parser.add_argument("--pause", type=float, default=0.5)
    args = parser.parse_args()
    from nbddp.local import forkserver

    load = os.getloadavg()[0]
    forkserver.prestart()
    assert forkserver.wait_until_ready(120), "the pre-warmed helper did not start"
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="bench-run-script-") as folder:
        first_line(Path(folder), 2, args.pause)  # warm-up: imports, the helper's pool
        lines = first_line(Path(folder), args.runs, args.pause)
        whole = tutorial(Path(folder), args.tutorial_runs, args.pause)
        os.chdir(here)
    print(machine((load, os.getloadavg()[0])))
    print()
    print("| script | launcher | until | n | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|---|")
    for until in ("first line", "return"):
        label = "every rank at the script's first line" if until == "first line" else "returns"
        for name, measured in lines.items():
            print(row("trivial (2 ranks)", name, label, measured[until]))
    for name, values in whole.items():
        print(row("multigpu_torchrun.py, 2 epochs", name, "returns", values))


if __name__ == "__main__":
    main()
