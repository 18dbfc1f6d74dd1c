"""The ranks' questions to the person (pdb's prompt, ``input()``), asked in the notebook's input
box by the thread that waits for the run, one rank at a time.

The run's loop thread files each rank's ``Prompt`` here (:meth:`Prompts.asked`); the thread
that waits for the run (a blocking launch's cell, ``run.wait()`` or ``run.result()`` of a
background one, a session's task) serves them (:meth:`Prompts.serve`): it shows what pdb
printed, asks the prompt in the input box and sends the line back. One rank's pdb is served
until it continues; meanwhile another rank's prompt waits, unless the served rank runs on for
``SWITCH_AFTER`` seconds without asking again (it may wait in a collective for a rank that
sits at its own prompt). Where there is no input box the loop thread answers at once: the
rank skips its breakpoint (a warning names the rank and the line), ``input()`` raises.

Non-goal: pdb (the rank's ``worker/debugging/debugger.py``), what the panel shows.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from nbddp.diagnosis.input_box import (
    NO_STDIN,
    Abandoned,
    InputBox,
    can_ask_here,
    name_cells,
    place,
)
from nbddp.errors.notices import warn_always
from nbddp.wire.prompts import LeftPdb, Prompt, Release, Reply

SWITCH_AFTER = 1.0  # seconds the served rank runs without asking before another is served


class Prompts:
    """One run's questions; thread-safe. ``send`` (set by the run) reaches every rank."""

    def __init__(self) -> None:
        self.send: Callable[[Any], None] = lambda message: None
        self.missing = ""  # why there is no input box for this run ('' there is one)
        self._changed = threading.Condition()
        self._open: dict[int, Prompt] = {}  # rank -> its question
        self._order: list[int] = []  # ranks with a question or in pdb, first come first
        self._serving: int | None = None  # the rank whose pdb the input box serves
        self._asking: int | None = None  # the rank whose question the input box shows now
        self._answered_at = 0.0
        self.in_pdb: set[int] = set()
        self._warnings: list[str] = []
        self._warned: set[int] = set()
        self._servers = 0
        self._over = False
        self._box = InputBox()

    # -- the loop thread -----------------------------------------------------------------

    def asked(self, rank: int, prompt: Prompt) -> None:
        with self._changed:
            if prompt.kind != "input":
                self.in_pdb.add(rank)
            refusal = self._refuse(prompt) if self.missing else None
            if refusal is None:
                self._open[rank] = prompt
                if rank not in self._order:
                    self._order.append(rank)
                self._changed.notify_all()
        if refusal is not None:
            self.send(refusal)

    def left(self, rank: int, left: LeftPdb | None) -> None:
        """``rank`` left pdb (None: it ended); the ranks it held go on."""
        with self._changed:
            self.in_pdb.discard(rank)
            self._open.pop(rank, None)  # a question it no longer waits for
            if rank in self._order:
                self._order.remove(rank)
            if self._serving == rank:
                self._serving = None
            self._changed.notify_all()
        if left is not None and left.release:
            self.send(Release(left.task, left.release))

    def close(self) -> None:
        """The run ended: a question waiting in the input box is taken back."""
        with self._changed:
            self._over = True
            self._changed.notify_all()
        self._box.abandon()

    @property
    def waiting(self) -> tuple[int, ...]:
        """Ranks whose question waits (the panel's line)."""
        with self._changed:
            asking = {self._asking} if self._asking is not None else set()
            return tuple(sorted(self._open.keys() | asking))

    @property
    def served(self) -> bool:
        """A thread is there to answer (else the panel says how to)."""
        return self._servers > 0

    def _refuse(self, prompt: Prompt) -> Reply:
        """No input box: the reply that lets the rank go on (call with the lock held)."""
        if prompt.kind != "input" and prompt.rank not in self._warned:
            self._warned.add(prompt.rank)
            self._warnings.append(
                f"{'post-mortem pdb' if prompt.kind == 'post-mortem' else 'a breakpoint'} on "
                f"rank {prompt.rank} at {place(prompt.at)} was skipped, as every later one of "
                f"this run on that rank: {self.missing}. The run goes on."
            )
            self._changed.notify_all()
        return Reply(prompt.rank, prompt.seq, None, f"nbddp: {self.missing}.")

    # -- the waiting thread ----------------------------------------------------------------

    def serve(self, done: threading.Event, timeout: float | None) -> bool:
        """Wait for the run's end (True) or ``timeout`` seconds (False), answering the ranks'
        questions meanwhile, where this thread can ask."""
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        if not can_ask_here():
            return done.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._servers += 1
        try:
            while not done.is_set():
                question = self._next(deadline)
                self._warn()
                if question is not None:
                    self._answer(question)
                elif deadline is not None and time.monotonic() >= deadline:
                    return done.is_set()
            return True
        finally:
            with self._changed:
                self._servers -= 1

    def _warn(self) -> None:
        with self._changed:
            warnings, self._warnings = self._warnings, []
        for message in warnings:
            warn_always(message)

    def take_warnings(self) -> None:
        """What was skipped, told on the thread that asks for the result."""
        self._warn()

    def _next(self, deadline: float | None) -> Prompt | None:
        """The next question to ask, or None when it is time to look around again."""
        with self._changed:
            while not self._over and not self._warnings:
                now = time.monotonic()
                question, wake = self._choose(now)
                if question is not None:
                    return question
                times = [t for t in (wake, deadline) if t is not None]
                if times and min(times) <= now:
                    return None
                self._changed.wait(min(times) - now if times else None)
            return None

    def _choose(self, now: float) -> tuple[Prompt | None, float | None]:
        """(the question, None), or (None, when to look again)."""
        serving = self._serving
        if serving is not None:
            if serving in self._open:
                return self._open.pop(serving), None
            if now < self._answered_at + SWITCH_AFTER:
                return None, self._answered_at + SWITCH_AFTER
        for rank in self._order:
            if rank in self._open:
                if serving is not None and serving != rank:
                    self._open[rank] = self._open[rank]._replace(
                        text=f"nbddp: rank {serving} runs on without stopping (it may wait for "
                        f"rank {rank} in a collective); rank {rank} meanwhile:\n"
                        + self._open[rank].text
                    )
                self._serving = rank
                return self._open.pop(rank), None
        return None, None

    def _answer(self, question: Prompt) -> None:
        __tracebackhide__ = True
        text = name_cells(question.text)
        if text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()
        with self._changed:
            self._asking = question.rank
        try:
            reply = Reply(question.rank, question.seq, self._box.ask(question.prompt))
        except EOFError:
            reply = Reply(question.rank, question.seq, None)
        except NotImplementedError:  # IPython's StdinNotImplementedError: no input box
            with self._changed:
                self.missing = self.missing or NO_STDIN
                refusals = [self._refuse(question)]
                refusals += [self._refuse(waiting) for waiting in self._open.values()]
                self._open.clear()
            for refusal in refusals:
                self.send(refusal)
            return
        except Abandoned:
            return
        finally:
            with self._changed:
                self._asking = None
        with self._changed:
            self._answered_at = time.monotonic()
            if question.kind == "input" and self._serving == question.rank:
                self._serving = None
            rank = question.rank
            if rank in self._order and rank not in self._open and rank not in self.in_pdb:
                self._order.remove(rank)
        self.send(reply)
