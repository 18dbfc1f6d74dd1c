"""A detached run's record: every event appended to one file as it comes, readable while it
grows and after a crash of whoever wrote it.

``events.log`` is a header line, then frames: a little-endian ``u32`` length and ``u32``
CRC-32 of the body, then the body (the pickle of one :class:`Event`). The writer appends each
frame with one ``write()`` on a descriptor opened ``O_APPEND``; a reader takes whole frames
whose checksum holds and stops at the first one that is incomplete or torn (still being
written, or cut by a kill): what follows it is not there yet, or never will be. Offsets are
byte positions in the file, so "everything before offset N" is a well-defined replay.

Non-goal: durability across a machine crash beyond ``fsync`` at the run's end (a killed
supervisor loses nothing it wrote: the page cache holds it).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

MAGIC = b"nbddp-run-log 1\n"
_FRAME = struct.Struct("<II")  # body length, crc32 of the body
MAX_BODY = 1 << 30  # a frame claiming more is torn


class Event(NamedTuple):
    """One thing that happened: a :class:`~nbddp.backend.RunEvents` call by its method's name
    and arguments (``("rows", (rank, first, blocks))``), ``output`` (text the ranks printed)
    or ``end`` (an :class:`~nbddp.detached.outcome.Ending`), and when (``time.time()``)."""

    kind: str
    args: tuple[Any, ...]
    at: float


def encode(kind: str, *args: Any) -> bytes:
    """An event, now, as the body of its frame (and of a ``link.Live`` message)."""
    return pickle.dumps(Event(kind, args, time.time()), protocol=5)


def decode(body: bytes) -> Event | None:
    try:
        event = pickle.loads(body)
    except Exception:  # a class this process cannot rebuild
        return None
    return event if isinstance(event, Event) else None


class LogWriter:
    """Appends events; thread-safe. ``size`` is the offset after the last whole frame."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._lock = threading.Lock()
        self.size = os.fstat(self._fd).st_size
        if self.size == 0:
            self._write(MAGIC)

    def append(self, body: bytes) -> int:
        """Write one event (``encode``'s); return the offset after it. An error (a full disk)
        is raised, and the file stays whole up to the last frame written entirely."""
        data = _FRAME.pack(len(body), zlib.crc32(body)) + body
        with self._lock:
            self._write(data)
            return self.size

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        written = 0
        try:
            while written < len(view):
                written += os.write(self._fd, view[written:])
        except OSError:
            if written:  # a partial frame: cut it off, so that later frames stay readable
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self.size)
            raise
        self.size += written

    def sync(self) -> None:
        with contextlib.suppress(OSError):
            os.fsync(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def read_events(path: str, start: int = 0, end: int | None = None) -> Iterator[tuple[Event, int]]:
    """Each whole event from offset ``start`` (0: the file's beginning) up to ``end`` (None:
    as far as the file is whole), with the offset after it. Stops at a torn or incomplete
    frame. A missing file has no events."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (a generator: closed in finally)
    except FileNotFoundError:
        return
    try:
        if start == 0:
            if f.read(len(MAGIC)) != MAGIC:
                return
            start = len(MAGIC)
        else:
            f.seek(start)
        offset = start
        while end is None or offset < end:
            head = f.read(_FRAME.size)
            if len(head) < _FRAME.size:
                return
            length, crc = _FRAME.unpack(head)
            if length > MAX_BODY:
                return
            body = f.read(length)
            if len(body) < length or zlib.crc32(body) != crc:
                return
            offset += _FRAME.size + length
            event = decode(body)
            if event is not None:  # else a class this process cannot rebuild: skipped
                yield event, offset
    finally:
        f.close()


def last_event(path: str, kind: str) -> Event | None:
    """The last event of ``kind`` in the log (a run's ``end``), reading it whole."""
    found = None
    for event, _ in read_events(path):
        if event.kind == kind:
            found = event
    return found
