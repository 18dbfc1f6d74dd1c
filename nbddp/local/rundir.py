"""The run's private directory: owner-only, holds the channel's socket, the job spec and the
``__main__`` script every rank runs, and is removed when the run ends.

Ownership is a ``flock`` held on ``owner.lock`` for the run's whole life. The kernel drops the
lock when the process dies, however it dies, so the next launch recognises the directory of a
killed kernel (its lock is free) and removes it at once; a recycled pid cannot fool it.

A directory is made under a temporary name (``.nbddp-new-<pid>-*``), locked, and only then
renamed to its run name (``nbddp-<pid>-*``): a run-named directory is locked from the instant
it exists, so a sweep never mistakes a young one for a dead kernel's and needs no age guard.
A temporary one is left only by a kernel killed between ``mkdtemp`` and the rename; the sweep
removes it once the pid in its name is gone.

Non-goal: directories of other users (their 0700 directories cannot be entered or removed).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile

PREFIX = "nbddp-"
_NEW = ".nbddp-new-"  # a directory being made: not yet locked, or not yet renamed
_LOCK = "owner.lock"
_SCRIPT = """\
# Written by nbddp for one run and removed when it ends.
if __name__ == "__main__":
    import sys

    sys.path.append({package_parent!r})
    from nbddp.worker.rank.entry import main

    sys.exit(main({directory!r}))
"""
SCRIPT = "launch.py"


class RunDir:
    """A 0700 directory under the system's temp dir, named ``nbddp-<pid>-*``."""

    def __init__(self) -> None:
        sweep_stale_dirs()
        new = tempfile.mkdtemp(prefix=f"{_NEW}{os.getpid()}-")
        try:
            self._lock = os.open(os.path.join(new, _LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            self.path = os.path.join(
                os.path.dirname(new), PREFIX + os.path.basename(new)[len(_NEW) :]
            )
            os.rename(new, self.path)  # a unique name: no other nbddp-* is made from this one
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            os.close(self._lock)
            raise

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def write(self, name: str, data: bytes) -> str:
        path = self.join(name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def write_script(self) -> str:
        """The ``__main__`` script each rank runs (``worker/rank/entry.py`` does the work)."""
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        script = _SCRIPT.format(package_parent=package_parent, directory=self.path)
        return self.write(SCRIPT, script.encode())

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock)


def sweep_stale_dirs() -> None:
    """Remove the directories of runs whose kernel died without cleaning up: at once, since
    every run-named directory is locked by its living owner from its first instant."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(PREFIX):
            if _lock_is_free(path):
                shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(_NEW) and _creator_is_gone(name[len(_NEW) :]):
            shutil.rmtree(path, ignore_errors=True)


def _lock_is_free(path: str) -> bool:
    try:
        fd = os.open(os.path.join(path, _LOCK), os.O_RDWR)
    except OSError:
        return False  # not one of ours, or not ours to remove
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its owner is alive
    finally:
        os.close(fd)
    return True


def _creator_is_gone(rest: str) -> bool:
    """Whether the process that began making ``.nbddp-new-<pid>-*`` is gone (it was killed
    before the rename: the directory holds at most an empty lock file)."""
    pid = rest.split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, someone else's
    return False
