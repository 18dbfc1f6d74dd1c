"""The exceptions nbddp raises in the notebook, each message written in its class.

    NbddpError
    ├── WorkerError         (also RuntimeError)  a rank raised, crashed or was killed
    ├── SerializationError  (also TypeError)     something cannot travel to or from the workers
    └── LaunchTimeout       (also TimeoutError)  the run outlived its ``timeout=``

Bad arguments are plain ``ValueError`` raised before any process starts (see ``plan.py``).
"""

from __future__ import annotations

import signal

__all__ = ["LaunchTimeout", "NbddpError", "SerializationError", "WorkerError"]


class NbddpError(Exception):
    """Base of every error nbddp raises on purpose."""


class WorkerError(NbddpError, RuntimeError):
    """A rank failed; the whole run was ended because of it.

    ``exc_type`` is the name of the remote exception, or ``None`` when the rank died without one
    (a signal, ``os._exit``, a segfault). ``__cause__`` is the remote exception itself when it
    could be rebuilt in the kernel.
    """

    def __init__(
        self,
        rank: int,
        *,
        exitcode: int | None = None,
        exc_type: str | None = None,
        exc_message: str = "",
        remote_traceback: str = "",
        hint: str = "",
    ) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.hint = hint
        super().__init__(self._message())

    def _message(self) -> str:
        if self.exc_type is not None:
            head = f"rank {self.rank} raised {self.exc_type}"
            if self.exc_message:
                head += f": {self.exc_message}"
        else:
            head = f"rank {self.rank} {describe_exit(self.exitcode)}"
        parts = [head]
        if self.hint:
            parts.append(self.hint)
        if self.remote_traceback:
            trace = self.remote_traceback.rstrip()
            parts.append(f"\n--- traceback on rank {self.rank} ---\n{trace}")
        return "\n".join(parts)

    def __reduce__(self):  # keep the fields when the error is pickled (e.g. by a Run handle)
        return (
            _rebuild_worker_error,
            (self.rank, self.exitcode, self.exc_type, self.exc_message,
             self.remote_traceback, self.hint),
        )


def _rebuild_worker_error(rank, exitcode, exc_type, exc_message, remote_traceback, hint):
    return WorkerError(
        rank, exitcode=exitcode, exc_type=exc_type, exc_message=exc_message,
        remote_traceback=remote_traceback, hint=hint,
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
        return "exited with code 0 without returning a value (did it call sys.exit or os._exit?)"
    return f"exited with code {exitcode} without a Python traceback (os._exit or a native crash)"


class SerializationError(NbddpError, TypeError):
    """An object cannot be pickled to travel between the notebook and the workers.

    ``path`` walks from what was being sent down to the culprit, e.g.
    ``train -> global 'lock' -> _thread.lock``.
    """

    def __init__(self, what: str, path: str, reason: str, hint: str = "") -> None:
        self.what = what
        self.path = path
        self.reason = reason
        message = f"cannot send {what}: {path} cannot be pickled ({reason})."
        message += "\n" + (hint or (
            "Create such objects inside the function (or the %%ddp cell) instead of "
            "capturing them from the notebook, or pass something picklable in their place."
        ))
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.what, self.path, self.reason))


class LaunchTimeout(NbddpError, TimeoutError):
    """The run took longer than its ``timeout``; every worker was terminated."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(
            f"the run did not finish within timeout={timeout:g} s; all workers were terminated. "
            "Pass a larger timeout= (or None for no limit)."
        )

    def __reduce__(self):
        return (type(self), (self.timeout,))
