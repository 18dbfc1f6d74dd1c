"""Carry the workers' stdout/stderr to the notebook while they run.

One thread reads every worker's pipes with a selector and writes what it reads to the streams
the launching cell had (``sys.stdout``/``sys.stderr`` at launch time). Rank 0's output goes
through as it comes, carriage returns included, so a tqdm bar in a worker still animates;
with ``output="all"`` every rank's lines are prefixed ``[rank N]``. The last lines of each
rank's stderr are kept, whatever ``output`` says, so a rank that dies without a Python
traceback can still be explained.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import os
import selectors
import sys
import threading
import time
from typing import TextIO

from .plan import Output

_TAIL_LINES = 40
_CHUNK = 65536


class _Stream:
    def __init__(self, rank: int, fd: int, target: TextIO | None, prefix: str) -> None:
        self.rank = rank
        self.fd = fd
        self.target = target
        self.prefix = prefix
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = ""  # an unfinished line, held only when lines are prefixed
        self.tail: collections.deque[str] | None = None
        self.closed = threading.Event()


class OutputPump:
    """Reads the workers' pipes until every one of them is closed."""

    def __init__(self, mode: Output, target: TextIO | None = None) -> None:
        """``target`` receives both streams (the live panel); default: the launching cell's
        own ``sys.stdout`` and ``sys.stderr``."""
        self._mode = mode
        self._stdout = target or sys.stdout
        self._stderr = target or sys.stderr
        self._streams: list[_Stream] = []
        self._tails: dict[int, collections.deque[str]] = {}
        self._selector = selectors.DefaultSelector()
        self._thread: threading.Thread | None = None

    def add(self, rank: int, stdout_fd: int, stderr_fd: int) -> None:
        """Register one worker's read ends; call before :meth:`start`."""
        shown = self._mode == "all" or (self._mode == "rank0" and rank == 0)
        prefix = f"[rank {rank}] " if self._mode == "all" else ""
        tail = self._tails.setdefault(rank, collections.deque(maxlen=_TAIL_LINES))
        for fd, target, is_err in ((stdout_fd, self._stdout, False),
                                   (stderr_fd, self._stderr, True)):
            stream = _Stream(rank, fd, target if shown else None, prefix)
            if is_err:
                stream.tail = tail
            self._streams.append(stream)
            self._selector.register(fd, selectors.EVENT_READ, stream)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._pump, name="nbddp-output", daemon=True)
        self._thread.start()

    def wait_closed(self, rank: int, timeout: float) -> None:
        """Wait (briefly) until a rank's pipes reached EOF, i.e. all it wrote was read."""
        deadline = time.monotonic() + timeout
        for stream in self._streams:
            if stream.rank == rank:
                stream.closed.wait(max(0.0, deadline - time.monotonic()))

    def stderr_tail(self, rank: int) -> str:
        return "".join(self._tails.get(rank, ()))

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        for stream in self._streams:  # anything still open (a stuck grandchild) is abandoned
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(stream.fd)
            with contextlib.suppress(OSError):
                os.close(stream.fd)
        self._streams.clear()
        self._selector.close()

    def _pump(self) -> None:
        open_count = len(self._streams)
        while open_count:
            for key, _ in self._selector.select():
                stream: _Stream = key.data
                try:
                    data = os.read(stream.fd, _CHUNK)
                except OSError:
                    data = b""
                if data:
                    self._deliver(stream, stream.decoder.decode(data))
                    continue
                self._deliver(stream, stream.decoder.decode(b"", final=True), final=True)
                self._selector.unregister(stream.fd)
                stream.closed.set()
                open_count -= 1

    def _deliver(self, stream: _Stream, text: str, final: bool = False) -> None:
        if stream.tail is not None and text:
            _append_lines(stream.tail, text)
        if stream.target is None:
            return
        if stream.prefix:
            text = stream.partial + text
            lines = text.split("\n")
            stream.partial = "" if final else lines.pop()
            text = "".join(f"{stream.prefix}{line}\n" for line in lines if line or not final)
        if text:
            try:
                stream.target.write(text)
                stream.target.flush()
            except (OSError, ValueError):  # the notebook's stream went away; keep draining
                stream.target = None


def _append_lines(tail: collections.deque[str], text: str) -> None:
    pieces = text.splitlines(keepends=True)
    if tail and pieces and not tail[-1].endswith("\n"):
        tail[-1] += pieces.pop(0)
    tail.extend(pieces)
