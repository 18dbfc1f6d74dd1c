"""Who am I in the run: rank, world size, device; and the small collective helpers.

Backed by a :class:`Context` that a launch installs (a worker's entry, or the kernel fallback).
Outside any launch each function answers as rank 0 of a world of 1 on the default device, or,
under another launcher (torchrun) that initialised ``torch.distributed``, as that launcher says.
"""

from __future__ import annotations

import builtins
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["barrier", "device", "is_main", "local_rank", "print", "rank", "world_size"]


@dataclass(frozen=True)
class Context:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


_installed: Context | None = None


@contextmanager
def installed(context: Context) -> Iterator[Context]:
    """Make ``context`` the answer of every runtime function for the duration of a run."""
    global _installed
    previous, _installed = _installed, context
    try:
        yield context
    finally:
        _installed = previous


def current() -> Context:
    if _installed is not None:
        return _installed
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():  # e.g. a script started by torchrun
        local = int(os.environ.get("LOCAL_RANK", "0"))
        on_gpu = _default_device().type == "cuda"
        return Context(
            rank=dist.get_rank(),
            local_rank=local,
            world_size=dist.get_world_size(),
            device=torch.device("cuda", local) if on_gpu else torch.device("cpu"),
        )
    return Context(rank=0, local_rank=0, world_size=1, device=_default_device())


@functools.cache
def _default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def rank() -> int:
    """This process's rank in the run (0 outside a launch)."""
    return current().rank


def local_rank() -> int:
    """This process's rank on this machine; also its GPU index by default."""
    return current().local_rank


def world_size() -> int:
    """How many ranks the run has (1 outside a launch)."""
    return current().world_size


def is_main() -> bool:
    """True on rank 0, the rank whose output and return value reach the notebook."""
    return current().rank == 0


def device() -> torch.device:
    """The device this rank trains on: ``cuda:<local_rank>`` or ``cpu``."""
    return current().device


def print(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed so it reaches the notebook at once."""
    if is_main():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def barrier() -> None:
    """Wait until every rank gets here; a no-op in a world of 1."""
    dist = torch.distributed
    if world_size() > 1 and dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device().index])
        else:
            dist.barrier()
