"""Hold a kernel interrupt back while nbddp changes state that must change whole.

The stop button (SIGINT) can land between any two bytecodes. Starting ranks, building the
world of a one-rank run and tearing either down are short, bounded steps that must complete or
be undone as a whole; inside :func:`deferred`, a SIGINT is remembered and raised as
``KeyboardInterrupt`` the moment the block ends, so the step completes and the caller's
ordinary cleanup (which expects a KeyboardInterrupt from the block's end) runs.

Only the main thread receives SIGINT; elsewhere the context manager does nothing.

Where an interrupt can land is named too: a launch says which :data:`Phase` it enters, on the
thread that enters it (:func:`reached`). Nothing listens unless a test installs an observer
(:func:`observed`): the interrupt tests send their SIGINT from one, at each phase in turn, and
check that it was honoured there. Unobserved, a phase costs one global read.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Literal, get_args

# A launch's phases, in the order a launch of ranks on this machine enters them (a one-rank
# launch in the kernel enters "planning", "joining the process group", "running fn",
# "tearing down", "finishing", "watching"). From "handing out the job" on, they are entered on
# the supervisor's thread, the others on the caller's.
Phase = Literal[
    "planning",  # the options checked, the plan made
    "pickling",  # fn and what it captures pickled
    "waiting for the helper",  # the pre-warmed helper (interruptibly: nothing is open yet)
    "starting the ranks",  # the run directory made, the ranks asked for (held back)
    "supervising",  # the ranks started; the supervisor thread starts (held back)
    "watching",  # the stall watch and the timeout set up
    "handing out the job",  # the first rank said hello and gets the pickled call
    "joining the process group",  # every rank has its job
    "running fn",  # every rank joined the process group
    "sending the result",  # a rank's "did DDP happen?" check came: its result comes next
    "exit work",  # a rank's result came: it runs its exit work, then exits
    "tearing down",  # the verdict is in: ranks ended, pipes and sockets closed
    "finishing",  # the outcome is handed to the run
]
PHASES: tuple[Phase, ...] = get_args(Phase)

_observer: Callable[[Phase], None] | None = None


@contextmanager
def deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, FrameType | None]] = []

    def remember(signum: int, frame: FrameType | None) -> None:
        caught.append((signum, frame))

    try:
        previous: Any = signal.signal(signal.SIGINT, remember)
    except ValueError:  # not the main interpreter's main thread after all
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            _deliver(previous, *caught[0])


def _deliver(handler: Any, signum: int, frame: FrameType | None) -> None:
    if handler is signal.default_int_handler or handler == signal.SIG_DFL:
        raise KeyboardInterrupt
    if callable(handler):
        handler(signum, frame)


def reached(phase: Phase) -> None:
    """A launch enters ``phase`` on this thread (a no-op unless a test observes phases)."""
    observer = _observer
    if observer is not None:
        observer(phase)


@contextmanager
def observed(observer: Callable[[Phase], None]) -> Iterator[None]:
    """Call ``observer(phase)`` as every launch enters each phase, for the block's length."""
    global _observer
    previous, _observer = _observer, observer
    try:
        yield
    finally:
        _observer = previous
