"""One prepared check of nbddp's GPU paths, for a machine with one GPU (#44).

    python benchmarks/gpu_check.py [--out DIR] [--only 0,4,7] [--cpu-rehearsal]

Written for the device machine as it is (one H100 or H200, 16 cores, Python 3.12, torch 2.11
with NCCL 2.28.9, pytest, psutil, cloudpickle, transformers, accelerate, lightning; no IPython,
ipykernel or jupyter_client unless their wheels travel in ``.whl``: ``benchmarks/gpu_wheels.sh``;
nothing can be downloaded there). The sections run in order of value, each in a subprocess of
its own under its own time limit, so a hang costs one section; the whole check stays within
``TOTAL`` seconds (9 minutes), and a section that no longer fits is skipped, saying so.

It writes ``gpu-check.json`` (every fact and check), ``gpu-check.md`` (the report for
``benchmarks/RESULTS.md``) and ``sections.tar.gz`` (each section's own result and whole log,
and the gpu tests' JUnit XML) into ``--out`` (a temporary folder by default; on the device
machine, ``$OUT``: the device tool brings back at most 8 files, so the check leaves three). All
three are written again after each section, so a run cut short still reports what ran.

Without a GPU it prints its numbered plan and the device tool's command, and exits 0 (CI runs
that). ``--cpu-rehearsal`` runs every section's harness on this machine's CPU instead, with the
GPU parts stubbed and IPython hidden as on the device machine (except the ``%%ddp`` section,
which uses this machine's kernel packages), so that the one run on a GPU cannot die of a typo.

The sections' code is in ``gpu_check_sections.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOTAL = 540.0  # seconds for the whole check: 9 minutes
MARGIN = 5.0  # seconds a section's subprocess may take beyond its own limit to end

# (number, name, seconds, what it checks and what is expected today): in order of value.
SECTIONS: list[tuple[int, str, int, str]] = [
    (
        0,
        "environment",
        20,
        "nvidia-smi, MIG and compute mode, torch and CUDA, NCCL as built "
        "and as loaded (ncclGetVersion, no CUDA context), /dev/shm, MPS, kernel packages",
    ),
    (
        1,
        "gpu_tests",
        120,
        "the project's gpu-marked tests (tests/test_gpu.py, the gpu tests of "
        "tutorials, export and the helper's safety) and the docs pages with GPU blocks, in a "
        "kernel: one-GPU ones pass, two-GPU ones skip",
    ),
    (
        2,
        "helper_imports",
        60,
        "G1: which popular imports and GPU calls (device_count, is_available, "
        "NCCL's version) map libcuda, open the GPU or start threads, each in a fresh process, "
        "and whether a child forked after each reaches the GPU; nbddp's warm helper after "
        "preloading them holds no GPU device file and still forks ranks that reach the GPU",
    ),
    (
        3,
        "stall_banner",
        30,
        "F2: a rank waiting on the GPU spins a core; the stall banner on "
        "GPU ranks waiting in a collective (gloo on gpus=[0,0]; NCCL where 2.30+ allows two "
        "ranks on one GPU)",
    ),
    (
        4,
        "nccl_session",
        40,
        "a one-rank NCCL session: F1 the roll-call names the NCCL "
        "collective, F16 barrier() without the device warning, one CUDA context (the rank's), "
        "none for the kernel or the helper; GPU memory back after close()",
    ),
    (
        5,
        "in_kernel",
        30,
        "the one-rank run in the kernel on cuda: F14 a state_dict comes back on "
        "the CPU, F6 a failure gives fn's GPU memory back, the world undone, no context on a "
        "GPU it did not use",
    ),
    (
        6,
        "stop_and_kill",
        35,
        "GPU memory back after Stop of 2 ranks with DataLoader workers, and "
        "after SIGKILL of a rank waiting on the GPU: a typed error at once, no process left",
    ),
    (
        7,
        "nccl_two_ranks",
        45,
        "two NCCL ranks on one GPU: with NCCL 2.30+ all_reduce, a DDP "
        "step, F3 the asked timeout, F8 a rank returning right after a collective; otherwise the "
        "refusal's text names the NCCL version",
    ),
    (
        8,
        "tf32_carried",
        25,
        "F7: the kernel's set_float32_matmul_precision('high') and TF32 "
        "flags on the ranks, and fp32 matmul time on the ranks beside the kernel's",
    ),
    (
        9,
        "first_step",
        65,
        "time to the first DDP step of 2 ranks on GPU 0 (gloo): warm launches, "
        "a session's first and next task, and torchrun --nproc-per-node=2 of the same step (cold)",
    ),
    (
        10,
        "ddp_cell",
        35,
        "a %%ddp cell on cuda in a real kernel (the carried ipykernel, "
        "jupyter_client and IPython wheels): the cell's value and the rank's device",
    ),
    (
        11,
        "cpu_scaling",
        35,
        "launch latency of a trivial all_reduce as CPU ranks grow: 2, 4, 8, 16",
    ),
]
DEVICE_COMMAND = (
    "run(carry=['.whl'], timeout_s=600, command='"
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "
    "/tmp/site .whl/*.whl; export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; "
    "python3 benchmarks/gpu_check.py --out $OUT')"
)


def plan_text() -> str:
    lines = [f"nbddp's GPU check: {len(SECTIONS)} sections, at most {TOTAL / 60:g} minutes in all"]
    for number, name, seconds, what in SECTIONS:
        lines.append(f"{number:>3}. {name} ({seconds} s): {what}")
    lines += [
        "",
        "No GPU here: nothing ran. On the device machine (stage the kernel wheels first with",
        "benchmarks/gpu_wheels.sh), call the device tool as:",
        f"  {DEVICE_COMMAND}",
        "Rehearse it here on the CPU: python benchmarks/gpu_check.py --cpu-rehearsal",
    ]
    return "\n".join(lines)


def has_gpu() -> bool:
    """Whether a GPU is visible, asked the way nbddp asks (NVML: no CUDA context here)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return bool(torch.cuda.is_available())


def run_section(number: int, name: str, seconds: float, out: Path, rehearsal: bool) -> dict:
    """One section in its own subprocess, under its own limit: its result, or why none."""
    result_file = out / f"section-{number}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--section", str(number)]
    command += ["--out", str(out)] + (["--cpu-rehearsal"] if rehearsal else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_NVML_BASED_CUDA_CHECK="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    if rehearsal and name != "ddp_cell":  # as on the device machine: no IPython
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "gpu_check_noipython"), env["PYTHONPATH"]])
    started = time.monotonic()
    log = out / f"section-{number}.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(seconds)
            status = "ran" if code == 0 else f"exited {code}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {seconds:g} s"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the section and what it left running
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(MARGIN)
    took = time.monotonic() - started
    found: dict[str, Any] = {}
    if result_file.exists():
        found = json.loads(result_file.read_text())
    tail = log.read_text(errors="replace")[-3000:]
    return {
        "number": number,
        "name": name,
        "status": status,
        "seconds": round(took, 1),
        "budget": seconds,
        **found,
        "log_tail": tail,
    }


def verdict(section: dict) -> str:
    checks = section.get("checks", [])
    failed = [c for c in checks if c.get("ok") is False]
    if section["status"] != "ran" or section.get("error"):
        return "ERROR"
    if failed:
        return f"{len(failed)} of {len(checks)} checks FAILED"
    return f"{len(checks)} checks passed" if checks else "facts only"


def report_md(results: list[dict], meta: dict) -> str:
    rehearsal = " — CPU rehearsal (the GPU parts stubbed)" if meta["rehearsal"] else ""
    lines = [
        f"## GPU check (`benchmarks/gpu_check.py`){rehearsal}",
        "",
        f"_Run {meta['when']} on {meta.get('card', 'no GPU')}; {meta.get('python', '')}, torch "
        f"{meta.get('torch', '?')}; {meta.get('nccl', '')}; commit {meta.get('commit', '?')}; "
        f"{meta['seconds']:.0f} s in all._",
        "",
        "| # | section | status | s (limit) | verdict |",
        "| ---: | --- | --- | ---: | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['number']} | {r['name']} | {r['status']} | {r['seconds']:g} ({r['budget']}) "
            f"| {verdict(r)} |"
        )
    for r in results:
        lines += ["", f"### {r['number']}. {r['name']}", ""]
        if r.get("error"):
            lines += ["```", r["error"].strip()[-1500:], "```"]
        for check in r.get("checks", []):
            mark = {True: "ok", False: "**FAILED**", None: "n/a"}[check.get("ok")]
            lines.append(
                f"- {mark}: {check['what']} (expected {check['expected']}; got {check['got']})"
            )
        for key, value in r.get("facts", {}).items():
            text = json.dumps(value) if not isinstance(value, str) else value
            lines.append(f"- {key}: {text[:400]}")
        if r["status"] != "ran" and not r.get("error"):
            lines += ["", "```", r["log_tail"].strip()[-1500:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where the report goes (a temporary folder)")
    parser.add_argument("--only", default=None, help="section numbers, e.g. 0,4,7")
    parser.add_argument("--cpu-rehearsal", action="store_true", help="every harness on the CPU")
    parser.add_argument("--section", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section is not None:  # inside a section's own subprocess
        from gpu_check_sections import run_one

        return run_one(args.section, Path(args.out), args.cpu_rehearsal)
    if not args.cpu_rehearsal and not has_gpu():
        print(plan_text())
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="nbddp-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nbddp-gpu-sections-"))  # bundled into out
    wanted = {int(n) for n in args.only.split(",")} if args.only else None
    started = time.monotonic()
    results: list[dict] = []
    for number, name, seconds, _ in SECTIONS:
        if wanted is not None and number not in wanted:
            continue
        left = TOTAL - (time.monotonic() - started) - MARGIN
        if left < seconds:
            results.append(
                {
                    "number": number,
                    "name": name,
                    "status": "skipped: no time left",
                    "seconds": 0,
                    "budget": seconds,
                    "log_tail": "",
                }
            )
            continue
        print(f"[{time.monotonic() - started:5.0f} s] {number}. {name} ...", flush=True)
        result = run_section(number, name, seconds, work, args.cpu_rehearsal)
        print(f"        {result['status']}, {result['seconds']} s: {verdict(result)}", flush=True)
        results.append(result)
        write_report(out, work, results, started, args.cpu_rehearsal)
    seconds = write_report(out, work, results, started, args.cpu_rehearsal)
    print(f"report: {out / 'gpu-check.md'}, gpu-check.json, sections.tar.gz ({seconds:.0f} s)")
    return 0


def write_report(
    out: Path, work: Path, results: list[dict], started: float, rehearsal: bool
) -> float:
    """The report of what ran so far: its JSON, its markdown, and the sections' own files."""
    environment = next((r for r in results if r["name"] == "environment"), {})
    facts = environment.get("facts", {})
    meta = {
        "rehearsal": rehearsal,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": time.monotonic() - started,
        "card": facts.get("gpu", "no GPU"),
        "python": facts.get("python", ""),
        "torch": facts.get("torch", "?"),
        "nccl": facts.get("nccl", ""),
        "commit": facts.get("commit", "?"),
    }
    (out / "gpu-check.json").write_text(json.dumps({"meta": meta, "sections": results}, indent=1))
    (out / "gpu-check.md").write_text(report_md(results, meta))
    with tarfile.open(out / "sections.tar.gz", "w:gz") as bundle:
        bundle.add(work, arcname="sections")
    return meta["seconds"]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
