"""The training step the per-step overhead benchmarks time (``live_overhead.py``,
``debug_overhead.py``, ``stopping.py``), built on a rank: "natural", a small MLP trained with
DDP; or one matrix product of ``size`` (next to no work a step, so that a fixed cost per step
shows). The benchmarks' rank functions import it by name: the ranks get the launching
script's ``sys.path``, this folder included."""

from __future__ import annotations

from collections.abc import Callable

import torch

import nbddp


def make_step(kind: str, size: int = 16) -> Callable[[], torch.Tensor]:
    """One step of ``kind`` ("natural", or a ``size`` x ``size`` matrix product); each call
    returns the step's loss (detached)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    if kind != "natural":
        a = torch.randn(size, size)
        return lambda: (a @ a).sum()
    model = nbddp.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step
