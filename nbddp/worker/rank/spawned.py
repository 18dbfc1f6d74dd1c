"""``torch.multiprocessing.spawn``'s calling convention on an nbddp rank: ``fn(i, *args)``,
``i`` being the rank's local rank, as ``mp.spawn`` passes its process index.

It lives on the worker side because the call travels to the ranks (pickled by reference to
this module); the kernel side of ``nbddp.spawn`` is in ``nbddp/launch.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbddp.worker.context import local_rank


class LocalRankFirst:
    """``fn`` called with this rank's local rank before its arguments."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(local_rank(), *args)

    def __repr__(self) -> str:
        return f"LocalRankFirst({self.fn!r})"
