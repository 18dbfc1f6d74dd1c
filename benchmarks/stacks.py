"""Diagnosis (#20): what the "why is it stuck?" machinery costs while nothing is asked, and how
long a roll-call takes.

    python benchmarks/stacks.py [--quick]

* Step time, machinery idle vs off: 2 CPU ranks (gloo) train a small MLP under DDP and log a
  metric every step; each rank times its own steps. "idle" is the default (stall watch on,
  torch's flight recorder on, the dump signal registered, listener threads waiting); "off" is
  ``stall_after=None`` with ``TORCH_FR_BUFFER_SIZE=0``. Rounds alternate; step-time
  distribution over every step of every round (p50/p90/p99/max), after 20 warm-up steps.
* ``run.stacks()`` to the answer, with 2 and 8 ranks waiting in a barrier for a sleeping rank:
  the first roll-call of a run, then the distribution of the following ones. And one rank
  holding the GIL (a backtracking regex), answered by the signal dump after its 1 s wait.

Prints Markdown for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import statistics
import sys
import time

import nbddp

STEPS = 300


def train(steps: int) -> list[float]:
    import torch

    torch.manual_seed(0)
    model = nbddp.prepare_model(
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
        nbddp.log(loss=loss)
        times.append(time.perf_counter() - start)
    return times[20:]


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
    samples: dict[str, list[float]] = {"idle": [], "off": []}
    for _ in range(rounds):
        for case in ("idle", "off"):
            options = (
                {}
                if case == "idle"
                else {"stall_after": None, "env": {"TORCH_FR_BUFFER_SIZE": "0"}}
            )
            times = nbddp.notebook_launch(
                train,
                (STEPS,),
                num_workers=2,
                device="cpu",
                display="none",
                return_all=True,
                **options,  # type: ignore[arg-type]
            )
            for rank_times in times:
                samples[case] += rank_times
    idle, off = statistics.median(samples["idle"]), statistics.median(samples["off"])
    return "\n".join(
        [
            "| machinery | p50 ms | p90 ms | p99 ms | max ms | steps |",
            "| --- | --- | --- | --- | --- | --- |",
            _row("idle (default)", samples["idle"]),
            _row("off", samples["off"]),
            "",
            f"Median step idle / off: {idle / off:.3f}× ({rounds} alternating rounds of "
            f"{STEPS} steps on each of 2 ranks).",
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
    print("\n### run.stacks() until the answer\n")
    print(rollcalls(10 if quick else 50))


if __name__ == "__main__":
    main()
