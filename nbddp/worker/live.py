"""``nbddp.log`` and the bars of ``nbddp.progress`` (``progress.py``): cheap on the training
thread, delivered in batches.

The training thread only appends to a buffer: a logged CUDA tensor is copied on its device (a
queued copy, so a running sum changed in place later keeps the logged value), never read, so
no call waits for the GPU. A flusher thread wakes every ``FLUSH_INTERVAL`` seconds, turns the
pending tensors into floats with one device-to-host copy per device, and hands the rows and a
snapshot of rank 0's progress bars to a :class:`LiveSink`: the channel in a rank, the run's
state when the kernel runs the one rank itself. Outside any launch there is no sink and both
functions do nothing but pass values through.

The hand-off takes no lock: the training thread appends a row with one ``list.extend`` and the
flusher takes a prefix with a slice and ``del``. Each is atomic on one list, under the GIL and
under free-threaded CPython alike (per-object locks), so the flusher sees all of a row or none.

Row k of the history is the k-th ``log`` call of every rank, averaged by the kernel.
"""

from __future__ import annotations

import collections
import numbers
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from nbddp.wire.messages import BarSnapshot, Block

FLUSH_INTERVAL = 0.05
PROGRESS_INTERVAL = 0.1  # seconds between two snapshots of a bar the flusher may send


class LiveSink(Protocol):
    """Where the flusher delivers: called every ``FLUSH_INTERVAL`` at most, never per step."""

    def rows(self, first: int, blocks: list[Block]) -> None: ...

    def main_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None: ...

    def bars(self, bars: list[BarSnapshot]) -> None: ...


class _Block:
    """Consecutive rows with the same epoch and keys: their values row after row."""

    __slots__ = ("epoch", "keys", "unread", "values")

    def __init__(self, epoch: int | None, keys: tuple[str, ...]) -> None:
        self.epoch = epoch
        self.keys = keys
        self.values: list[Any] = []
        self.unread = False  # a device tensor among the values, read by the flusher


class _Bar:
    __slots__ = ("closed", "desc", "id", "level", "n", "started", "total")

    def __init__(self, bar_id: int, level: int, desc: str | None, total: int | None) -> None:
        self.id = bar_id
        self.level = level
        self.desc = desc
        self.total = total
        self.n = 0
        self.started = time.monotonic()
        self.closed = False

    def snapshot(self) -> BarSnapshot:
        return BarSnapshot(
            self.id,
            self.level,
            self.desc,
            self.n,
            self.total,
            time.monotonic() - self.started,
            self.closed,
        )


class LiveBuffer:
    """This process's pending log rows and progress bars, and the thread that ships them.

    Rows are kept as they will be sent: a block per run of rows with the same keys and epoch,
    its values in one flat list, row after row. A logged step thus leaves no object behind for
    the garbage collector, and takes no lock: the training thread only appends (one atomic
    ``list.extend`` a row, or a new block), the flusher only takes what is complete.
    """

    def __init__(self, sink: LiveSink) -> None:
        self._sink = sink
        self._lock = threading.Lock()  # for the bars
        self._flushing = threading.Lock()  # one flush at a time: rows leave in order
        self._queue: collections.deque[_Block] = collections.deque()  # the last one is open
        self._open: _Block | None = None  # the block log() extends
        self._sent = 0  # rows already handed to the sink
        self._bars: list[_Bar] = []  # the active stack, outermost first
        self._closed: list[BarSnapshot] = []  # bars closed since the last snapshot
        self.bars_dirty = False  # a bar moved since the last snapshot
        self._main_rows: list[tuple[int | None, dict[str, float]]] = []  # log_main's
        self._next_bar = 0
        self.epoch: int | None = None  # the current pass of a prepared loader, if any
        # Set by a stop of a run in the kernel: log() and progress() raise it, a clean point
        # to end the user's loop (see in_kernel.py).
        self.abort: type[BaseException] | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbddp-live", daemon=True)
        self._thread.start()

    # called on the training thread

    def log(self, row: dict[str, Any]) -> None:
        """``row`` is a fresh dict the caller gives away: converted in place, no copy."""
        if self.abort is not None:
            raise self.abort
        unread = False  # a device tensor, read later
        for name, value in row.items():  # the common cases inline: this runs every step
            if type(value) is float:
                continue
            if type(value) is torch.Tensor and value.is_cpu:
                try:
                    row[name] = value.item()  # reading a CPU tensor never waits for a device
                    continue
                except RuntimeError:  # more than one element: _scalar explains
                    pass
            row[name] = value = _scalar(name, value)
            unread = unread or type(value) is not float
        bars = self._bars  # nested bars: the outer one counts epochs
        epoch = bars[0].n if len(bars) >= 2 else self.epoch
        keys = tuple(row)
        block = self._open
        if block is None or keys != block.keys or epoch != block.epoch:
            block = self._open = _Block(epoch, keys)
            self._queue.append(block)
        if unread:
            block.unread = True  # before the values: the flusher reads them first, then this
        block.values.extend(row.values())  # atomic: the flusher sees all of a row or none

    def log_main(self, values: Mapping[str, Any], step: int | None) -> None:
        """Rank 0's own row, not to be averaged (a library logged it on the main process
        only, or already reduced): shipped by the flusher like the others."""
        row = {name: _scalar(name, value) for name, value in values.items()}
        row = {name: v if type(v) is float else float(v.item()) for name, v in row.items()}
        self._main_rows.append((step, row))

    def _take_rows(self) -> tuple[int, list[Block]]:
        """On the flusher: the rows logged so far, as blocks, and the index of the first."""
        first = self._sent
        blocks: list[Block] = []
        queue = self._queue
        pending = list(queue)
        for i, block in enumerate(pending):
            values = block.values
            if i < len(pending) - 1:  # a later block exists: this one is complete
                queue.popleft()
                rows = values
            else:  # maybe still open: take what is there
                rows = values[: len(values)]
                del values[: len(rows)]
            if rows:
                width = len(block.keys)
                blocks.append((block.epoch, block.keys, [rows[k::width] for k in range(width)]))
                self._sent += len(rows) // width
        if any(block.unread for block in pending):
            _read_tensors(blocks)
        return first, blocks

    def open_bar(self, desc: str | None, total: int | None) -> _Bar:
        with self._lock:
            bar = _Bar(self._next_bar, len(self._bars), desc, total)
            self._next_bar += 1
            self._bars.append(bar)
            self.bars_dirty = True
        return bar

    def close_bar(self, bar: _Bar) -> None:
        with self._lock:
            bar.closed = True
            self._closed.append(bar.snapshot())
            if bar in self._bars:
                self._bars.remove(bar)
            self.bars_dirty = True

    # the flusher

    def _run(self) -> None:
        last_bars = 0.0
        while not self._stopping.wait(FLUSH_INTERVAL):
            now = time.monotonic()
            bars_due = now - last_bars >= PROGRESS_INTERVAL
            self.flush(bars=bars_due)
            if bars_due:
                last_bars = now

    def flush(self, bars: bool = True) -> None:
        with self._flushing:
            first, blocks = self._take_rows()
            snapshot = None
            if bars and self.bars_dirty:
                with self._lock:
                    snapshot = self._closed + [b.snapshot() for b in self._bars]
                    self._closed = []
                    self.bars_dirty = False
            if blocks:
                self._sink.rows(first, blocks)
            if self._main_rows:
                main, self._main_rows = self._main_rows, []
                self._sink.main_rows(main)
            if snapshot is not None:
                self._sink.bars(snapshot)

    def close(self) -> None:
        """Ship everything still pending; called when fn returns or raises."""
        self._stopping.set()
        self._thread.join(timeout=2)
        self.flush()


def _scalar(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"nbddp.log: {name!r} must be a scalar, got a tensor of shape "
                f"{list(value.shape)}; log {name}.mean() or one element."
            )
        if value.device.type == "cpu":
            return value.item()  # reading a CPU tensor never waits for a device
        # A copy queued on the device: a running total changed in place later must not change
        # what was logged. Read later, by the flusher, in one copy to the host per device.
        return value.detach().clone()
    if isinstance(value, float):
        return value
    if isinstance(value, numbers.Real):  # int, bool, numpy scalars
        return float(value)
    raise TypeError(
        f"nbddp.log: {name!r} must be a number or a one-element tensor, got {type(value).__name__}."
    )


def _read_tensors(blocks: list[Block]) -> None:
    """Device tensors become floats, in place, with one device-to-host copy per
    (device, dtype, shape)."""
    groups: dict[tuple[Any, ...], list[tuple[list[Any], int]]] = {}
    for _, _, columns in blocks:
        for column in columns:
            values: list[Any] = column  # floats, and the device tensors read here
            for i, value in enumerate(values):
                if type(value) is not float:
                    groups.setdefault((value.device, value.dtype, value.shape), []).append(
                        (column, i)
                    )
    for places in groups.values():
        stacked = torch.stack([column[i] for column, i in places])
        values = stacked.reshape(-1).to(torch.float64).cpu().tolist()
        for (column, i), value in zip(places, values, strict=True):
            column[i] = value


# the process's buffer, installed by a worker's entry or by the kernel fallback

_buffer: LiveBuffer | None = None


def install(buffer: LiveBuffer | None) -> LiveBuffer | None:
    global _buffer
    previous, _buffer = _buffer, buffer
    return previous


def current() -> LiveBuffer | None:
    """This process's buffer while a run is going, else None."""
    return _buffer


def set_epoch(epoch: int) -> None:
    if _buffer is not None:
        _buffer.epoch = epoch


def log(metrics: Mapping[str, Any] | None = None, /, **named: Any) -> None:
    """Record scalars (numbers or one-element tensors on any device) for this step.

    Values are averaged across ranks: the k-th call on every rank forms row k of
    ``run.history`` (with its ``step`` and, where known, ``epoch``), shown live. The call never
    waits for the GPU or the network. Outside a launch it does nothing.

    Args:
        metrics: A dict of name to value, e.g. ``nbddp.log({"val/loss": loss})``.
        **named: Values by name, e.g. ``nbddp.log(loss=loss, acc=acc)``.
    """
    if _buffer is None:
        return
    if metrics:
        named = {**metrics, **named}
    if named:
        _buffer.log(named)  # a dict of our own: the call made it
