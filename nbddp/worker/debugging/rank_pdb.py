"""pdb whose prompt is the notebook's input box: :class:`RankPdb`, with its input and output on
the wire (``asking.py``). What it prints is collected and sent with its next prompt, so the
session reaches the cell whatever ``output=`` says, and the line typed comes back. Imported on a
rank's first stop only: ``pdb`` costs ~15 ms to import, which no launch should pay for nothing.
"""

from __future__ import annotations

import os
import pdb
import threading
from types import FrameType, TracebackType

from nbddp.worker.debugging.asking import Link, where

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _ours(filename: str) -> bool:
    """A frame of how the rank started (nbddp, runpy, its script), not of the user's code."""
    return (
        filename.startswith(_PACKAGE)
        or filename in ("<string>", "<frozen runpy>")
        or (filename.endswith("launch.py") and "/nbddp-" in filename)
    )


class _Interrupted(BaseException):
    """An interrupt (a session task's stop) while pdb waits for a line: pdb would catch a
    ``KeyboardInterrupt`` there and prompt again, so it leaves pdb as this, and is turned back
    into the ``KeyboardInterrupt`` once out."""


class _Collected:
    """pdb's stdout: kept until its next prompt carries it to the cell."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def write(self, text: str) -> int:
        self._parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self._parts = "".join(self._parts), []
        return text


class _Lines:
    """pdb's stdin: each ``readline`` is one question to the person."""

    def __init__(self, debugger: RankPdb) -> None:
        self._debugger = debugger

    def readline(self) -> str:
        return self._debugger.next_line()


class RankPdb(pdb.Pdb):
    """pdb whose prompt is the notebook's input box. ``release``: the ``nbddp.breakpoint()``
    call the other ranks wait at until this rank continues (0: none)."""

    def __init__(
        self, link: Link, kind: str, release: int = 0, origin: tuple[str, int] | None = None
    ) -> None:
        self._link = link
        self._kind = kind
        self._release = release
        self._origin = origin  # the breakpoint's own line, named by the first prompt
        self._out = _Collected()
        self._left = False
        super().__init__(stdin=_Lines(self), stdout=self._out, nosigint=True)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {link.rank}) "

    def next_line(self) -> str:
        """Ask for the next command: pdb's output so far is shown, then the prompt."""
        self._left = False  # stopped again (a breakpoint set with ``b``)
        text = self._out.take()
        if text.endswith(self.prompt):  # written by cmd just before asking
            text = text[: -len(self.prompt)]
        if self._link.refused:
            return "continue\n"
        frame = self.curframe
        at = self._origin or (where(frame) if frame is not None else ("", 0))
        self._origin = None
        try:
            reply = self._link.ask(self._kind, text, self.prompt, at)
        except KeyboardInterrupt:
            self.set_quit()
            raise _Interrupted from None
        if reply.refused:
            return "continue\n"  # no input box: the breakpoint is skipped
        if reply.line is None:
            return ""  # Ctrl-D: pdb's EOF, which quits
        return reply.line + "\n"

    def get_stack(
        self, f: FrameType | None, t: TracebackType | None
    ) -> tuple[list[tuple[FrameType, int]], int]:
        """pdb's stack from the user's first frame: ``w`` and ``up`` show their code only."""
        stack, index = super().get_stack(f, t)
        first = next(
            (i for i, (frame, _) in enumerate(stack) if not _ours(frame.f_code.co_filename)), 0
        )
        if 0 < first <= index:
            return stack[first:], index - first
        return stack, index

    def interaction(self, frame: FrameType | None, traceback: TracebackType | None) -> None:
        try:
            super().interaction(frame, traceback)
        except _Interrupted:
            raise KeyboardInterrupt from None

    def set_continue(self) -> None:
        super().set_continue()
        self.leave()

    def leave(self) -> None:
        """Tell the kernel this rank runs on (once per stop); the held ranks go on."""
        if not self._left:
            self._left = True
            self._link.left_pdb(self._release)
            self._release = 0

    def do_quit(self, arg: str) -> bool | None:
        if self._kind == "post-mortem":  # leaving post-mortem: the run fails as usual
            self.leave()
            return bool(super().do_quit(arg))
        self.set_quit()
        try:
            self._link.quit()  # the kernel stops the run and ends every rank, this one too
            threading.Event().wait()
        except KeyboardInterrupt:  # a session's task is stopped this way: leave pdb
            # (from the moment Quit is sent: one escaping as KeyboardInterrupt would be
            # caught by pdb's command loop, which asks again)
            raise _Interrupted from None
        return None

    do_q = do_exit = do_EOF = do_quit
