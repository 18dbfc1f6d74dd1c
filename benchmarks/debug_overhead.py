"""What debugging support costs a training step when no rank is at a breakpoint (#33).

A rank's ``breakpoint()``, ``pdb.set_trace()`` and ``input()`` go to the notebook through hooks
installed before ``fn`` runs; nothing of it runs per step, so the target is no cost beyond this
machine's noise. Each rank runs the same loop in short blocks, in ABBA order over many rounds
so that all see the same noise:

* "hooks on": as launched (``sys.breakpointhook`` and ``input`` are nbddp's);
* "hooks off": Python's own ``sys.breakpointhook`` and ``input`` put back for the block;
* "hooks on again": the A/A control, this machine's noise floor.

Two kinds of launch, alternating: a plain one, and one whose ranks stopped at a
``breakpoint()`` first and continued: the script has no input box, so pdb is entered and
continues at once (``c``), the path a person's ``c`` takes. After it no trace function may be
left behind (that would cost every line). The cost of a mode is the median over rounds of the
ratio of its step rate to "hooks off" in the same round. Loops: "natural" (a small MLP trained
with DDP) and "1k" (one matrix product, about a thousand steps a second, the regime where a
few microseconds a step would show).

Run: python benchmarks/debug_overhead.py [LAUNCHES]   (under the CPU lock on a shared machine)
"""

from __future__ import annotations

import builtins
import statistics
import sys
import time
import warnings

import nbddp

ROUNDS = 20
MODES = ("hooks on", "hooks off", "hooks on again")


def _loops(kind: str, steps: int, stop_first: bool) -> dict[str, list[float]]:
    from training_step import make_step

    from nbddp.worker.debugging import asking

    if stop_first:
        breakpoint()  # no input box here: pdb starts and continues, as after a person's c
    step = make_step(kind, 320)  # "1k": about a thousand steps a second

    ours = (sys.breakpointhook, builtins.input)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(ROUNDS + 1):  # round 0 warms up
        for mode in MODES if round_ % 2 == 0 else reversed(MODES):
            if mode == "hooks off":
                sys.breakpointhook, builtins.input = sys.__breakpointhook__, asking._ORIGINAL_INPUT
            else:
                sys.breakpointhook, builtins.input = ours
            nbddp.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                step()
            if round_:
                rates[mode].append(steps / (time.perf_counter() - started))
    rates["tracing left"] = [float(sys.gettrace() is not None)]
    return rates


def _cost(rates: dict[str, list[float]], mode: str) -> float:
    """Median over rounds of how much longer a step took than with the hooks off."""
    pairs = zip(rates["hooks off"], rates[mode], strict=True)
    return statistics.median(off / other - 1 for off, other in pairs)


def _spread(values: list[float]) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{100 * mid:+.1f}% ({100 * low:+.1f} to {100 * high:+.1f})"


def run(launches: int = 4) -> str:
    lines = [
        f"Each row: {launches} launches of {ROUNDS} rounds, 2 gloo CPU ranks; the median over "
        "launches, then the lowest and highest launch.",
        "",
        "| loop | launch | steps/s hooks off | hooks on vs off | A/A (on again vs off) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for kind, steps in (("natural", 150), ("1k", 300)):
        runs: dict[bool, list[dict[str, list[float]]]] = {False: [], True: []}
        for _ in range(launches):
            for stop_first in (False, True):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "a breakpoint ... was skipped"
                    rates = nbddp.notebook_launch(
                        _loops, (kind, steps, stop_first), num_workers=2, device="cpu",
                        display="none",
                    )  # fmt: skip
                if rates["tracing left"] != [0.0]:
                    raise RuntimeError("a trace function was left after pdb continued")
                runs[stop_first].append(rates)
        for stop_first, measured in runs.items():
            off = statistics.median(v for rates in measured for v in rates["hooks off"])
            lines.append(
                f"| {kind} | {'after pdb + c' if stop_first else 'plain'} | {off:,.0f} | "
                f"{_spread([_cost(r, 'hooks on') for r in measured])} | "
                f"{_spread([_cost(r, 'hooks on again') for r in measured])} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else 4))
