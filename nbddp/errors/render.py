"""How nbddp's errors read in a notebook: a rank's traceback with the notebook's frames named
as IPython names them (``Cell In[n], line m``), and how a process ended, in words.

Non-goal: the exceptions themselves (``__init__.py``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback
from typing import Any

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def ipython() -> Any:
    """The running IPython shell, without importing IPython where nothing did."""
    if "IPython" not in sys.modules:
        return None
    return sys.modules["IPython"].get_ipython()


def ipython_lines(shell: Any, etype: type[BaseException], value: Any, tb: Any) -> list[str]:
    """IPython's lines for an error, or its own line where IPython cannot (before 8.x it asserts
    frames): a ``_render_traceback_`` that raises leaves the cell without a reply, a hang."""
    try:
        return list(shell.InteractiveTB.structured_traceback(etype, value, tb))
    except Exception:
        return traceback.format_exception_only(etype, value)


def notebook_frames(text: str, shell: Any) -> str:
    """``File "/tmp/ipykernel_7/4242.py", line 6`` as IPython writes it: ``Cell In[5], line 6``
    (the notebook's cells and ``%%ddp`` cells, whose file names the shell's compiler knows)."""
    cells = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}

    def label(match: re.Match[str]) -> str:
        number = cells.get(match["file"])
        return match[0] if number is None else f"Cell In[{number}], line {match['line']}"

    return _FRAME.sub(label, text)


def describe_exit(exitcode: int | None) -> str:
    """Say how a process ended, naming the signal: 'was killed by signal 9 (SIGKILL)'."""
    if exitcode is None:
        return "stopped without reporting a result"
    if exitcode < 0:
        signum = -exitcode
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = "unknown signal"
        text = f"was killed by signal {signum} ({name})"
        if signum == signal.SIGKILL:
            text += ", often the out-of-memory killer: check host memory"
        elif signum == signal.SIGSEGV:
            text += ", a crash in native code (a C/CUDA extension)"
        return text
    if exitcode == 0:
        return "exited with code 0 without returning a value (did it call os._exit(0)?)"
    return f"exited with code {exitcode} without a Python traceback (os._exit or a native crash)"


def first_line(error: BaseException) -> str:
    """``Type: the message's first line`` (a panel's or a list's one line for an error)."""
    try:
        text = str(error).strip().splitlines()
    except Exception:
        text = []
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
