"""Carry the ranks' stdout/stderr to the notebook while they run, in bounded memory.

The supervisor's loop calls :meth:`OutputPump.read` when a rank's pipe is readable; what was
read goes to the streams the launching cell had (``sys.stdout``/``sys.stderr`` at launch
time) or to the live panel. Rank 0's output goes through as it comes, carriage returns
included, so a tqdm bar in a rank still animates; with ``output="all"`` every line (and every
carriage-return redraw) is prefixed ``[rank N]``. The last lines of each rank's stderr are kept
whatever ``output`` says (:class:`LineWindow`), so a rank that dies without a Python traceback
can still be explained.

Time and memory stay linear in what a rank writes, even without a newline: an open line longer
than ``MAX_LINE`` characters is cut with a marker.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import sys

from nbddp.backend import Writable
from nbddp.state.terminal import MAX_LINE, CellStream, LineWindow
from nbddp.wire.messages import Output

_TAIL_LINES = 40
_CHUNK = 65536
_LINE_STARTS = re.compile(r"(\r(?!\n)|\n)(?=[^\r\n])")


class _Pipe:
    def __init__(
        self, rank: int, fd: int, target: Writable | None, prefix: str, tail: LineWindow | None
    ) -> None:
        self.rank = rank
        self.fd = fd
        self.target = target
        self.prefix = prefix
        self.tail = tail
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.at_line_start = True
        self.held: list[str] = []  # with a prefix: the open line, until it ends
        self.held_length = 0
        self.open = True


class OutputPump:
    """Reads the ranks' pipes when the supervisor says they are readable."""

    def __init__(self, mode: Output, target: Writable | None = None) -> None:
        """``target`` receives both streams (the live panel); default: the launching cell's
        own ``sys.stdout`` and ``sys.stderr``."""
        self._mode = mode
        self._stdout: Writable = target or sys.stdout
        self._stderr: Writable = target or sys.stderr
        self._pipes: dict[int, _Pipe] = {}
        self._tails: dict[int, LineWindow] = {}

    def add(self, rank: int, stdout_fd: int, stderr_fd: int) -> None:
        """Register one rank's read ends (made non-blocking here)."""
        shown = self._mode == "all" or (self._mode == "rank0" and rank == 0)
        prefix = f"[rank {rank}] " if self._mode == "all" else ""
        tail = self._tails.setdefault(rank, LineWindow(_TAIL_LINES))
        for fd, target, is_err in (
            (stdout_fd, self._stdout, False),
            (stderr_fd, self._stderr, True),
        ):
            os.set_blocking(fd, False)
            self._pipes[fd] = _Pipe(
                rank, fd, target if shown else None, prefix, tail if is_err else None
            )

    def retarget(self, mode: Output, target: Writable | None = None) -> None:
        """Show what comes from now on as ``mode`` says, in ``target`` (a session's ranks
        outlive each task's panel; default: the current cell's ``sys.stdout``/``stderr``)."""
        self._mode = mode
        self._stdout = target or CellStream(sys.stdout)
        self._stderr = target or CellStream(sys.stderr)
        for pipe in self._pipes.values():
            shown = mode == "all" or (mode == "rank0" and pipe.rank == 0)
            stream = self._stderr if pipe.tail is not None else self._stdout
            pipe.target = stream if shown else None
            pipe.prefix = f"[rank {pipe.rank}] " if mode == "all" else ""

    def fds(self, rank: int | None = None) -> list[int]:
        """The pipes still open (of one rank, or of all)."""
        return [fd for fd, p in self._pipes.items() if p.open and rank in (None, p.rank)]

    def read(self, fd: int, chunks: int = 4) -> bool:
        """Read what ``fd`` holds now, at most ``chunks`` pieces so the loop can serve the
        others; False once it reached EOF."""
        pipe = self._pipes[fd]
        for _ in range(chunks):
            try:
                data = os.read(fd, _CHUNK)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                self._deliver(pipe, pipe.decoder.decode(b"", final=True), final=True)
                pipe.open = False
                return False
            self._deliver(pipe, pipe.decoder.decode(data))
        return True

    def drain(self, rank: int) -> None:
        """Read all that a rank's pipes hold right now: its last words, once it has exited."""
        for fd in self.fds(rank):
            self.read(fd, chunks=64)  # stops at EOF, or when a stray holds it open and empty

    def stderr_tail(self, rank: int) -> str:
        tail = self._tails.get(rank)
        return tail.text() if tail is not None else ""

    def close(self) -> None:
        """Close every read end; a stray process still holding a write end is not waited for."""
        for fd, pipe in self._pipes.items():
            if pipe.open:
                self.read(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipes.clear()

    def _deliver(self, pipe: _Pipe, text: str, final: bool = False) -> None:
        if text and pipe.tail is not None:
            pipe.tail.feed(text)
        if pipe.target is None:
            return
        if pipe.prefix:
            text = self._whole_lines(pipe, text, final)
        if not text:
            return
        try:
            pipe.target.write(text)
            pipe.target.flush()
        except (OSError, ValueError):  # the notebook's stream went away; keep draining
            pipe.target = None

    @staticmethod
    def _whole_lines(pipe: _Pipe, text: str, final: bool) -> str:
        """With prefixes, several ranks share one stream: only whole lines (or whole
        carriage-return redraws) go out, each with ``[rank N]``, so that lines of different
        ranks never interleave. An open line is held, up to ``MAX_LINE`` characters."""
        end = max(text.rfind("\n"), text.rfind("\r"))
        if end < 0 and not final and pipe.held_length + len(text) <= MAX_LINE:
            pipe.held.append(text)
            pipe.held_length += len(text)
            return ""
        if end < 0 or final or pipe.held_length + end >= MAX_LINE:
            end = len(text) - 1  # the end of the stream, or a line too long to hold
        ready = "".join(pipe.held) + text[: end + 1]
        rest = text[end + 1 :]
        pipe.held, pipe.held_length = ([rest], len(rest)) if rest else ([], 0)
        if not ready:
            return ""
        prefix = pipe.prefix
        head = prefix if pipe.at_line_start and ready[0] not in "\r\n" else ""
        body = _LINE_STARTS.sub(lambda m: m.group(1) + prefix, ready)
        pipe.at_line_start = ready[-1] in "\r\n"
        return head + body + ("\n" if final and not pipe.at_line_start else "")
