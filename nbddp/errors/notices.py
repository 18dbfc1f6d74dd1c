"""How nbddp tells the user what went wrong beside a result: warnings that point at the
user's own call, and a bug of nbddp's own as the error the user sees.

Non-goal: the exceptions themselves (``__init__.py``).
"""

from __future__ import annotations

import sys
import warnings

from nbddp.errors import NbddpError, NbddpWarning
from nbddp.errors.render import PACKAGE_DIR


def our_bug(where: str, exc: BaseException) -> NbddpError:
    """A bug of nbddp's own (in a supervisor's or a session's loop), as the error the user sees:
    it names the loop and keeps the original, with its traceback, as the cause."""
    error = NbddpError(f"nbddp's {where} failed: {exc!r} (see the cause above)")
    error.__cause__ = exc
    return error


def warn_user(message: str, category: type[Warning] = NbddpWarning) -> None:
    """Warn, pointing at the first frame outside nbddp: the user's call (or cell)."""
    frame = sys._getframe(1)
    level = 2  # stacklevel 1 is this function, 2 its caller (the frame above)
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)


def warn_always(message: str, category: type[Warning] = NbddpWarning) -> None:
    """Warn at the user's call (or cell) every time, even from the same line as before: a
    run's verdict is news each run (``warnings.warn`` shows a line's warning once)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=str(frame.f_globals.get("__name__", "")),
        module_globals=frame.f_globals,
    )
