"""One command for every benchmark: ``python benchmarks/run.py`` writes benchmarks/RESULTS.md.

Ratios are measured side by side in one run, interleaved, because these machines are noisy;
lone absolute times mean little. Sections:

1. launch latency of a trivial all_reduce on 2 CPU ranks: nbddp warm and cold, Lightning
   Fabric's ``ddp_notebook`` and Accelerate's ``notebook_launcher`` (both fork the kernel), a
   bare ``torch.multiprocessing`` fork, torch.multiprocessing.spawn, torchrun, and a bare spawn
   of 2 ``python -c "import torch"`` (the floor for any fresh-interpreter launch); then where
   the milliseconds of nbddp's warm launch go (launch_phases.py);
2. training throughput of the same small CNN on 2 ranks: nbddp (log + progress every step)
   vs a hand-written torchrun script;
3. the in-kernel fallback vs calling the function directly;
4. nbddp.log / nbddp.progress overhead and log-to-display latency (live_overhead.py).

``--quick`` runs fewer repetitions (for a smoke test of the benchmark itself).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
PYTHON = sys.executable


def _median(values: list[float]) -> float:
    return statistics.median(values)


# -- 1. launch latency ------------------------------------------------------------------------

_ALLREDUCE_SCRIPT = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def _timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def launch_latency(processes: int, repeats: int) -> str:
    methods = ["nbddp-warm", "nbddp-cold", "fabric", "accelerate", "mp-fork", "mp-spawn"]
    first: dict[str, list[float]] = {m: [] for m in [*methods, "torchrun", "bare"]}
    repeated: dict[str, list[float]] = {m: [] for m in methods}
    notes: dict[str, str] = {}
    script = Path(tempfile.mkdtemp()) / "allreduce.py"
    script.write_text(_ALLREDUCE_SCRIPT)
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    bare = (
        f"import subprocess as s; ps=[s.Popen([{PYTHON!r}, '-c', 'import torch']) "
        "for _ in range(2)]; [p.wait() for p in ps]"
    )
    for _ in range(processes):  # round-robin: every method sees the same machine state
        for method in methods:
            done = subprocess.run(
                [PYTHON, str(HERE / "launchers.py"), method, str(repeats)],
                capture_output=True,
                text=True,
            )
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                notes[method] = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
                continue
            result = json.loads(line[len("RESULT ") :])
            first[method].append(result["first"])
            repeated[method].extend(result["repeated"])
        first["torchrun"].append(_timed([*torchrun, str(script)]))
        first["bare"].append(_timed([PYTHON, "-c", bare]))

    labels = {
        "nbddp-warm": "nbddp, pre-warmed (default)",
        "nbddp-cold": "nbddp, cold (NBDDP_PREWARM=0)",
        "fabric": "Lightning Fabric `ddp_notebook` (fork)",
        "accelerate": "Accelerate notebook_launcher (fork, Accelerator(cpu=True))",
        "mp-fork": "bare `torch.multiprocessing` fork (start_processes, fork)",
        "mp-spawn": "torch.multiprocessing.spawn from a script",
        "torchrun": "torchrun on a script (whole command)",
        "bare": 'bare: 2 × `python -c "import torch"` in parallel',
    }
    rows = ["| launcher | first launch (s) | repeated launch (s) |", "| --- | ---: | ---: |"]
    for method, label in labels.items():
        if not first[method]:
            rows.append(f"| {label} | failed: {notes.get(method, '?')} | |")
            continue
        again = f"{_median(repeated[method]):.3f}" if repeated.get(method) else "n/a (new process)"
        rows.append(f"| {label} | {_median(first[method]):.3f} | {again} |")
    warm, cold, bare_t = (
        _median(first["nbddp-warm"]),
        _median(first["nbddp-cold"]),
        _median(first["bare"]),
    )
    rows += [
        "",
        f"nbddp cold / bare import floor: {cold / bare_t:.2f}× (target ≤ 1.1×). "
        f"nbddp warm first launch: {warm:.3f} s",
    ]
    if first["accelerate"]:
        rows[-1] += f" vs Accelerate's {_median(first['accelerate']):.3f} s (target ≤)."
    rows.append(
        f"Medians of {processes} fresh processes (first launch, 3 s after import) and "
        f"{processes * repeats} repeated launches; torchrun and bare: {processes} runs."
    )
    return "\n".join(rows)


# -- 2. training throughput ---------------------------------------------------------------------


def throughput(rounds: int, steps: int) -> str:
    from cnn import nbddp_run

    import nbddp

    script = Path(tempfile.mkdtemp()) / "train_torchrun.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
        f"from cnn import torchrun_main\ntorchrun_main({steps})\n"
    )
    torchrun = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
    ]
    warm, cold, theirs = [], [], []
    for _ in range(rounds):  # interleaved: the three see the same machine state
        for rates, prewarm in ((warm, "1"), (cold, "0")):
            os.environ["NBDDP_PREWARM"] = prewarm
            rates.append(
                nbddp.notebook_launch(
                    nbddp_run, (steps,), num_workers=2, device="cpu", display="none"
                )
            )
        os.environ.pop("NBDDP_PREWARM")
        out = subprocess.run(torchrun, capture_output=True, text=True, check=True).stdout
        theirs.append(float(next(x for x in out.splitlines() if x.startswith("RATE ")).split()[1]))
    b = _median(theirs)
    spread = max(theirs) / min(theirs)
    return "\n".join(
        [
            "| small CNN, 2 gloo ranks, batch 64 | steps/s (median) | min – max |",
            "| --- | ---: | ---: |",
            f"| hand-written torchrun script | {b:.1f} | {min(theirs):.1f} – {max(theirs):.1f} |",
            *(
                f"| nbddp ({label}), log + progress every step | {_median(r):.1f} | "
                f"{min(r):.1f} – {max(r):.1f} |"
                for label, r in (("warm", warm), ("cold", cold))
            ),
            "",
            f"nbddp warm / torchrun: {_median(warm) / b:.2f}×, nbddp cold / torchrun: "
            f"{_median(cold) / b:.2f}× (target ≥ 0.98×); {rounds} interleaved rounds of "
            f"{steps} timed steps. The same torchrun command varied {spread:.2f}× between "
            "rounds on this machine: read differences smaller than that as noise.",
        ]
    )


# -- 3. the fallback ---------------------------------------------------------------------------


def fallback(rounds: int) -> str:
    from cnn import SmallCNN, dataset, train_steps
    from torch.utils.data import DataLoader

    import nbddp

    def work() -> float:
        model = nbddp.prepare_model(SmallCNN())
        loader = nbddp.prepare_loader(DataLoader(dataset(1024), batch_size=64, shuffle=True))
        started = time.perf_counter()
        train_steps(model, loader, steps=40, warmup=2)
        return time.perf_counter() - started

    def launched() -> None:
        nbddp.notebook_launch(work, num_workers=1, device="cpu", display="none")

    times: dict[str, list[float]] = {"direct": [], "launched": []}
    for round_ in range(rounds):  # ABBA: neither always runs first on a warmer machine
        for name in ("direct", "launched") if round_ % 2 == 0 else ("launched", "direct"):
            started = time.perf_counter()
            work() if name == "direct" else launched()
            times[name].append(time.perf_counter() - started)
    a, b = _median(times["launched"]), _median(times["direct"])
    return (
        f"`notebook_launch(fn, num_workers=1)` (in the kernel, world-size-1 process group) "
        f"took {a:.3f} s vs {b:.3f} s calling `fn()` directly: {a / b:.3f}× "
        f"(target ≤ 1.02×; medians of {rounds} rounds in ABBA order)."
    )


def _in_fresh_process(module: str, quick: bool) -> str:
    """A section measured in a process of its own (it instruments nbddp's internals)."""
    done = subprocess.run(
        [PYTHON, str(HERE / f"{module}.py"), "5" if quick else "30"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def _cluster(cluster: Any, quick: bool) -> str:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Not measured: Ray is not installed (pip install 'nbddp[ray]' 'ray[train]')."
    return str(cluster.run(quick))


# -- the report --------------------------------------------------------------------------------


def machine() -> str:
    """One line saying where and from what a section was measured: each section carries its
    own (a run with ``--only`` keeps the other sections, measured elsewhere, with theirs)."""
    import torch

    import nbddp

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import accelerate

        acc = accelerate.__version__
    except ImportError:
        acc = "not installed"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = f"GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    command = " ".join(["python", "benchmarks/run.py", *sys.argv[1:]])
    return (
        f"_Measured {datetime.date.today()} on {cpu}, {os.cpu_count()} cores, "
        f"{memory:.0f} GiB, {gpu}; Python {platform.python_version()}, torch "
        f"{torch.__version__}, nbddp {nbddp.__version__}, accelerate {acc}; commit "
        f"{commit or 'unknown'}; load {os.getloadavg()[0]:.1f} at the start; `{command}`._"
    )


def _sections(quick: bool) -> list[tuple[str, Callable[[], str]]]:
    import cluster
    import data
    import gpu
    import live_overhead
    import session

    return [
        (
            "1. Launch latency (trivial all_reduce, 2 CPU ranks)",
            lambda: launch_latency(processes=2 if quick else 5, repeats=2 if quick else 5),
        ),
        ("1b. Where a warm launch's time goes", lambda: _in_fresh_process("launch_phases", quick)),
        (
            "2. Training throughput",
            lambda: throughput(rounds=1 if quick else 5, steps=30 if quick else 150),
        ),
        ("3. In-kernel fallback overhead", lambda: fallback(rounds=2 if quick else 20)),
        (
            "4. nbddp.log / nbddp.progress overhead and latency",
            lambda: live_overhead.run(launches=1 if quick else live_overhead.LAUNCHES),
        ),
        (
            "5. Data in and out: a captured 1 GB global, a returned 1 GiB tensor",
            lambda: data.run(quick),
        ),
        ("6. Ray cluster launches (two simulated nodes)", lambda: _cluster(cluster, quick)),
        ("7. Session cells, from a real kernel", lambda: session.run(quick)),
        ("8. On a GPU: NCCL (or gloo sharing one GPU)", lambda: gpu.run(quick)),
    ]


def _written() -> dict[str, str]:
    """The sections RESULTS.md holds now, by title."""
    path = HERE / "RESULTS.md"
    if not path.exists():
        return {}
    parts = path.read_text().split("\n## ")[1:]
    return {p.split("\n", 1)[0]: p.split("\n", 1)[1].strip() for p in parts}


def _measured(title: str, section: Callable[[], str]) -> str:
    """One section's text under the line naming its machine; a section that fails says so
    and the others still run."""
    stamp = machine()
    try:
        return f"{stamp}\n\n{section()}"
    except Exception as exc:
        traceback.print_exc()
        last = (str(exc).strip().splitlines() or [""])[-1][:300]
        return f"{stamp}\n\nFailed: {type(exc).__name__}: {last} (traceback on the run's stderr)."


def main() -> None:
    """``--quick``: fewer repetitions. ``--only 5,7``: measure those sections again, keep the
    others as RESULTS.md has them, each with the machine line of the run that made it.
    RESULTS.md is rewritten after each section, so an interrupted run keeps what it
    measured."""
    quick = "--quick" in sys.argv
    only = None
    if "--only" in sys.argv:
        only = set(sys.argv[sys.argv.index("--only") + 1].split(","))
    written = _written()
    kept = written if only is not None else {}
    done: dict[str, str] = {}
    sections = _sections(quick)
    titles = {title for title, _ in sections}
    # sections other scripts wrote (an issue's own benchmark): kept as they are, after ours
    others = {title: body for title, body in written.items() if title not in titles | {"Machine"}}
    for title, section in sections:
        number = title.split(".", 1)[0]
        if only is None or number in only or title not in kept:
            done[title] = _measured(title, section)
        else:
            done[title] = kept[title]
        text = (
            "# nbddp benchmarks\n\nWritten by `python benchmarks/run.py` (sections 1-8) and by "
            "each issue's own script (the sections after). Each section says the machine, "
            "versions and commit it was measured on: compare numbers across sections only where "
            "those match.\n\n"
            + "\n\n".join(f"## {t}\n\n{body}" for t, body in {**done, **others}.items())
            + "\n"
        )
        (HERE / "RESULTS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
