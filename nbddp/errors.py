"""The exceptions and warnings nbddp raises in the notebook, each message written in its class.

    NbddpError
    ├── WorkerError         (also RuntimeError)  a rank raised, crashed or was killed; when
    │                                            the rank raised an Exception whose class the
    │                                            kernel can import, the error raised is also
    │                                            an instance of that class
    ├── SerializationError  (also TypeError)     something cannot travel to or from the ranks
    ├── LaunchTimeout       (also TimeoutError)  the run outlived its ``timeout=``
    └── RunStopped                               the run was stopped, so it has no result
    NbddpWarning            (a UserWarning)      shown once, e.g. the kernel holds GPU memory

Bad arguments are plain ``ValueError`` raised before any process starts (see ``plan.py``).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import signal
import sys
import traceback
import types
import warnings
from typing import Any

__all__ = [
    "LaunchTimeout",
    "NbddpError",
    "NbddpWarning",
    "RunStopped",
    "SerializationError",
    "WorkerError",
]


class NbddpError(Exception):
    """Base of every error nbddp raises on purpose."""

    _cause_in_message = False  # the message tells the cause's traceback: do not show it again
    _local_frames = True  # False for a %%ddp cell's: its frame would echo the whole cell

    def _render_traceback_(self) -> list[str]:
        """How IPython shows this error: the notebook's own frames (nbddp's left out), then
        the message; a rank's traceback in it names notebook frames ``Cell In[n]``, as
        IPython does. A rank's exception (``__cause__``) is told in the message already,
        so it is not shown a second time. A ``%%ddp`` cell's shows no local frame (as
        ipyparallel's ``%%px``): the rank's traceback names the failing line."""
        shell = _ipython()
        cause = self.__cause__
        if cause is not None and (self._cause_in_message or cause.__traceback__ is None):
            self.__cause__ = None
        try:
            tb = self.__traceback__ if self._local_frames else None
            kept = []
            while tb is not None:
                if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
                    kept.append(tb)
                tb = tb.tb_next
            shown: types.TracebackType | None = None
            for entry in reversed(kept):
                shown = types.TracebackType(shown, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
            lines = ipython_lines(shell, type(self), self, shown)
        finally:
            self.__cause__ = cause
        return [notebook_frames(line, shell) for line in lines]


class NbddpWarning(UserWarning):
    """Something the user should know about a launch; shown by Python's default filters."""


class WorkerError(NbddpError, RuntimeError):
    """A rank failed; the whole run was ended because of it.

    ``exc_type`` is the name of the remote exception, or ``None`` when the rank died without one
    (a signal, ``os._exit``, a segfault). ``__cause__`` is the remote exception itself when it
    could be rebuilt in the kernel. ``node`` is the address of the rank's machine on a cluster.
    """

    _cause_in_message = True

    def __init__(
        self,
        rank: int,
        *,
        exitcode: int | None = None,
        exc_type: str | None = None,
        exc_message: str = "",
        remote_traceback: str = "",
        hint: str = "",
        node: str | None = None,
        summary: str = "",
    ) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.hint = hint
        self.node = node
        self.summary = summary  # replaces the first line when set (e.g. an early exit)
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"rank {self.rank}" + (f" (on {self.node})" if self.node else "")
        if self.summary:
            head = self.summary
        elif self.exc_type is not None:
            head = f"{where} raised {self.exc_type}"
            if self.exc_message:
                head += f": {self.exc_message}"
        else:
            head = f"{where} {describe_exit(self.exitcode)}"
        parts = [head]
        if self.hint:
            parts.append(self.hint)
        if self.remote_traceback:
            trace = self.remote_traceback.rstrip()
            parts.append(f"\n--- traceback on rank {self.rank} ---\n{trace}")
        return "\n".join(parts)

    def __str__(self) -> str:  # also for the combined classes, whose other base may differ
        return self._message()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._message().splitlines()[0]!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields when the error is pickled
        names = ("exitcode", "exc_type", "exc_message", "remote_traceback", "hint", "node")
        fields = {name: getattr(self, name) for name in (*names, "summary")}
        return functools.partial(WorkerError, self.rank, **fields), ()

    @classmethod
    def raised(
        cls,
        rank: int,
        exc_type: str,
        message: str,
        traceback: str,
        original: BaseException | None,
        remote_class: type | None = None,
        node: str | None = None,
        hint: str = "",
    ) -> WorkerError:
        """The error for a rank that raised: also an instance of the remote exception's class
        when that class is an ``Exception`` the kernel has (so ``except ValueError:`` around a
        launch catches a rank's ValueError), a plain WorkerError otherwise."""
        remote_class = type(original) if original is not None else remote_class
        combined = _combined_class(remote_class) if remote_class is not None else None
        fields: dict[str, Any] = {"exc_type": exc_type, "exc_message": message, "hint": hint}
        fields.update(remote_traceback=traceback, node=node)
        error: WorkerError
        if combined is not None:
            try:
                error = Exception.__new__(combined)
                if original is not None:  # what the user's __init__ set, e.g. error.code
                    error.__dict__.update(getattr(original, "__dict__", {}))
                WorkerError.__init__(error, rank, **fields)
            except Exception:  # a class whose instances cannot be made this way
                combined = None
        if combined is None:
            error = cls(rank, **fields)
        if original is not None:
            error.__cause__ = original
        return error


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def ipython_lines(shell: Any, etype: type[BaseException], value: Any, tb: Any) -> list[str]:
    """IPython's lines for an error, or its own line where IPython cannot (before 8.x it asserts
    frames): a ``_render_traceback_`` that raises leaves the cell without a reply, a hang."""
    try:
        return list(shell.InteractiveTB.structured_traceback(etype, value, tb))
    except Exception:
        return traceback.format_exception_only(etype, value)


def _ipython() -> Any:
    """The running IPython shell, without importing IPython where nothing did."""
    if "IPython" not in sys.modules:
        return None
    return sys.modules["IPython"].get_ipython()


def notebook_frames(text: str, shell: Any) -> str:
    """``File "/tmp/ipykernel_7/4242.py", line 6`` as IPython writes it: ``Cell In[5], line 6``
    (the notebook's cells and ``%%ddp`` cells, whose file names the shell's compiler knows)."""
    cells = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}

    def label(match: re.Match[str]) -> str:
        number = cells.get(match["file"])
        return match[0] if number is None else f"Cell In[{number}], line {match['line']}"

    return _FRAME.sub(label, text)


_COMBINED: dict[type, type[WorkerError] | None] = {}


def _combined_class(remote: type) -> type[WorkerError] | None:
    """``WorkerError`` and ``remote`` in one class, or None where they cannot be combined:
    BaseException-only types (KeyboardInterrupt, SystemExit), nbddp's own errors, and classes
    whose instance layout conflicts (OSError, SyntaxError, ...)."""
    if not isinstance(remote, type) or not issubclass(remote, Exception):
        return None
    if issubclass(remote, NbddpError) or remote in (Exception, RuntimeError):
        return None
    if remote not in _COMBINED:
        try:
            _COMBINED[remote] = type(  # a WorkerError subclass
                "WorkerError",  # what IPython shows: the rank's class is in the message
                (WorkerError, remote),
                {
                    "__module__": "nbddp.errors",
                    "__qualname__": f"WorkerError[{remote.__name__}]",
                    "__str__": WorkerError.__str__,
                    "__repr__": WorkerError.__repr__,
                    "__reduce__": WorkerError.__reduce__,
                    "__init__": WorkerError.__init__,
                },
            )
        except TypeError:  # layout or method-order conflict
            _COMBINED[remote] = None
    return _COMBINED[remote]


def import_class(qualified: str) -> type | None:
    """The class ``module.Qual.Name`` when the kernel can import it without side effects it
    had not already paid (only modules already imported are looked at)."""
    import sys

    module_name, _, qualname = qualified.rpartition(".")
    while module_name and module_name not in sys.modules:
        module_name, _, head = module_name.rpartition(".")
        qualname = f"{head}.{qualname}"
    if not module_name:
        return None
    found: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found if isinstance(found, type) else None


def our_bug(where: str, exc: BaseException) -> NbddpError:
    """A bug of nbddp's own (in a supervisor's or a session's loop), as the error the user sees:
    it names the loop and keeps the original, with its traceback, as the cause."""
    error = NbddpError(f"nbddp's {where} failed: {exc!r} (see the cause above)")
    error.__cause__ = exc
    return error


def warn_user(message: str, category: type[Warning] = NbddpWarning) -> None:
    """Warn, pointing at the first frame outside nbddp: the user's call (or cell)."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)
    level = 2  # stacklevel 1 is this function, 2 its caller (the frame above)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)


def warn_always(message: str, category: type[Warning] = NbddpWarning) -> None:
    """Warn at the user's call (or cell) every time, even from the same line as before: a
    run's verdict is news each run (``warnings.warn`` shows a line's warning once)."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=str(frame.f_globals.get("__name__", "")),
        module_globals=frame.f_globals,
    )


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


class SerializationError(NbddpError, TypeError):
    """An object cannot be pickled to travel between the notebook and the ranks.

    ``path`` walks from what was being sent down to the culprit, e.g.
    ``train -> global 'lock' -> _thread.lock``.
    """

    def __init__(self, what: str, path: str, reason: str, hint: str = "") -> None:
        self.what = what
        self.path = path
        self.reason = reason
        self.hint = hint
        message = f"cannot send {what}: {path} cannot be pickled ({reason})."
        message += "\n" + (
            hint
            or (
                "Create such objects inside the function (or the %%ddp cell) instead of "
                "capturing them from the notebook, or pass something picklable in their place."
            )
        )
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.path, self.reason, self.hint))


class LaunchTimeout(NbddpError, TimeoutError):
    """The run took longer than its ``timeout``; every rank was terminated (a session's were
    interrupted, and ``ended`` says how it went). ``stacks``: where each rank was just before."""

    def __init__(self, timeout: float, ended: str = "all workers were terminated") -> None:
        self.timeout = timeout
        self.ended = ended
        self.stacks: Any = None
        super().__init__(
            f"the run did not finish within timeout={timeout:g} s; {ended}. "
            "Pass a larger timeout= (or None for no limit)."
        )

    def __str__(self) -> str:
        where = "" if self.stacks is None else "\nWhere the ranks were:\n" + self.stacks.rollcall()
        return super().__str__() + where

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.timeout, self.ended))


class RunStopped(NbddpError):
    """``Run.result()`` of a run that was stopped (its Stop button, ``stop()`` or an
    interrupt) before it finished; ``stacks``: where the ranks were, if it had stalled."""

    def __init__(self, stacks: Any = None) -> None:
        self.stacks = stacks
        where = "" if stacks is None else "\nIt had stalled; the ranks were:\n" + stacks.rollcall()
        super().__init__("the run was stopped before it finished, so it has no result." + where)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), ())
