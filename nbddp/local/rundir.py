"""The run's private directory: owner-only, holds the channel's socket, the job spec and the
``__main__`` script every rank runs, and is removed when the run ends.

Ownership is a ``flock`` held on ``owner.lock`` for the run's whole life. The kernel drops the
lock when the process dies, however it dies, so the next launch recognises the directory of a
killed kernel (its lock is free) and removes it; a recycled pid cannot fool it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time

PREFIX = "nbddp-"
_SCRIPT = """\
# Written by nbddp for one run and removed when it ends.
if __name__ == "__main__":
    import sys

    sys.path.append({package_parent!r})
    from nbddp.worker.entry import main

    sys.exit(main({directory!r}))
"""
SCRIPT = "launch.py"
_YOUNG = 10.0  # seconds: a directory this new is never swept


class RunDir:
    """A 0700 directory under the system's temp dir, named ``nbddp-<pid>-*``."""

    def __init__(self) -> None:
        sweep_stale_dirs()
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        self._lock = os.open(os.path.join(self.path, "owner.lock"), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def write(self, name: str, data: bytes) -> str:
        path = self.join(name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def write_script(self) -> str:
        """The ``__main__`` script each rank runs (``worker/entry.py`` does the work)."""
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        script = _SCRIPT.format(package_parent=package_parent, directory=self.path)
        return self.write(SCRIPT, script.encode())

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock)


def sweep_stale_dirs() -> None:
    """Remove the directories of runs whose kernel died without cleaning up."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(root, name)
        lock = os.path.join(path, "owner.lock")
        try:
            if time.time() - os.stat(lock).st_mtime < _YOUNG:
                continue  # being created right now: its owner may not hold the lock yet
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # not one of ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
