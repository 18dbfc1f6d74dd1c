"""What stopping well costs: the graceful stop's agreement per training step, and a checkpoint
against calling ``torch.distributed.checkpoint`` directly.

Per step. Each of 2 gloo ranks runs the same loop in short blocks, in ABBA order over many
rounds so that every mode sees the same noise: "plain" (nothing), "plain again" (the A/A
control: this machine's noise floor), "stopping" (``if nbddp.stopping(): break`` every step:
the agreement's whole cost while no stop is asked), and, for reference, "all-reduce flag"
(pocket-tts' way: a one-element all-reduce of a stop flag every step). The cost is the median
over rounds of the per-step time difference against "plain" in the same round, with the 10th
and 90th percentiles. Loops: "natural", a small MLP trained with DDP; "extreme", next to no
work per step (the fixed cost shows).

Checkpoints. 2 gloo ranks save the same DDP model + Adam state (sizes below) with
``nbddp.checkpoint`` and with ``get_state_dict`` + ``dcp.save`` into a fresh directory (with
DCP's default planner, and with ``DefaultSavePlanner(dedup_save_to_lowest_rank=True)``,
nbddp's), interleaved, ``SAVES`` times each; the wall time of each save on rank 0 (p50, p90,
max).

Run: python benchmarks/stopping.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

import nbddp

ROUNDS = 30
SAVES = 12
SIZES_MB = (4, 64, 256)  # parameters' size; Adam's state doubles it
# dcp.save as DCP plans it by default (each replicated tensor written by one rank, the writes
# spread over the ranks), and as nbddp.checkpoint asks (rank 0 writes what every rank holds,
# the way torch.save on rank 0 does, so that an object that differs by rank is rank 0's)
MODES = ("nbddp.checkpoint", "dcp.save", "dcp.save, rank 0 writes")


def per_step(kind: str, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each mode, one entry per round (on this rank)."""
    import torch.distributed as dist
    from training_step import make_step

    step = make_step(kind)  # "extreme": a 16 x 16 product, next to no work per step

    flag = torch.zeros(1)
    modes = ["plain", "plain again", "stopping", "all-reduce flag"]
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(ROUNDS + 1):  # round 0 warms up
        for mode in modes if round_ % 2 == 0 else reversed(modes):
            nbddp.barrier()
            started = time.perf_counter()
            if mode == "stopping":
                for _ in range(steps):
                    step()
                    if nbddp.stopping():
                        break
            elif mode == "all-reduce flag":
                for _ in range(steps):
                    step()
                    dist.all_reduce(flag)
                    if flag.item() > 0:
                        break
            else:
                for _ in range(steps):
                    step()
            if round_:
                times[mode].append((time.perf_counter() - started) / steps)
    return times


def checkpoint_times(megabytes: int, directory: str) -> dict[str, list[float]]:
    """Seconds per save, rank 0's, of ``nbddp.checkpoint`` and of DCP called directly."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    width = 1024
    layers = max(1, megabytes * 2**20 // (width * width * 4))
    model = nbddp.prepare_model(
        torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    )
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(SAVES + 1):  # the first of each warms up
        for mode in times if i % 2 == 0 else reversed(list(times)):
            dist.barrier()
            started = time.perf_counter()
            if mode == "nbddp.checkpoint":
                nbddp.checkpoint({"model": model, "optimizer": optimizer}, step=i)
            else:
                target = os.path.join(directory, mode.replace(" ", "-"), f"save-{i}")
                model_state, optimizer_state = get_state_dict(model, optimizer)
                planner = DefaultSavePlanner(dedup_save_to_lowest_rank=mode != "dcp.save")
                dcp.save(
                    {"model": model_state, "optimizer": optimizer_state},
                    checkpoint_id=target,
                    planner=planner,
                )
            if i:
                times[mode].append(time.perf_counter() - started)
    return times


def _us(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e6:+.2f} µs"


def _spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10, method="inclusive")
    return f"{q[0] * 1e6:+.2f} to {q[-1] * 1e6:+.2f}"


def _seconds(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10, method="inclusive")
    return f"{statistics.median(values):.3f} / {q[-1]:.3f} / {max(values):.3f}"


def main() -> None:
    options = {"num_workers": 2, "device": "cpu", "display": "none"}
    print(
        "| loop | steps/s plain | stopping() per step (p10 to p90) | A/A noise | all-reduce flag |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind, steps in (("natural", 200), ("extreme", 20_000)):
        times = nbddp.notebook_launch(per_step, (kind, steps), **options)
        plain = times["plain"]

        def diff(mode: str, times: dict[str, list[float]] = times) -> list[float]:
            return [a - b for a, b in zip(times[mode], times["plain"], strict=True)]

        print(
            f"| {kind} | {1 / statistics.median(plain):,.0f} | {_us(diff('stopping'))} "
            f"({_spread(diff('stopping'))}) | {_us(diff('plain again'))} "
            f"({_spread(diff('plain again'))}) | {_us(diff('all-reduce flag'))} |"
        )
    print()
    print("| state (params + Adam) | " + " | ".join(f"{m} p50 / p90 / max" for m in MODES) + " |")
    print("| --- | ---: | ---: | ---: |")
    for megabytes in SIZES_MB:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
            times = nbddp.notebook_launch(
                checkpoint_times, (megabytes, directory), checkpoint_dir=directory, **options
            )
        print(
            f"| {megabytes * 3} MB | " + " | ".join(f"{_seconds(times[m])} s" for m in MODES) + " |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
