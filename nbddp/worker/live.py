"""``nbddp.log`` and ``nbddp.progress``: cheap on the training thread, delivered in batches.

The training thread only appends to a buffer: a logged CUDA tensor is detached, never read, so
no call waits for the GPU. A flusher thread wakes every ``FLUSH_INTERVAL`` seconds, turns the
pending tensors into floats with one device-to-host copy per device, and hands the rows and a
snapshot of rank 0's progress bars to a sink: the channel in a worker, the run's state in the
kernel fallback. Outside any launch there is no sink and both functions do nothing but pass
values through.

Row k of the history is the k-th ``log`` call of every rank, averaged by the kernel.
"""

from __future__ import annotations

import collections
import numbers
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from .context import is_main

FLUSH_INTERVAL = 0.05
PROGRESS_INTERVAL = 0.1  # seconds between two snapshots of a bar the flusher may send
T = TypeVar("T")

Sink = Callable[[str, Any], None]  # sink("log", (first_step, rows)) / sink("progress", bars)


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

    def snapshot(self) -> dict[str, Any]:
        return {"id": self.id, "level": self.level, "desc": self.desc, "n": self.n,
                "total": self.total, "elapsed": time.monotonic() - self.started,
                "closed": self.closed}


class LiveBuffer:
    """This process's pending log rows and progress bars, and the thread that ships them."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._lock = threading.Lock()  # for bars and flushing; log() appends without it
        self._rows: collections.deque[tuple[int | None, dict[str, Any]]] = collections.deque()
        self._sent = 0  # rows already handed to the sink
        self._bars: list[_Bar] = []  # the active stack, outermost first
        self._closed: list[dict[str, Any]] = []  # bars closed since the last snapshot
        self._bars_dirty = False
        self._next_bar = 0
        self.epoch: int | None = None  # the current pass of a prepared loader, if any
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbddp-live", daemon=True)
        self._thread.start()

    # called on the training thread

    def log(self, row: dict[str, Any]) -> None:
        """``row`` is a fresh dict the caller gives away: converted in place, no copy."""
        for name, value in row.items():  # the common cases inline: this runs every step
            if type(value) is float:
                continue
            if type(value) is torch.Tensor and value.is_cpu and value.numel() == 1:
                row[name] = value.item()  # reading a CPU tensor never waits for a device
            else:
                row[name] = _scalar(name, value)
        bars = self._bars  # nested bars: the outer one counts epochs
        self._rows.append((bars[0].n if len(bars) >= 2 else self.epoch, row))  # atomic

    def open_bar(self, desc: str | None, total: int | None) -> _Bar:
        with self._lock:
            bar = _Bar(self._next_bar, len(self._bars), desc, total)
            self._next_bar += 1
            self._bars.append(bar)
            self._bars_dirty = True
        return bar

    def close_bar(self, bar: _Bar) -> None:
        with self._lock:
            bar.closed = True
            self._closed.append(bar.snapshot())
            if bar in self._bars:
                self._bars.remove(bar)
            self._bars_dirty = True

    # the flusher

    def _run(self) -> None:
        last_bars = 0.0
        while not self._stopping.wait(FLUSH_INTERVAL):
            now = time.monotonic()
            self.flush(bars=now - last_bars >= PROGRESS_INTERVAL)
            if now - last_bars >= PROGRESS_INTERVAL:
                last_bars = now

    def flush(self, bars: bool = True) -> None:
        with self._lock:
            rows = [self._rows.popleft() for _ in range(len(self._rows))]
            first = self._sent
            self._sent += len(rows)
            snapshot = None
            if bars and self._bars_dirty:
                snapshot = self._closed + [b.snapshot() for b in self._bars]
                self._closed = []
                self._bars_dirty = False
        if rows:
            self._sink("log", (first, _to_floats(rows)))
        if snapshot is not None:
            self._sink("progress", snapshot)

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
        return value.detach()  # read later, by the flusher, in one copy per device
    if isinstance(value, float):
        return value
    if isinstance(value, numbers.Real):  # int, bool, numpy scalars
        return float(value)
    raise TypeError(
        f"nbddp.log: {name!r} must be a number or a one-element tensor, got "
        f"{type(value).__name__}."
    )


def _to_floats(
    rows: list[tuple[int | None, dict[str, Any]]],
) -> list[tuple[int | None, dict[str, float]]]:
    """Device tensors become floats with one device-to-host copy per (device, dtype, shape)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, row in rows:
        for value in row.values():
            if isinstance(value, torch.Tensor):
                groups.setdefault((value.device, value.dtype, value.shape), []).append(value)
    if not groups:
        return rows
    floats: dict[int, float] = {}
    for tensors in groups.values():
        values = torch.stack(tensors).reshape(-1).to(torch.float64).cpu().tolist()
        floats.update(zip(map(id, tensors), values, strict=True))
    return [
        (epoch, {k: floats[id(v)] if isinstance(v, torch.Tensor) else v for k, v in row.items()})
        for epoch, row in rows
    ]


# the process's buffer, installed by a worker's entry or by the kernel fallback

_buffer: LiveBuffer | None = None


def install(buffer: LiveBuffer | None) -> LiveBuffer | None:
    global _buffer
    previous, _buffer = _buffer, buffer
    return previous


def set_epoch(epoch: int) -> None:
    if _buffer is not None:
        _buffer.epoch = epoch


def log(metrics: Mapping[str, Any] | None = None, /, **named: Any) -> None:
    """Record scalars (numbers or one-element tensors on any device) for this step.

    Values are averaged across ranks: the k-th call on every rank forms row k of
    ``run.history`` (with its ``step`` and, where known, ``epoch``), shown live. The call never
    waits for the GPU or the network.
    """
    if _buffer is None:
        return
    if metrics:
        named = {**metrics, **named}
    if named:
        _buffer.log(named)  # a dict of our own: the call made it


def progress(
    iterable: Iterable[T], desc: str | None = None, total: int | None = None
) -> Iterable[T]:
    """Iterate ``iterable``, showing rank 0's progress live (count, rate, ETA); nests.

    ``total`` defaults to ``len(iterable)`` when it has one. On other ranks (and outside a
    launch) the iterable itself is returned, at no cost.
    """
    if _buffer is None or not is_main():
        return iterable
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    return _Progress(_buffer, iterable, desc, total)


class _Progress(Generic[T]):
    """What ``progress`` returns on rank 0: iterates, counts, and keeps ``len``."""

    def __init__(self, buffer: LiveBuffer, iterable: Iterable[T], desc: str | None,
                 total: int | None) -> None:
        self._buffer = buffer
        self._iterable = iterable
        self.desc = desc
        self.total = total

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar's iterable has no length")
        return self.total

    def __iter__(self) -> Iterator[T]:
        buffer = self._buffer
        bar = buffer.open_bar(self.desc, self.total)
        try:
            for item in self._iterable:
                yield item
                bar.n += 1
                buffer._bars_dirty = True
        finally:
            buffer.close_bar(bar)
