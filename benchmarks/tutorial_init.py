"""What answering a tutorial's own ``init_process_group`` costs (issue #25): the call that asks
for nbddp's world (answered from the existing group), and the one after the tutorial's
``destroy_process_group()`` (a fresh gloo group on nbddp's store); and a whole run of the PyTorch
tutorial's ``demo_basic`` through ``nbddp.spawn`` beside a launch doing the same without setup.

Run: ``python benchmarks/tutorial_init.py`` (2 CPU ranks). Prints a Markdown section for
RESULTS.md (milliseconds: p50 | p90 | p99 | max).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nbddp


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return " | ".join(f"{x:.3f}" for x in (at(0.5), at(0.9), at(0.99), ordered[-1]))


def time_inits(answered: int, rebuilt: int) -> tuple[list[float], list[float]]:
    """On each rank: the answered call, then destroy + init (every rank at the same point)."""
    rank, size = nbddp.rank(), nbddp.world_size()
    os.environ["MASTER_PORT"] = "12355"
    fast = []
    for _ in range(answered):
        start = time.perf_counter()
        dist.init_process_group("gloo", rank=rank, world_size=size)
        fast.append((time.perf_counter() - start) * 1e3)
    slow = []
    for _ in range(rebuilt):
        dist.destroy_process_group()
        start = time.perf_counter()
        dist.init_process_group("gloo", rank=rank, world_size=size)
        slow.append((time.perf_counter() - start) * 1e3)
    return fast, slow


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def train_step() -> None:
    ddp_model = DDP(ToyModel())
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    nn.MSELoss()(ddp_model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
    optimizer.step()


def demo_basic(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    train_step()
    dist.destroy_process_group()


def launches_ms(repeats: int) -> tuple[list[float], list[float]]:
    options = {"device": "cpu", "display": "none"}
    nbddp.notebook_launch(train_step, num_workers=2, **options)  # warm
    plain, tutorial = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        nbddp.notebook_launch(train_step, num_workers=2, **options)
        plain.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        nbddp.spawn(demo_basic, args=(2,), nprocs=2, **options)
        tutorial.append((time.perf_counter() - start) * 1e3)
    return plain, tutorial


def main() -> None:
    per_rank = nbddp.notebook_launch(
        time_inits, (200, 20), num_workers=2, device="cpu", display="none", return_all=True
    )
    fast = [t for rank in per_rank for t in rank[0]]
    slow = [t for rank in per_rank for t in rank[1]]
    plain, tutorial = launches_ms(10)
    print("## Issue #25: a tutorial's own init_process_group\n")
    print(f"2 CPU ranks (gloo), {os.cpu_count()} cores; milliseconds.\n")
    print("| what | n | p50 | p90 | p99 | max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = [
        ("`init_process_group` answered (same world: the existing group)", fast),
        (
            "`init_process_group` after the tutorial's destroy (a new gloo group on nbddp's store)",
            slow,
        ),
        ("launch: one DDP step, no setup", plain),
        ("`nbddp.spawn(demo_basic)`: the same step + the tutorial's setup/cleanup", tutorial),
    ]
    for what, values in rows:
        print(f"| {what} | {len(values)} | {percentiles(values)} |")


if __name__ == "__main__":
    main()
