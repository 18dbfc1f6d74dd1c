"""Describe a rank's failure so the kernel can raise it well: type, message, the user's
traceback (without nbddp's own frames), and the exception itself when it pickles."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from .. import payload

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def error_report(exc: BaseException) -> dict[str, Any]:
    try:
        original = payload.dumps(exc, what="the exception", root="exception")
    except Exception:
        original = None  # the kernel still gets its type name and traceback
    return {
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "traceback": format_user_traceback(exc),
        "exception": original,
        "time": time.time(),
    }


def format_user_traceback(exc: BaseException) -> str:
    """The traceback from the user's own code down: nbddp's frames above it are noise."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    first_user = next(
        (i for i, frame in enumerate(frames) if not frame.filename.startswith(_PACKAGE_DIR)), 0
    )
    te.stack = traceback.StackSummary.from_list(frames[first_user:])
    return "".join(te.format())
