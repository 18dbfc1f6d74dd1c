"""A rank's questions to the person at the notebook: ``input()`` and pdb's prompt travel to the
kernel as a ``Prompt``, which shows them in the notebook's input box and sends the typed line
back (``wire/prompts.py``). Also the waits of ``nbddp.breakpoint()``: the ranks that are not
debugged wait here, without any collective, until the kernel releases them.

The rank's main thread asks and waits; its listener thread hands it the kernel's ``Reply`` and
``Release`` (:func:`received`). A wait is cut short by an interrupt (a session's stop), never by
a timeout: the launch's ``timeout=`` is the kernel's to enforce.

Non-goal: pdb itself (``debugger.py``).
"""

from __future__ import annotations

import builtins
import itertools
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from nbddp.wire.prompts import LeftPdb, Prompt, Quit, Release, Reply
from nbddp.worker.diagnosis import collective_watch
from nbddp.worker.streams import flush_output

_ORIGINAL_INPUT = builtins.input


class _Asked:
    """One question waiting for its reply."""

    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: Reply | None = None


class Link:
    """This rank's line to the person, for one launch or one session task."""

    def __init__(
        self,
        send: Callable[[Any], None],
        rank: int,
        world_size: int,
        output: str,
        task: int = 0,
        debug: bool = False,
    ) -> None:
        self.send = send
        self.rank = rank
        self.world_size = world_size
        self.output = output
        self.task = task
        self.debug = debug  # post-mortem pdb on an uncaught exception
        self.calls = 0  # nbddp.breakpoint() calls so far (every rank counts the same)
        self.refused = ""  # why nobody can answer (no input box), once the kernel said so
        self._seq = itertools.count(1)
        self._asked: dict[int, _Asked] = {}

    @property
    def may_input(self) -> bool:
        """``input()`` reaches the input box on the rank whose output the cell shows."""
        return self.rank == 0 or self.output == "all"

    def ask(self, kind: str, text: str, prompt: str, at: tuple[str, int]) -> Reply:
        """Show ``text``, then ``prompt`` in the input box; wait for the line typed."""
        seq = next(self._seq)
        asked = self._asked[seq] = _Asked()
        try:
            flush_output()  # what the rank printed before goes before, in the cell
            # while a person answers, no rank's collective times out (collective_watch.py)
            with collective_watch.held():
                self.send(Prompt(self.rank, seq, kind, text, prompt, at))
                asked.done.wait()  # an interrupt (a session's stop) ends the wait
        finally:
            del self._asked[seq]
        reply = asked.reply
        assert reply is not None
        if reply.refused:
            self.refused = reply.refused  # the rest of the run asks no more
        return reply

    def answered(self, reply: Reply) -> None:
        """The kernel's reply (on the listener thread); a late one is dropped."""
        asked = self._asked.get(reply.seq)
        if reply.rank == self.rank and asked is not None:
            asked.reply = reply
            asked.done.set()

    def left_pdb(self, release: int) -> None:
        self.send(LeftPdb(self.rank, self.task, release))

    def quit(self) -> None:
        self.send(Quit(self.rank))

    def wait_release(self, call: int) -> None:
        """Wait at the ``call``-th ``nbddp.breakpoint()`` until the debugged rank goes on."""
        with _released_changed:
            while (self.task, call) not in _released:
                _released_changed.wait()


# Released breakpoints outlive a task's link: a release can come before this rank started the
# task (the debugged rank was quicker), so it is kept until the next task starts.
_released: set[tuple[int, int]] = set()
_released_changed = threading.Condition()
_link: Link | None = None


def configure(link: Link | None) -> Link | None:
    """This rank's link for the run (or the session's task) that starts; None: it ended.
    Returns the link it replaced."""
    global _link
    previous, _link = _link, link
    if link is not None:
        with _released_changed:
            _released.difference_update({r for r in _released if r[0] < link.task})
    return previous


def current() -> Link | None:
    return _link


def received(message: Reply | Release) -> None:
    """A ``Reply`` or a ``Release`` from the kernel (the rank's listener thread)."""
    if isinstance(message, Release):
        with _released_changed:
            _released.add((message.task, message.call))
            _released_changed.notify_all()
    elif _link is not None:
        _link.answered(message)


def where(frame: FrameType) -> tuple[str, int]:
    return frame.f_code.co_filename, frame.f_lineno


def rank_input(prompt: object = "") -> str:
    """``input()`` on a rank: the notebook's input box (rank 0's, or every rank's with
    ``output="all"``); ``EOFError`` says why where there is none."""
    link = _link
    if link is None:
        return _ORIGINAL_INPUT(prompt)
    if not link.may_input:
        raise EOFError(
            f"input() on rank {link.rank}: only the input() of a rank whose output the cell "
            f"shows reaches the notebook's input box (output={link.output!r}: rank 0's). "
            "Launch with output='all' to answer every rank's."
        )
    if link.refused:
        raise EOFError(link.refused)
    reply = link.ask("input", "", str(prompt), where(sys._getframe(1)))
    if reply.line is None:
        raise EOFError(reply.refused or "end of input (Ctrl-D in the input box)")
    return reply.line


def install_input() -> None:
    builtins.input = rank_input
