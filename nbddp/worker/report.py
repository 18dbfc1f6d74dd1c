"""Describe a rank's failure so the kernel can raise it well: type, message, the user's
traceback (without nbddp's own frames), and the exception itself when it pickles.

Any exception object must survive this, however broken: one whose ``__str__`` or ``__repr__``
raises still gets its type, its traceback and a placeholder message.
"""

from __future__ import annotations

import os
import time
import traceback

from nbddp.wire import payload
from nbddp.wire.messages import Bars, BarSnapshot, Block, ErrorReport, MainRows, Rows
from nbddp.wire.transport import Connection

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def error_report(exc: BaseException) -> ErrorReport:
    try:
        original: bytes | None = payload.dumps_exception(exc)
    except BaseException:
        original = None  # the kernel still gets its type name and traceback
    cls = type(exc)
    return ErrorReport(
        exc_type=cls.__name__,
        message=message_of(exc),
        traceback=format_user_traceback(exc),
        exception=original,
        time=time.time(),
        mro=tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__),
        module=cls.__module__,
    )


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when that raises."""
    try:
        return str(exc)
    except BaseException as failure:
        return f"<str() of this {type(exc).__name__} raised {type(failure).__name__}>"


def format_user_traceback(exc: BaseException) -> str:
    """The traceback from the user's own code down: nbddp's frames above it are noise."""
    try:
        te = traceback.TracebackException.from_exception(exc)
        frames = list(te.stack)
        first_user = next(
            (i for i, frame in enumerate(frames) if not frame.filename.startswith(_PACKAGE_DIR)), 0
        )
        te.stack = traceback.StackSummary.from_list(frames[first_user:])
        return "".join(te.format())
    except BaseException:  # a broken __str__ breaks the last line: format it by hand
        lines = traceback.format_tb(exc.__traceback__)
        return "".join(
            [
                "Traceback (most recent call last):\n",
                *lines,
                f"{type(exc).__name__}: {message_of(exc)}\n",
            ]
        )


class ChannelSink:
    """``nbddp.log`` rows and progress bars, to the kernel."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self._conn = conn
        self._rank = rank

    def rows(self, first: int, blocks: list[Block]) -> None:
        self._conn.send(Rows(self._rank, first, blocks))

    def main_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        self._conn.send(MainRows(self._rank, rows))

    def bars(self, bars: list[BarSnapshot]) -> None:
        self._conn.send(Bars(self._rank, bars))
