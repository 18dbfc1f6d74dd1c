"""``nbddp.progress``: iterate, show rank 0's progress live, and end the loop at a graceful
stop's agreed step on every rank (``stopping.py``: each item is a check).

On rank 0 the count goes to a bar of the process's :class:`~nbddp.worker.live.LiveBuffer`
(an attribute set per item, shipped by its flusher); on other ranks and in an exported script
only the check runs. Outside a launch the iterable itself is returned.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from nbddp.worker import live
from nbddp.worker.context import is_main
from nbddp.worker.live import LiveBuffer
from nbddp.worker.recovery import stopping

T = TypeVar("T")


def progress(
    iterable: Iterable[T], desc: str | None = None, total: int | None = None
) -> Iterable[T]:
    """Iterate ``iterable``, showing rank 0's progress live (count, rate, ETA); nests.

    Each step is a step boundary for a graceful stop: once one is agreed, the loop ends
    there on every rank ([nbddp.stopping][] is then True). Outside a launch the iterable
    itself is returned, at no cost.

    Args:
        iterable: What to iterate.
        desc: The bar's label ("epoch", "batch").
        total: How many items; defaults to ``len(iterable)`` when it has one.
    """
    buffer = live.current()
    if buffer is None and stopping.current() is None:
        return iterable
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    shown = buffer if buffer is not None and is_main() else None
    return _Progress(shown, iterable, desc, total)


class _Progress(Generic[T]):
    """What ``progress`` returns: iterates, checks for a stop before each item, counts (on
    rank 0, into a panel bar), and keeps ``len``."""

    def __init__(
        self, buffer: LiveBuffer | None, iterable: Iterable[T], desc: str | None, total: int | None
    ) -> None:
        self._buffer = buffer  # None: no bar (another rank, or an exported script)
        self._iterable = iterable
        self.desc = desc
        self.total = total

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar's iterable has no length")
        return self.total

    def __iter__(self) -> Iterator[T]:
        buffer = self._buffer
        bar = buffer.open_bar(self.desc, self.total) if buffer is not None else None
        where = f"nbddp.progress({self.desc!r})" if self.desc else "nbddp.progress"
        check = stopping.check
        items = iter(self._iterable)
        n = 0
        try:
            while True:
                if buffer is not None and buffer.abort is not None:
                    raise buffer.abort
                if check(n, where):  # a step boundary: before the next item is fetched
                    return
                try:
                    item = next(items)
                except StopIteration:
                    return
                yield item
                n += 1
                if bar is not None and buffer is not None:
                    bar.n = n
                    buffer.bars_dirty = True  # an attribute, not a method: this runs per item
        finally:
            if bar is not None and buffer is not None:
                buffer.close_bar(bar)
