"""Diagnosis (#20): what the "why is it stuck?" machinery costs while nothing is asked, and how
long a roll-call takes.

    python benchmarks/stacks.py [--quick] [--steps-only]

* Step time, machinery idle vs off: 2 CPU ranks (gloo) train a small MLP under DDP; each rank
  times its own steps. "idle" is nbddp's default (stall watch on, torch's flight recorder on,
  the dump signal registered, each rank's listener thread waiting); "quiet" is nbddp with
  ``stall_after=None`` and ``TORCH_FR_BUFFER_SIZE=0`` (the listener still waits: it is the
  rank's channel to the kernel); "off" is the same loop in two bare ``torch.multiprocessing``
  processes (spawn, gloo on loopback, the thread count nbddp gives a rank, the flight recorder
  off): no nbddp in the rank at all, so nothing of the machinery runs. No case logs metrics
  (``nbddp.log``'s cost is section 4's). Rounds alternate; step-time distribution over every
  step of every round (p50/p90/p99/max), after 20 warm-up steps.
* ``run.stacks()`` to the answer, with 2 and 8 ranks waiting in a barrier for a sleeping rank:
  the first roll-call of a run, then the distribution of the following ones. And one rank
  holding the GIL (a backtracking regex), answered by the signal dump after its 1 s wait.

Prints Markdown for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

import nbddp
from nbddp.environment import available_cores

STEPS = 300
RANKS = 2


def train(steps: int) -> tuple[list[float], list[str]]:
    """The timed loop, in whatever process group is there (nbddp's, or a bare one): the step
    times, and the names of the threads the rank has (what runs beside the loop)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    times = []
    for _ in range(steps + 20):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[20:], sorted(t.name for t in threading.enumerate())


def _bare_rank(rank: int, port: int, threads: int, steps: int, out: Any) -> None:
    """One rank of the "off" case: a plain process, as a hand-written script's would be."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS
    )
    try:
        out.put((rank, train(steps)))
    finally:
        dist.destroy_process_group()


def bare(steps: int) -> list[tuple[list[float], list[str]]]:
    """``train`` on RANKS bare processes (no nbddp in them): what each rank's call returned."""
    import torch.multiprocessing as mp

    threads = max(1, available_cores() // RANKS)  # what nbddp gives each rank
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"OMP_NUM_THREADS": str(threads), "TORCH_FR_BUFFER_SIZE": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the children's environment, as they start
    try:
        context = mp.get_context("spawn")
        out = context.SimpleQueue()
        ranks = [
            context.Process(target=_bare_rank, args=(rank, port, threads, steps, out))
            for rank in range(RANKS)
        ]
        for process in ranks:
            process.start()
        results = dict(out.get() for _ in ranks)
        for process in ranks:
            process.join()
            assert process.exitcode == 0, process.exitcode
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return [results[rank] for rank in range(RANKS)]


def waiting(hog: bool) -> None:
    import re

    import torch.distributed as dist

    if nbddp.rank() == 1:
        if hog:
            re.match(r"(a+)+$", "a" * 40 + "b")
        time.sleep(600)
    dist.barrier()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _row(name: str, values: list[float], unit: float = 1e3) -> str:
    cells = [statistics.median(values), _pct(values, 0.9), _pct(values, 0.99), max(values)]
    return f"| {name} | " + " | ".join(f"{v * unit:.2f}" for v in cells) + f" | {len(values)} |"


def step_time(rounds: int) -> str:
    cases = {
        "idle": {},
        "quiet": {"stall_after": None, "env": {"TORCH_FR_BUFFER_SIZE": "0"}},
        "off": None,
    }
    samples: dict[str, list[float]] = {case: [] for case in cases}
    threads: dict[str, set[str]] = {case: set() for case in cases}
    for _ in range(rounds):
        for case, options in cases.items():
            if options is None:
                times = bare(STEPS)
            else:
                times = nbddp.notebook_launch(
                    train,
                    (STEPS,),
                    num_workers=RANKS,
                    device="cpu",
                    display="none",
                    return_all=True,
                    **options,  # type: ignore[arg-type]
                )
            for rank_times, names in times:
                samples[case] += rank_times
                threads[case].update(names)
    assert "nbddp-listener" not in threads["off"], threads
    p50 = {case: statistics.median(values) for case, values in samples.items()}
    return "\n".join(
        [
            "| machinery | p50 ms | p90 ms | p99 ms | max ms | steps |",
            "| --- | --- | --- | --- | --- | --- |",
            _row("idle (nbddp's default)", samples["idle"]),
            _row("quiet (nbddp, stall watch and flight recorder off)", samples["quiet"]),
            _row("off (bare torch processes: no nbddp)", samples["off"]),
            "",
            f"Median step idle / off: {p50['idle'] / p50['off']:.3f}×, quiet / off: "
            f"{p50['quiet'] / p50['off']:.3f}× ({rounds} alternating rounds of {STEPS} steps "
            f"on each of {RANKS} ranks).",
            "",
            *(
                f"Threads in a rank, {case}: {', '.join(sorted(names))}."
                for case, names in threads.items()
            ),
        ]
    )


def rollcall(ranks: int, calls: int, hog: bool = False) -> tuple[float, list[float]]:
    run = nbddp.notebook_launch(
        waiting, (hog,), num_workers=ranks, device="cpu", display="none", block=False
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # every rank in place (the first call warms)
            stacks = run.stacks()
            if ("match()" if hog else "time.sleep") in stacks.rollcall():
                break
            time.sleep(0.5)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            stacks = run.stacks()
            times.append(time.perf_counter() - start)
            assert len(stacks.reports) == ranks, stacks
        return times[0], times[1:]
    finally:
        run.stop()


def rollcalls(calls: int) -> str:
    lines = [
        "| case | p50 ms | p90 ms | p99 ms | max ms | calls |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ranks in (2, 8):
        first, rest = rollcall(ranks, calls + 1)
        lines.append(_row(f"{ranks} ranks in a barrier (1 asleep)", [first, *rest]))
    first, rest = rollcall(2, 4, hog=True)
    lines.append(_row("2 ranks, 1 holding the GIL (signal dump)", [first, *rest]))
    return "\n".join(lines)


def main() -> None:
    quick = "--quick" in sys.argv
    print("### Step time, diagnosis machinery idle vs off (2 CPU ranks, gloo)\n")
    print(step_time(2 if quick else 6))
    if "--steps-only" in sys.argv:
        return
    print("\n### run.stacks() until the answer\n")
    print(rollcalls(10 if quick else 50))


if __name__ == "__main__":
    main()
