"""The processes that run ranks: how one is started cold, watched, and ended with everything
it started.

* :class:`ColdStarter` starts a rank as a fresh interpreter (``sys.executable`` running the
  run's ``__main__`` script) in a session of its own; never a fork of the kernel. The
  pre-warmed starter (``forkserver.py``) implements the same :class:`Starter` protocol.
* :func:`exit_status` reads how a process ended without reaping it (``WNOWAIT``), so its pid,
  which is also its process-group id, stays ours to signal until :meth:`release`.
* :func:`terminate` is the one teardown: SIGTERM to every rank's process group, a grace
  period, then SIGKILL to the groups and to every process that belongs to the run but left
  them (see :func:`strays`), then wait until the killed ranks are seen gone, then
  reap.

Non-goal: restarting ranks; a run is all-or-nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Protocol

from nbddp.environment import RUN_ID_VARIABLE
from nbddp.worker.reaping import exit_status, process_table, signal_each

TERM_GRACE = 2.0  # seconds between SIGTERM and SIGKILL
KILL_WAIT = 5.0  # seconds the teardown waits for a killed rank's end to be seen


class WorkerProcess(Protocol):
    """One started rank, as the supervisor sees it."""

    pid: int
    sentinel: int  # a file descriptor that becomes readable once the process has ended

    def exitcode(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs. Never
        blocks."""

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the rank and every process left in its process group."""

    def release(self) -> None:
        """Reap the ended process and free what tracks it."""


class Starter(Protocol):
    def warm_up(self) -> None:
        """Wait, interruptibly, until starting ranks is quick (a pre-warmed helper is ready, or
        will not be); called before the uninterruptible start."""

    def start(
        self, argv: list[str], env: dict[str, str], stdout: int, stderr: int
    ) -> WorkerProcess:
        """Start one rank with these pipe ends as its stdout/stderr."""


def signal_group(leader: int, signum: int) -> None:
    """Signal a rank's whole process group (it leads its own session); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signum)


class ColdProcess:
    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid)
        self._code: int | None = None

    def exitcode(self) -> int | None:
        if self._code is None:
            self._code = exit_status(self.pid)
        return self._code

    def signal_group(self, signum: int) -> None:
        signal_group(self.pid, signum)

    def release(self) -> None:
        self._popen.wait()
        os.close(self.sentinel)


class ColdStarter:
    """A brand-new interpreter per rank: ~1-2 s of ``import torch`` each, nothing inherited.
    ``die_with_starter``: each rank is killed when the thread that started it ends (a detached
    run's supervisor, whose ranks must not outlive it however it dies)."""

    _die_with_starter = False  # also for a subclass that does not call __init__

    def __init__(self, die_with_starter: bool = False) -> None:
        self._die_with_starter = die_with_starter

    def warm_up(self) -> None:
        pass

    def start(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> ColdProcess:
        popen = subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            close_fds=True,
            preexec_fn=_die_with(os.getpid()) if self._die_with_starter else None,
        )
        return ColdProcess(popen)


def _die_with(parent: int) -> Callable[[], None]:
    def in_the_child() -> None:  # between fork and exec: prctl and a check, nothing else
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)

    return in_the_child


class ForkedProcess:
    """A helper forked by this process (``worker.own_helper.fork_server``), handled like the
    ``Popen`` of a started one."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("nbddp helper", timeout or 0)
            time.sleep(0.01)
        assert self._code is not None
        return self._code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def terminate(
    processes: Sequence[WorkerProcess], run_id: str, since: float, grace: float = TERM_GRACE
) -> None:
    """End every rank and everything the run started; the same path for every ending.

    TERM goes to each rank's process group, KILL after ``grace`` seconds (at once when they are
    gone) to the groups and to the run's strays (:func:`strays`). When every rank had already
    exited with code 0 there is nothing to look for: a rank ends its own descendants before it
    exits (``worker/rank/entry.py``).
    """
    clean = all(p.exitcode() == 0 for p in processes)
    pids = [p.pid for p in processes]
    found = set() if clean else strays(run_id, pids, since)
    alive = [p for p in processes if p.exitcode() is None]
    for process in alive:
        process.signal_group(signal.SIGTERM)
    signal_each(found, signal.SIGTERM)
    alive = _wait_ended(alive, grace)
    for process in processes:  # the leader and anything still in its group
        process.signal_group(signal.SIGKILL)
    if not clean:
        found |= strays(run_id, pids, since)
        signal_each(found, signal.SIGKILL)
    _wait_ended(alive, KILL_WAIT)  # killed, but not gone until its exit is seen
    for process in processes:
        process.release()


def _wait_ended(processes: Sequence[WorkerProcess], timeout: float) -> list[WorkerProcess]:
    """Wait until each process's end is known, up to ``timeout`` seconds; those still not."""
    give_up = time.monotonic() + timeout
    while processes and time.monotonic() < give_up:
        wait([p.sentinel for p in processes], timeout=give_up - time.monotonic())
        processes = [p for p in processes if p.exitcode() is None]
    return list(processes)


def strays(run_id: str, ranks: Sequence[int], since: float) -> set[int]:
    """The live processes of a run other than its ranks: the ranks' descendants whatever their
    session, and processes of ours started since the run began (``since``, a ``time.time()``)
    whose environment carries the run's id (orphans re-parented away from the ranks).

    What cannot be found is the documented limit: a process that changed its user, or one
    forked without ``exec`` by a pre-warmed rank that was killed, once it left the tree
    (the pre-warmed helper ends those itself, as their reaper).
    """
    table = process_table()
    found = table.descendants(ranks)
    marker = f"{RUN_ID_VARIABLE}={run_id}".encode()
    for pid, started in table.started.items():
        if pid in found or started < since - 1.0:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.add(pid)
        except OSError:
            continue
    return found - set(ranks) - {os.getpid()}
