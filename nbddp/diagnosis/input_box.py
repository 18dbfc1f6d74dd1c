"""The notebook's input box, as the kernel reaches it: whether there is one, and a line asked
there that the run's end can take back.

In a Jupyter kernel, ``input()`` on the thread that runs the cell is an ``input_request`` on
the stdin channel, which the frontend answers when the cell was run with ``allow_stdin`` (a
browser's notebook, VS Code; not papermill, nbconvert or a client without stdin). In a script
it reads the terminal. Only the kernel's main thread asks: it is the one that runs cells.

Non-goal: which rank's question comes next (``prompts.py``).
"""

from __future__ import annotations

import builtins
import ctypes
import re
import sys
import threading

from nbddp.diagnosis.stacks import cell_number

NO_STDIN = (
    "this notebook client has no input box: the cell runs without stdin (papermill, "
    "nbconvert, or a client that does not answer input requests)"
)
NO_TERMINAL = "there is no terminal to type into (this process's stdin is not a terminal)"


class Abandoned(BaseException):
    """Raised into the thread that waits in the input box once the run ended: the question
    has no one to go back to. A BaseException: ipykernel's wait swallows an ``Exception``."""


def missing() -> str:
    """Why nothing can be typed for this run (call it on the cell's thread), or ''."""
    ipython = sys.modules.get("IPython")  # never imported just for this
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:  # ipykernel keeps the current cell's allow_stdin here
        return "" if getattr(kernel, "_allow_stdin", True) else NO_STDIN
    if shell is not None:
        return ""  # IPython in a terminal
    try:
        return "" if sys.stdin is not None and sys.stdin.isatty() else NO_TERMINAL
    except (AttributeError, ValueError):
        return NO_TERMINAL


def can_ask_here() -> bool:
    return threading.current_thread() is threading.main_thread()


class InputBox:
    """Asks one line at a time on the main thread; :meth:`abandon` (any thread) takes a
    pending question back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asking: int | None = None  # the thread id waiting in input()
        self._abandoned = False
        self._raised = False

    def ask(self, prompt: str) -> str:
        """The line typed (``EOFError`` at Ctrl-D; ``NotImplementedError`` where the frontend
        has no input box; :class:`Abandoned` once the run ended)."""
        __tracebackhide__ = True  # IPython: an interrupt here is the user's, not our frames
        ident = threading.get_ident()
        with self._lock:
            if self._abandoned:
                raise Abandoned
            self._asking = ident
        try:
            return str(builtins.input(prompt))  # the kernel's raw_input during a cell
        except KeyboardInterrupt:
            raise KeyboardInterrupt from None  # without ipykernel's frames
        finally:
            with self._lock:
                self._asking = None
                if self._raised:  # not delivered yet: it must not land in our caller
                    _raise_in(ident, None)
                    self._raised = False

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self._asking is not None and not self._raised:
                self._raised = True
                _raise_in(self._asking, Abandoned)


def _raise_in(ident: int, error: type[BaseException] | None) -> None:
    """``error`` raised in thread ``ident`` at its next bytecode (None: cancel a pending one).
    ipykernel waits for the reply in a Python loop that polls every 10 ms."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(error) if error is not None else None
    )


def name_cells(text: str) -> str:
    """pdb's ``/tmp/ipykernel_1/2.py(5)train()`` as IPython names it: ``Cell In[3], line 5,
    in train()``; other files stay as pdb wrote them."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    mapping = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if not isinstance(mapping, dict) or not text:
        return text
    for filename in [f for f in mapping if f in text]:
        number = cell_number(filename)
        if number is None:
            continue

        def named(match: re.Match[str], number: int = number) -> str:
            function = ", in " if match.group(2) else ""
            return f"Cell In[{number}], line {match.group(1)}{function}{match.group(2)}"

        text = re.sub(re.escape(filename) + r"\((\d+)\)(\S*)", named, text)
    return text


def place(at: tuple[str, int]) -> str:
    """``Cell In[3], line 5`` for notebook code, ``train.py, line 40`` elsewhere."""
    filename, line = at
    number = cell_number(filename)
    return f"Cell In[{number}], line {line}" if number is not None else f"{filename}, line {line}"
