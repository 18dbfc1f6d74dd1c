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

Beside the tree: ``render.py`` (how an error reads in a notebook), ``remote.py`` (a rank's
exception rebuilt in the kernel), ``notices.py`` (warnings, and our own bug as an error).
"""

from __future__ import annotations

import functools
import types
from typing import Any

from nbddp.errors.render import PACKAGE_DIR, describe_exit, ipython_lines, notebook_frames
from nbddp.errors.render import ipython as _ipython  # a test stands an old IPython in

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
                if not tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
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
        elif self.exc_type == "SystemExit" and self.exitcode is not None:  # a script's
            given = self.exc_message
            given = given if given.lstrip("-").isdigit() else repr(given)
            head = f"{where} exited with code {self.exitcode} (sys.exit({given}))"
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
