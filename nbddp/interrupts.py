"""Hold a kernel interrupt back while nbddp changes state that must change whole.

The stop button (SIGINT) can land between any two bytecodes. Starting ranks, building the
world of a one-rank run and tearing either down are short, bounded steps that must complete or
be undone as a whole; inside :func:`deferred`, a SIGINT is remembered and raised as
``KeyboardInterrupt`` the moment the block ends, so the step completes and the caller's
ordinary cleanup (which expects a KeyboardInterrupt from the block's end) runs.

Only the main thread receives SIGINT; elsewhere the context manager does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


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
