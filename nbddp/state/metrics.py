"""The metrics of ``nbddp.log``: row k of every rank averaged into one row of the history.

:class:`MetricsAggregator` averages; :class:`History` keeps the averaged rows, column by
column, in bounded memory. Both are plain data structures: the run's state model guards them
with its lock.
"""

from __future__ import annotations

import collections
import math
from array import array
from collections.abc import Sequence
from typing import Any

from nbddp.wire.messages import Block

MAX_HISTORY_ROWS = 1_000_000


class History:
    """The averaged metric rows, column by column (8 bytes a value).

    Memory policy: every row is kept until there are ``max_rows``; then every other row is
    dropped and from then on only every 2nd (then 4th, ...) row is kept, so a run of any length
    holds at most ``max_rows`` rows, evenly spread over the whole run.
    """

    def __init__(self, max_rows: int = MAX_HISTORY_ROWS) -> None:
        self.max_rows = max_rows
        self.stride = 1
        self.steps: array[int] = array("q")
        self.epochs: array[int] = array("q")  # -1: unknown
        self.columns: dict[str, array[float]] = {}
        self._cache: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def extend(self, first: int, epoch: int | None, values: dict[str, list[float]]) -> None:
        """Rows ``first``, ``first + 1``, ... of one epoch: a list of values per metric."""
        count = len(next(iter(values.values())))
        stride = self.stride
        skip = -first % stride  # the first row on the stride's grid
        if skip >= count:
            return
        kept = len(range(skip, count, stride))
        before = len(self.steps)
        self.steps.extend(range(first + skip, first + count, stride))
        self.epochs.extend(array("q", [-1 if epoch is None else epoch]) * kept)
        columns = self.columns
        for name, column in columns.items():
            if name not in values:
                column.extend(_nans(kept))
        for name, new in values.items():
            if name not in columns:
                columns[name] = _nans(before)
            column = columns[name]
            column.extend(new[skip::stride] if stride > 1 else new)
        self._cache = None
        while len(self.steps) >= self.max_rows:
            self._halve()

    def _halve(self) -> None:
        self.stride *= 2
        keep = [i for i, step in enumerate(self.steps) if step % self.stride == 0]
        self.steps = array("q", (self.steps[i] for i in keep))
        self.epochs = array("q", (self.epochs[i] for i in keep))
        for name, column in self.columns.items():
            self.columns[name] = array("d", (column[i] for i in keep))

    def rows(self) -> list[dict[str, Any]]:
        """As ``run.history`` shows them: one dict a row, ``step``, ``epoch`` if known."""
        if self._cache is None:
            rows = []
            for i, step in enumerate(self.steps):
                row: dict[str, Any] = {"step": step}
                if self.epochs[i] >= 0:
                    row["epoch"] = self.epochs[i]
                for name, column in self.columns.items():
                    if not math.isnan(column[i]):
                        row[name] = column[i]
                rows.append(row)
            self._cache = rows
        return self._cache

    def series(self, name: str, points: int = 300, window: int = 8) -> list[tuple[float, float]]:
        """At most ``points`` (step, value) pairs of one metric for a chart: evenly spaced
        samples, each the mean of up to ``window`` rows. O(points), however long the run."""
        column, steps = self.columns[name], self.steps
        n = len(steps)
        indices: Sequence[int]
        if n <= points:
            indices = range(n)
            window = 1
        else:
            indices = [int(i * (n - 1) / (points - 1)) for i in range(points)]
            window = min(window, max(1, n // points))
        out = []
        for i in indices:
            values = [v for v in column[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
            if values:
                out.append((float(steps[i]), sum(values) / len(values)))
        return out


def _nans(count: int) -> array[float]:
    return array("d", [math.nan]) * count


class _Span:
    """Consecutive rows of one rank with the same keys and epoch, a column per key."""

    __slots__ = ("columns", "end", "epoch", "index", "start")

    def __init__(self, start: int, block: Block) -> None:
        self.epoch, keys, self.columns = block
        self.index = {key: i for i, key in enumerate(keys)}
        self.start = start
        self.end = start + len(self.columns[0])

    def column(self, key: str, start: int, end: int) -> list[float]:
        return self.columns[self.index[key]][start - self.start : end - self.start]


class MetricsAggregator:
    """Averages row k across ranks once every rank delivered its k-th row.

    Rows arrive in blocks (a list of values per metric) and are averaged a column at a time,
    so the kernel's cost per logged step stays far below a microsecond.

    Rule for ranks that log different keys in the same row: each key is averaged over the
    ranks that logged it, and one note says which ranks differed (no silent mix-up).
    Rows still incomplete when the run ends are averaged over the ranks that logged them.
    """

    def __init__(self, world_size: int, history: History) -> None:
        self.world_size = world_size
        self.history = history
        self.latest: dict[str, float] = {}
        self.notes: list[str] = []
        self._spans: list[collections.deque[_Span]] = [
            collections.deque() for _ in range(world_size)
        ]
        self._delivered = [0] * world_size  # rows each rank has sent, in order
        self._next = 0  # the first row not averaged yet

    def add(self, rank: int, first: int, blocks: list[Block]) -> None:
        """Rank ``rank``'s rows ``first``, ``first + 1``, ... (each rank's rows come in order)."""
        spans = self._spans[rank]
        for block in blocks:
            span = _Span(first, block)
            spans.append(span)
            first = span.end
        self._delivered[rank] = first
        self._average_until(min(self._delivered))

    def add_main(self, step: int | None, values: dict[str, float]) -> None:
        """One row rank 0 logged alone (a library's tracker on the main process): kept as it
        is, at the library's step (or after the last row)."""
        if not values:
            return
        at = step if step is not None else (self.history.steps[-1] + 1 if len(self.history) else 0)
        self.history.extend(at, None, {name: [value] for name, value in values.items()})
        self.latest.update(values)

    def finish(self) -> None:
        self._average_until(max(self._delivered))

    def _average_until(self, end: int) -> None:
        while self._next < end:
            start = self._next
            covering: list[tuple[int, _Span]] = []
            stop = end
            for rank, spans in enumerate(self._spans):
                while spans and spans[0].end <= start:
                    spans.popleft()
                if spans and spans[0].start <= start:
                    covering.append((rank, spans[0]))
                    stop = min(stop, spans[0].end)
            self._average(start, stop, covering)
            self._next = stop

    def _average(self, start: int, end: int, covering: list[tuple[int, _Span]]) -> None:
        names = dict.fromkeys(key for _, span in covering for key in span.index)
        averaged: dict[str, list[float]] = {}
        partial = []
        for name in names:
            columns = [span.column(name, start, end) for _, span in covering if name in span.index]
            if len(columns) < len(covering):
                partial.append(name)
            averaged[name] = _mean(columns)
        if partial and not self.notes:
            self.notes.append(
                f"row {start}: not every rank logged {', '.join(partial)}; each metric is "
                "averaged over the ranks that logged it."
            )
        self.history.extend(start, covering[0][1].epoch, averaged)  # rank 0's epoch first
        self.latest.update({name: values[-1] for name, values in averaged.items()})


def _mean(columns: list[list[float]]) -> list[float]:
    if len(columns) == 1:
        return columns[0]
    n = len(columns)
    return [sum(values) / n for values in zip(*columns, strict=True)]
