"""Text as a terminal shows it, kept in bounded memory: the last lines of a stream with carriage
returns redrawing a line (:class:`LineWindow`), and a cell's stream written from another thread
(:class:`CellStream`). Pure text handling: no pipes, no processes.
"""

from __future__ import annotations

import collections
import contextvars
from typing import Any

from nbddp.backend import Writable

MAX_LINE = 10_000  # characters of one line kept for the panel and the stderr tail


class LineWindow:
    """The last ``keep`` lines of a text stream, as a terminal would show them: a carriage
    return starts the line over (a progress bar stays one line), an overlong line is cut.
    Feeding is linear in the text; nothing grows beyond ``keep`` lines of ``max_line``."""

    def __init__(self, keep: int, max_line: int = MAX_LINE) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.dropped = 0  # complete lines that fell out of the window
        self._open: list[str] = []  # pieces of the line not yet ended by a newline
        self._open_length = 0
        self._cut = 0  # characters of the open line not kept
        self._restart = False  # a carriage return was seen: the next text replaces the line
        self.max_line = max_line

    def feed(self, text: str) -> None:
        for index, segment in enumerate(text.split("\n")):
            if index:
                self._end_line()
            if not segment:
                continue
            pieces = segment.split("\r")
            for position, piece in enumerate(pieces):
                if position:
                    self._restart = True
                if piece:
                    if self._restart:
                        self._open, self._open_length, self._cut = [], 0, 0
                        self._restart = False
                    self._add(piece)

    def _add(self, piece: str) -> None:
        room = self.max_line - self._open_length
        if room <= 0:
            self._cut += len(piece)
            return
        if len(piece) > room:
            self._cut += len(piece) - room
            piece = piece[:room]
        self._open.append(piece)
        self._open_length += len(piece)

    def _end_line(self) -> None:
        line = "".join(self._open)
        if self._cut:
            line += f" … [{self._cut} more characters not shown]"
        self._keep(line)
        self._open, self._open_length, self._cut, self._restart = [], 0, 0, False

    def _keep(self, line: str) -> None:
        """A line just ended: into the window (its oldest line falls out when full)."""
        if len(self.lines) == self.lines.maxlen:
            self.dropped += 1
        self.lines.append(line)

    @property
    def open_line(self) -> str:
        return "".join(self._open)

    def text(self) -> str:
        """The window as text: complete lines, then the open one."""
        lines = list(self.lines)
        if self._open:
            lines.append(self.open_line)
        return "\n".join(lines) + ("\n" if self.lines and not self._open else "")


class CellStream:
    """The calling cell's stream, written from another thread. ipykernel files a thread's
    writes under the cell that started the thread; a session's loop thread outlives that
    cell, so each write names the cell this stream was taken in: through
    ``set_thread_parent`` (ipykernel >= 7.1), or the writing thread's own value of the
    stream's parent context variable, which is what ipykernel 6.29 to 7.0 read at each write
    (without it a session's output went to the cell that started the session). Older kernels
    file every write under the cell that runs now."""

    def __init__(self, stream: Writable) -> None:
        self._stream = stream
        self._header = getattr(stream, "parent_header", None)

    def write(self, text: str, /) -> int:
        stream: Any = self._stream
        if self._header is None:
            return stream.write(text)  # type: ignore[no-any-return]
        if hasattr(stream, "set_thread_parent"):
            token = stream.set_thread_parent(self._header)
            try:
                return stream.write(text)  # type: ignore[no-any-return]
            finally:
                stream.reset_thread_parent(token)
        parent = getattr(stream, "_parent_header", None)
        if isinstance(parent, contextvars.ContextVar):  # this thread's context only
            context_token = parent.set(self._header)
            try:
                return stream.write(text)  # type: ignore[no-any-return]
            finally:
                parent.reset(context_token)
        return stream.write(text)  # type: ignore[no-any-return]

    def flush(self) -> None:
        self._stream.flush()
