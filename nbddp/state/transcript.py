"""Rank 0's whole output as the saved notebook keeps it: what a normal cell would keep, within
a generous bound, and beyond it a file with all of it.

The live panel shows the last lines only (``state.OUTPUT_LINES``). When the run ends, the
panel becomes the saved summary, which shows this :class:`Transcript` instead: the first
``head`` lines and the last ``tail`` lines, as a terminal shows them (a carriage return redraws
a line, so a progress bar is one line). Once a line would fall between the two, every line
(from the first) goes to a file of its own under ``nbddp_logs/`` in the kernel's working
directory (the notebook's: a relative link opens it in JupyterLab), or under a private
temporary directory where that cannot be written; the summary links it. The directory is made
0700 and the file 0600: a log is its user's alone.

Non-goal: the ranks' other output (``output="all"`` shows every rank in the panel with
``[rank N]`` prefixes, kept the same way), and text mode, where output goes to the cell's own
stream as it comes.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import tempfile
import time
from typing import TextIO

from nbddp.state.terminal import LineWindow

HEAD_LINES = 2_000  # first lines kept in the saved summary
TAIL_LINES = 2_000  # last lines kept in the saved summary
KEPT_CHARACTERS = 256 * 1024  # at most, for each of the two ends
LOG_DIRECTORY = "nbddp_logs"


class Transcript(LineWindow):
    """The first and last lines of a stream, and a file with every line once they no longer
    meet. Feeding stays linear; memory stays within the two bounds."""

    def __init__(
        self,
        head: int = HEAD_LINES,
        tail: int = TAIL_LINES,
        characters: int = KEPT_CHARACTERS,
    ) -> None:
        super().__init__(keep=tail)
        self.lines = collections.deque()  # bounded below, by lines and by characters
        self.head: list[str] = []
        self.file = ""  # where every line is, once some were dropped ("" if none could be made)
        self._spilled = False
        self._limits = (head, tail, characters)
        self._head_characters = 0
        self._tail_characters = 0
        self._sink: TextIO | None = None

    def _keep(self, line: str) -> None:
        head, tail, characters = self._limits
        if self.file:
            self._write(line + "\n")
        if not self.lines and len(self.head) < head:
            if self._head_characters + len(line) <= characters:
                self.head.append(line)
                self._head_characters += len(line)
                return
            self._limits = (len(self.head), tail, characters)  # the head is full
        self.lines.append(line)
        self._tail_characters += len(line)
        while len(self.lines) > tail or self._tail_characters > characters:
            gone = self.lines.popleft()
            self._tail_characters -= len(gone)
            if not self._spilled:  # the first line to leave: every line so far goes to a file
                self._spilled = True
                self._open_file()
                self._write("".join(f"{kept}\n" for kept in [*self.head, gone, *self.lines]))
            self.dropped += 1

    def text(self) -> str:
        """The last lines: the tail and the open line (:attr:`head` holds the first ones)."""
        return super().text() if self.lines or self.open_line else ""

    def head_text(self) -> str:
        return "".join(f"{line}\n" for line in self.head)

    def close(self) -> None:
        """The open line joins the file too, and the file is closed (what comes later is
        appended line by line)."""
        if self.file and self.open_line:
            self._write(self.open_line + "\n")
        if self._sink is not None:
            sink, self._sink = self._sink, None
            with contextlib.suppress(OSError):
                sink.close()

    def _open_file(self) -> None:
        name = f"rank0-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}.log"
        try:
            os.makedirs(LOG_DIRECTORY, mode=0o700, exist_ok=True)
            path = os.path.join(LOG_DIRECTORY, name)
            descriptor = os.open(path, _NEW_PRIVATE_FILE, 0o600)
        except OSError:  # a working directory that cannot be written: a private temp one
            try:
                path = os.path.join(tempfile.mkdtemp(prefix="nbddp-logs-"), name)
                descriptor = os.open(path, _NEW_PRIVATE_FILE, 0o600)
            except OSError:  # nowhere: the summary keeps both ends and says so
                return
        self.file = os.path.abspath(path)
        self._sink = os.fdopen(descriptor, "w", encoding="utf-8", errors="replace")

    def _write(self, text: str) -> None:
        if not self.file:
            return
        try:
            if self._sink is not None:
                self._sink.write(text)
            else:  # after close(): appended, never left open
                with open(self.file, "a", encoding="utf-8", errors="replace") as late:
                    late.write(text)
        except OSError:  # a full disk: the summary still holds both ends
            pass


_NEW_PRIVATE_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
