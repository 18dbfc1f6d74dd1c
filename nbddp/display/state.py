"""The one model of a run that every view renders: status, bars, metrics, output, outcome.

Written by the supervisor (messages from the workers, output) or by the in-kernel fallback;
read by the views. Every change bumps ``version`` and notifies ``changed``, so a view renders
only when something changed, at the rate it chooses.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from array import array
from typing import Any

MAX_HISTORY_ROWS = 1_000_000
OUTPUT_LINES = 200


class History:
    """The averaged metric rows, column by column (8 bytes a value).

    Memory policy: every row is kept until there are ``max_rows``; then every other row is
    dropped and from then on only every 2nd (then 4th, ...) row is kept, so a run of any length
    holds at most ``max_rows`` rows, evenly spread over the whole run.
    """

    def __init__(self, max_rows: int = MAX_HISTORY_ROWS) -> None:
        self.max_rows = max_rows
        self.stride = 1
        self.steps = array("q")
        self.epochs = array("q")  # -1: unknown
        self.columns: dict[str, array] = {}
        self._cache: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def append(self, step: int, epoch: int | None, values: dict[str, float]) -> None:
        if step % self.stride:
            return
        n = len(self.steps)
        self.steps.append(step)
        self.epochs.append(-1 if epoch is None else epoch)
        columns = self.columns
        if values.keys() == columns.keys():
            for name, value in values.items():
                columns[name].append(value)
        else:
            for name, value in values.items():
                if name not in columns:
                    columns[name] = array("d", [math.nan]) * n
                columns[name].append(value)
            for name, column in columns.items():
                if name not in values:
                    column.append(math.nan)
        self._cache = None
        if len(self.steps) >= self.max_rows:
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
        if n <= points:
            indices = range(n)
            window = 1
        else:
            indices = [int(i * (n - 1) / (points - 1)) for i in range(points)]
            window = min(window, max(1, n // points))
        out = []
        for i in indices:
            values = [v for v in column[max(0, i - window + 1):i + 1] if not math.isnan(v)]
            if values:
                out.append((float(steps[i]), sum(values) / len(values)))
        return out


class MetricsAggregator:
    """Averages row k across ranks once every rank delivered its k-th row.

    Rule for ranks that log different keys in the same row: each key is averaged over the
    ranks that logged it, and one note says which ranks differed (no silent mix-up).
    Rows still incomplete when the run ends are averaged over the ranks that logged them.
    """

    def __init__(self, world_size: int, history: History) -> None:
        self.world_size = world_size
        self.history = history
        self.latest: dict[str, float] = {}
        self.notes: list[str] = []
        self._pending: dict[int, dict[int, tuple[int | None, dict[str, float]]]] = {}
        self._next = 0

    def add(self, rank: int, first: int, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        pending = self._pending
        for step, row in enumerate(rows, first):
            by_rank = pending.get(step)
            if by_rank is None:
                pending[step] = {rank: row}
            else:
                by_rank[rank] = row
        world, step = self.world_size, self._next
        while len(pending.get(step, ())) == world:
            self._emit(step)
            step += 1

    def finish(self) -> None:
        for step in sorted(self._pending):
            self._emit(step)

    def _emit(self, step: int) -> None:
        by_rank = self._pending.pop(step)
        self._next = step + 1
        rows = list(by_rank.values())
        epoch = by_rank[0][0] if 0 in by_rank else rows[0][0]
        keys = rows[0][1].keys()
        if all(values.keys() == keys for _, values in rows):  # the common case, kept fast
            n = len(rows)
            averaged = {k: sum(values[k] for _, values in rows) / n for k in keys}
            self.latest.update(averaged)
            self.history.append(step, epoch, averaged)
            return
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for _, values in by_rank.values():
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + value
                counts[name] = counts.get(name, 0) + 1
        averaged = {name: sums[name] / counts[name] for name in sums}
        if not self.notes and len(set(counts.values()) | {len(by_rank)}) > 1:
            partial = sorted(n for n, c in counts.items() if c < len(by_rank))
            self.notes.append(
                f"row {step}: not every rank logged {', '.join(partial)}; each metric is "
                "averaged over the ranks that logged it."
            )
        self.latest.update(averaged)
        self.history.append(step, epoch, averaged)


class RunState:
    """Everything a view shows about one run."""

    def __init__(self, world_size: int, device: str, backend: str, device_name: str) -> None:
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.device_name = device_name
        self.status = "starting"
        self.started = time.monotonic()
        self.ended: float | None = None
        self.error_line = ""
        self.bars: dict[int, dict[str, Any]] = {}
        self.history = History()
        self.metrics = MetricsAggregator(world_size, self.history)
        self.output: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self.output_dropped = 0
        self.version = 0
        self.changed = threading.Condition()

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def _bump(self) -> None:
        with self.changed:
            self.version += 1
            self.changed.notify_all()

    def set_running(self) -> None:
        if self.status == "starting":
            self.status = "running"
            self._bump()

    def add_rows(self, rank: int, first: int, rows: list) -> None:
        with self.changed:
            self.metrics.add(rank, first, rows)
        self.set_running()
        self._bump()

    def set_bars(self, snapshot: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        with self.changed:
            for bar in snapshot:
                previous = self.bars.get(bar["id"])
                if previous is None and bar["level"] == 0:  # a new outer loop: finished
                    self.bars = {i: b for i, b in self.bars.items() if not b["closed"]}
                bar["rate"] = _rate(previous, bar)
                bar["seen"] = now
                if bar["closed"] and bar["level"] > 0:  # like tqdm: finished inner bars go,
                    self.bars.pop(bar["id"], None)       # the outermost one stays
                else:
                    self.bars[bar["id"]] = bar
        self.set_running()
        self._bump()

    def add_output(self, text: str) -> None:
        with self.changed:
            pieces = text.splitlines(keepends=True)
            if self.output and pieces and not self.output[-1].endswith("\n"):
                self.output[-1] += pieces.pop(0)
            for piece in pieces:
                if "\r" in piece:  # a carriage-return animation: keep its last frame
                    end = "\n" if piece.endswith("\n") else ""
                    piece = piece.rstrip("\n").rsplit("\r", 1)[-1] + end
                if len(self.output) == self.output.maxlen:
                    self.output_dropped += 1
                self.output.append(piece)
        self._bump()

    def as_stream(self) -> _PanelStream:
        """A file-like object whose writes land in the panel's output area."""
        return _PanelStream(self)

    def finish(self, status: str, error: BaseException | None) -> None:
        with self.changed:
            self.metrics.finish()
            self.status = status
            self.ended = time.monotonic()
            if error is not None:
                self.error_line = first_line(error)
        self._bump()

    def snapshot_bars(self) -> list[dict[str, Any]]:
        with self.changed:
            return sorted(self.bars.values(), key=lambda b: (b["level"], b["id"]))


class _PanelStream:
    def __init__(self, state: RunState) -> None:
        self._state = state

    def write(self, text: str) -> int:
        self._state.add_output(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _rate(previous: dict[str, Any] | None, bar: dict[str, Any]) -> float | None:
    """Items per second, smoothed like tqdm's (exponential moving average)."""
    if bar["elapsed"] <= 0:
        return None
    overall = bar["n"] / bar["elapsed"]
    if previous is None or previous.get("rate") is None:
        return overall
    dt = bar["elapsed"] - previous["elapsed"]
    if dt <= 0:
        return previous["rate"]
    recent = (bar["n"] - previous["n"]) / dt
    return 0.3 * recent + 0.7 * previous["rate"]


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
