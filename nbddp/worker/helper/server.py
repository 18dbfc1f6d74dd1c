"""Pre-warmed ranks, the helper's side: the process that forks fresh ranks on request.

Started by the kernel (``local/forkserver.py``) from a fresh interpreter, it imports torch, the
rank runtime and what a first training step needs (``preload.py``), never touches CUDA, and
then serves requests on the inherited socket: ``Spawn`` hands the launch to a child forked
ahead (``forked.py``), which runs the launch script as ``__main__``; ``Release`` reaps a rank
the kernel saw end; ``Preload`` names modules the notebook imported, which the helper imports
while no rank of its own runs (and before the next launch's ranks start, if still pending).
It reports every rank's exit (``Exited``) without reaping it, so the pid stays the kernel's to
signal.

It is the reaper of its ranks' orphans (``PR_SET_CHILD_SUBREAPER``): a process a rank started
that outlived the rank becomes the helper's child, and the helper ends it at once, whatever
session it moved to. Its ranks die with it (``PR_SET_PDEATHSIG``), and it exits when the
kernel's end of the socket closes. A detached run's supervisor is forked from here too
(``Spawn(detached=True)``, ``leaving.py``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import select
import signal
import socket
import sys
import time

from nbddp.wire.code_origin import standing_in_sys_modules
from nbddp.wire.frames import Connection
from nbddp.wire.helper import (
    Exited,
    Handoff,
    Imported,
    Preload,
    Preloaded,
    Preloading,
    Ready,
    Release,
    Spawn,
    Spawned,
    SpawnFailed,
    Unsafe,
)
from nbddp.worker.helper import forked
from nbddp.worker.helper.leaving import start_supervisor
from nbddp.worker.helper.preload import FIRST_STEP, Preloader, Safety, children
from nbddp.worker.reaping import become_subreaper, exit_status, process_table, signal_each

_STRAY_CHECK = 1.0  # seconds between two looks for orphans to end
_QUIET = 0.02  # seconds without a request before the pool is filled again
_POOL_MIN, _POOL_MAX = 2, 16

# Imported before anything else, used by every rank: torch (the point of the helper) and all
# that a rank imports before fn, including what it imports lazily (world: ~3 ms per launch).
PRELOADED = (
    "torch",
    "nbddp.worker.rank.entry",
    "nbddp.worker.rank.world",
    "nbddp.worker.helper.forked",
)


def serve() -> None:
    """The helper's main loop: import, announce readiness, fork ranks on request."""
    conn = Connection(socket.socket(fileno=int(sys.argv[1])))
    for name in PRELOADED:
        importlib.import_module(name)
    serve_on(conn)


def serve_on(conn: Connection) -> None:
    """Serve the helper's requests on ``conn`` until it closes (PRELOADED imported)."""
    _Helper(conn).serve()


class _Helper:
    """The helper's state: its ranks, a pool of children forked ahead, and its imports.

    A fork of a process that imported torch costs ~6 ms, mostly copying page tables. So the
    helper keeps a few children forked ahead (as many as the last launch used): a request
    hands one of them its job and is answered at once. Such a child is as fresh as one forked
    on request: it ran nothing between the fork and its job. A child forked before an import
    lacks that module: it is discarded (``generation``) and a new one forked.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.ranks: dict[int, bool] = {}  # pid -> released by the kernel
        self.reported: set[int] = set()
        self.channels: dict[int, Connection] = {}  # a rank's, for its report of its imports
        self.idle: dict[int, tuple[socket.socket, int]] = {}  # forked ahead: socket, generation
        self.generation = 0  # grows with each import: older children lack a module
        self.pool_size = _POOL_MIN
        self.last_request = 0.0
        self.last_stray_check = 0.0
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.safety = Safety()  # as torch left the process: no more threads, no CUDA
        self.unsafe: str | None = None
        self.preloader = Preloader()
        self.preloader.ask(FIRST_STEP)
        self.acknowledge = False  # a Preload was read: say Preloaded when nothing is left
        self.busy = False  # imported since the last Preloaded
        self.edited = False  # a local module changed: import them anew once no rank runs

    def serve(self) -> None:
        become_subreaper()
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while self._import_next():  # the first step's modules, before any rank
            pass
        self._send(Ready(os.getpid()))
        while True:
            channels = {c.fileno(): pid for pid, c in self.channels.items()}
            readable, _, _ = select.select(
                [self.conn.fileno(), self.wake_r, *channels], [], [], self._timeout()
            )
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
                self._report_exits()
            for fd in readable:
                if fd in channels:
                    self._hear_rank(channels[fd])
            if self.conn.fileno() in readable:
                if not self._handle():
                    return  # the kernel is gone: so are we, and our ranks (PDEATHSIG)
            elif time.monotonic() - self.last_request >= _QUIET and not (
                self._may_import() and self._import_next()
            ):
                self._fill_pool()  # between launches, never in the middle of one
            if time.monotonic() - self.last_stray_check >= _STRAY_CHECK:
                self.last_stray_check = time.monotonic()
                self._end_strays()

    def _timeout(self) -> float:
        """While requests come: short, to notice the quiet. Then at once, when there is
        something to import or the pool needs filling; else only the next look for strays."""
        if time.monotonic() - self.last_request < _QUIET:
            return _QUIET
        if self._may_import() or (len(self.idle) < self.pool_size and self.unsafe is None):
            return 0
        return _STRAY_CHECK

    def _send(self, message: object) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(message)

    # -- imports -------------------------------------------------------------------------------

    def _may_import(self) -> bool:
        """Imports wait until no rank runs: they would take its CPU."""
        if not all(pid in self.reported for pid in self.ranks):
            return False
        if self.unsafe is not None:
            return self.acknowledge  # nothing more is imported: say so
        return self.acknowledge or self.edited or self.preloader.next_import() is not None

    def _import_next(self, refresh: bool = True) -> bool:
        """One step of the imports; False when there was nothing left to do. ``refresh``: the
        local modules edited since are imported anew first (never while ranks run)."""
        if refresh and self.edited and self.unsafe is None:
            self.edited = False
            self.preloader.forget_local()
            self.generation += 1
        name = self.preloader.next_import() if self.unsafe is None else None
        if name is None:
            if self.acknowledge or self.busy:
                self.acknowledge = self.busy = False
                self._send(Preloaded(len(sys.modules)))
            return False
        self.busy = True
        self._send(Preloading(name))
        count, before = len(sys.modules), children()
        self.preloader.load(name)
        if len(sys.modules) != count:
            self.generation += 1
            gc.freeze()  # imported objects stay out of every collection: ranks share their pages
            reason = self.safety.broken(before)
            if reason is not None:
                self._unsafe(name if name in FIRST_STEP else name.partition(".")[0], reason)
        return True

    def _unsafe(self, module: str, reason: str) -> None:
        """No more forks: the children forked before still can take a launch."""
        self.unsafe = reason
        self.preloader.pending.clear()
        self._send(Unsafe(module, reason))

    # -- requests ------------------------------------------------------------------------------

    def _handle(self) -> bool:
        try:
            frame = self.conn.recv()
        except (EOFError, OSError):
            return False
        self.last_request = time.monotonic()
        match frame.message:
            case Spawn(request=request, argv=argv, env=env, detached=detached):
                try:
                    if detached:  # its middle child's pid, already reaped
                        pid = start_supervisor(self._fork, argv, env, frame.fds)
                    else:
                        pid = self._start_rank(argv, env, frame.fds)
                except OSError as exc:
                    self._send(SpawnFailed(request, repr(exc)))
                else:
                    if not detached:
                        self.ranks[pid] = False
                    self._send(Spawned(request, pid))
                finally:
                    for fd in frame.fds:
                        os.close(fd)
            case Release(pid=pid) if pid in self.ranks:
                self.ranks[pid] = True
                self._report_exits()
            case Preload(modules=modules, sys_path=sys_path, exclude=exclude):
                self.preloader.adopt_paths(sys_path)
                self.preloader.ask(modules, exclude)
                self.acknowledge = True
        return True

    def _start_rank(self, argv: list[str], env: dict[str, str], fds: list[int]) -> int:
        """A child from the pool takes the job, or a child forked now when there is none. What
        the kernel asked to preload before this launch is imported first, as a fork launcher's
        ranks would have it; a rank drops the local modules edited since they were imported."""
        while self._import_next(refresh=False):
            pass
        drop = list(self.preloader.local) if self.preloader.edited() else []
        self.edited = self.edited or bool(drop)
        self.pool_size = min(_POOL_MAX, max(self.pool_size, len(self.ranks) + 1))
        for pid in list(self.idle):
            channel, generation = self.idle.pop(pid)
            if generation != self.generation and self.unsafe is None:
                self._discard(pid, channel)  # forked before an import: lacks a module
                continue
            try:
                Connection(channel).send(Handoff(argv, env, drop), fds=fds)
            except OSError:  # it died waiting: try the next one
                channel.close()
                continue
            self.channels[pid] = Connection(channel)
            return pid
        pid, channel = self._fork()
        Connection(channel).send(Handoff(argv, env, drop), fds=fds)
        self.channels[pid] = Connection(channel)
        return pid

    def _fork(self) -> tuple[int, socket.socket]:
        reason = self.unsafe or self.safety.broken()
        if reason is not None:
            if self.unsafe is None:
                self._unsafe("", reason)
            raise OSError(f"the helper cannot fork safely: {reason}")
        if forked.known_generation != self.generation:
            forked.known = frozenset(sys.modules)
            forked.known_generation = self.generation
            standing_in_sys_modules()  # read here once: a rank reads only what it imports
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = forked.fork_child([*self._inherited(), ours.fileno()], theirs)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return pid, ours

    def _fill_pool(self) -> None:
        for pid, (channel, generation) in list(self.idle.items()):
            if generation != self.generation and self.unsafe is None:
                del self.idle[pid]
                self._discard(pid, channel)
        while len(self.idle) < self.pool_size and self.unsafe is None:
            try:
                pid, channel = self._fork()
            except OSError:
                return
            self.idle[pid] = (channel, self.generation)

    def _discard(self, pid: int, channel: socket.socket) -> None:
        channel.close()
        signal_each([pid], signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    def _inherited(self) -> list[int]:
        """The helper's descriptors that a child must close."""
        return [
            self.conn.fileno(),
            self.wake_r,
            self.wake_w,
            *(channel.fileno() for channel, _ in self.idle.values()),
            *(conn.fileno() for conn in self.channels.values()),
        ]

    def _hear_rank(self, pid: int) -> None:
        """A rank's last words: the modules it imported, for the next launch's ranks."""
        conn = self.channels[pid]
        try:
            message = conn.recv().message
        except (EOFError, OSError):
            conn.close()
            del self.channels[pid]
            return
        if isinstance(message, Imported) and self.unsafe is None:
            self.preloader.adopt_paths(message.sys_path)
            self.preloader.ask(message.modules)

    # -- exits ---------------------------------------------------------------------------------

    def _report_exits(self) -> None:
        """Tell the kernel of every rank that ended; reap those it has released."""
        for pid, released in list(self.ranks.items()):
            if pid not in self.reported:
                code = exit_status(pid)
                if code is None:
                    continue  # still running (also when already released: reaped once it ends)
                self.reported.add(pid)
                self._send(Exited(pid, code))
            if released:  # and ended: reaping cannot block
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                del self.ranks[pid]
                self.reported.discard(pid)
                if pid in self.channels:  # its last words, if still unread, then its end
                    if select.select([self.channels[pid].fileno()], [], [], 0)[0]:
                        self._hear_rank(pid)
                    if pid in self.channels:
                        self.channels.pop(pid).close()
        for pid in list(self.idle):  # a pool child that died (it should not): forget it
            if exit_status(pid) is not None:
                self.idle.pop(pid)[0].close()
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
