"""Pre-warmed ranks, the helper's side: the process that forks fresh ranks on request.

Started by the kernel (``nbddp/forkserver.py``) from a fresh interpreter, it imports torch and
the rank runtime once, never touches CUDA, and then serves requests on the inherited socket:
``Spawn`` forks a rank that runs the launch script as ``__main__``; ``Release`` reaps a rank
the kernel saw end. It reports every rank's exit (``Exited``) without reaping it, so the pid
stays the kernel's to signal.

It is the reaper of its ranks' orphans (``PR_SET_CHILD_SUBREAPER``): a process a rank started
that outlived the rank becomes the helper's child, and the helper ends it at once, whatever
session it moved to. Its ranks die with it (``PR_SET_PDEATHSIG``), and it exits when the
kernel's end of the socket closes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import signal
import socket
import sys
import time

from nbddp.wire.frames import Connection
from nbddp.wire.helper import Exited, Ready, Release, Spawn, Spawned, SpawnFailed
from nbddp.worker.reaping import become_subreaper, exit_status, process_table, signal_each

_PR_SET_PDEATHSIG = 1
_STRAY_CHECK = 1.0  # seconds between two looks for orphans to end
_QUIET = 0.02  # seconds without a request before the pool is filled again
_POOL_MIN, _POOL_MAX = 2, 16


# Imported once here, used by every rank: torch (the point of the helper) and all that a rank
# imports before fn, including what it imports lazily (world: ~3 ms per launch otherwise).
PRELOADED = ("torch", "nbddp.worker.entry", "nbddp.worker.world")


def serve() -> None:
    """The helper's main loop: import, announce readiness, fork ranks on request."""
    conn = Connection(socket.socket(fileno=int(sys.argv[1])))
    for name in PRELOADED:
        importlib.import_module(name)
    _Helper(conn).serve()


class _Helper:
    """The helper's state: its ranks, and a pool of forked children waiting to become ranks.

    A fork of a process that imported torch costs ~6 ms, mostly copying page tables. So the
    helper keeps a few children forked ahead (as many as the last launch used): a request
    hands one of them its job and is answered at once. Such a child is as fresh as one forked
    on request: it ran nothing between the fork and its job.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.ranks: dict[int, bool] = {}  # pid -> released by the kernel
        self.reported: set[int] = set()
        self.idle: dict[int, socket.socket] = {}  # forked ahead, waiting for a job
        self.pool_size = _POOL_MIN
        self.last_request = 0.0
        self.last_stray_check = 0.0
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    def serve(self) -> None:
        become_subreaper()
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.conn.send(Ready(os.getpid()))
        while True:
            readable, _, _ = select.select(
                [self.conn.fileno(), self.wake_r], [], [], self._timeout()
            )
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
                self._report_exits()
            if self.conn.fileno() in readable:
                if not self._handle():
                    return  # the kernel is gone: so are we, and our ranks (PDEATHSIG)
            elif time.monotonic() - self.last_request >= _QUIET:
                self._fill_pool()  # between launches, never in the middle of one
            if time.monotonic() - self.last_stray_check >= _STRAY_CHECK:
                self.last_stray_check = time.monotonic()
                self._end_strays()

    def _timeout(self) -> float:
        """While requests come: short, to notice the quiet. Then at once, when the pool needs
        filling; else only the next look for strays is due."""
        if time.monotonic() - self.last_request < _QUIET:
            return _QUIET
        return 0 if len(self.idle) < self.pool_size else _STRAY_CHECK

    def _handle(self) -> bool:
        try:
            frame = self.conn.recv()
        except (EOFError, OSError):
            return False
        self.last_request = time.monotonic()
        match frame.message:
            case Spawn(request=request, argv=argv, env=env):
                try:
                    pid = self._start_rank(argv, env, frame.fds)
                except OSError as exc:
                    _send(self.conn, SpawnFailed(request, repr(exc)))
                else:
                    self.ranks[pid] = False
                    _send(self.conn, Spawned(request, pid))
                finally:
                    for fd in frame.fds:
                        os.close(fd)
            case Release(pid=pid) if pid in self.ranks:
                self.ranks[pid] = True
                self._report_exits()
        return True

    def _start_rank(self, argv: list[str], env: dict[str, str], fds: list[int]) -> int:
        """A child from the pool takes the job, or a child forked now when there is none."""
        self.pool_size = min(_POOL_MAX, max(self.pool_size, len(self.ranks) + 1))
        while self.idle:
            pid, channel = self.idle.popitem()
            try:
                Connection(channel).send(Spawn(0, argv, env), fds=fds)
                return pid
            except OSError:  # it died waiting: try the next one
                channel.close()
        return _fork_child(self._inherited(), (argv, env, fds))

    def _fill_pool(self) -> None:
        while len(self.idle) < self.pool_size:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                pid = _fork_child([*self._inherited(), ours.fileno()], theirs)
            except OSError:
                ours.close()
                return
            finally:
                theirs.close()
            self.idle[pid] = ours

    def _inherited(self) -> list[int]:
        """The helper's descriptors that a child must close."""
        return [
            self.conn.fileno(),
            self.wake_r,
            self.wake_w,
            *(s.fileno() for s in self.idle.values()),
        ]

    def _report_exits(self) -> None:
        """Tell the kernel of every rank that ended; reap those it has released."""
        for pid, released in list(self.ranks.items()):
            if pid not in self.reported:
                code = exit_status(pid)
                if code is None:
                    continue  # still running (also when already released: reaped once it ends)
                self.reported.add(pid)
                _send(self.conn, Exited(pid, code))
            if released:  # and ended: reaping cannot block
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                del self.ranks[pid]
                self.reported.discard(pid)
        for pid in list(self.idle):  # a pool child that died (it should not): forget it
            if exit_status(pid) is not None:
                self.idle.pop(pid).close()
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)

    def _end_strays(self) -> None:
        """Children that are neither ranks nor pool children are orphans a rank left behind:
        end them, and reap the ones that ended."""
        known = set(self.ranks) | set(self.idle)
        while True:
            try:
                status = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return  # no child at all: nothing to look for
            if status is None or status.si_pid in known:
                break
            with contextlib.suppress(ChildProcessError):
                os.waitpid(status.si_pid, 0)
        orphans = set(process_table().children.get(os.getpid(), ())) - known
        signal_each(orphans, signal.SIGKILL)  # their own children come to us next, and go too


def _send(conn: Connection, message: object) -> None:
    with contextlib.suppress(OSError):
        conn.send(message)


Job = tuple[list[str], dict[str, str], list[int]]  # argv, env, the stdout/stderr pipe ends


def _fork_child(inherited: list[int], job: Job | socket.socket) -> int:
    """Fork a child that runs ``job`` at once, or, given a socket, waits there for its job."""
    sys.stdout.flush()
    sys.stderr.flush()
    helper = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _die_with(helper)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        if isinstance(job, socket.socket):
            frame = Connection(job).recv()  # EOFError when the helper goes: we go too
            job.close()
            job = (frame.message.argv, frame.message.env, frame.fds)
        code = _become_rank(*job)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return 0  # not reached


def _become_rank(argv: list[str], env: dict[str, str], fds: list[int]) -> int:
    """In the child: a session of its own, the pipes as stdout/stderr, the rank's environment
    and fresh random state, then the launch script as ``__main__``."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    _reseed_and_thread(env)
    import runpy

    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def _die_with(parent: int) -> None:
    """SIGKILL when the helper dies (set before the check: no window in between)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _reseed_and_thread(env: dict[str, str]) -> None:
    """What a fresh interpreter would have: its own random state and thread count."""
    import random

    import torch

    random.seed()
    torch.seed()
    if "numpy.random" in sys.modules:  # else its first import seeds itself (and costs ~8 ms)
        sys.modules["numpy.random"].seed()
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
