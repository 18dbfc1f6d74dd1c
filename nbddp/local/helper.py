"""The kernel's handle on its pre-warmed helper process: start it, fork ranks, hear its news.

* The kernel talks to the helper over an inherited socketpair (nobody else can connect), with
  the framing of ``transport.py``; a rank's stdout/stderr pipe ends ride on its request.
* Requests carry an id. A request whose caller gave up (an interrupt, a timeout) leaves no
  stale reply behind: the reply is matched to nobody, and the rank it names is killed.
* The helper reports each rank's exit without reaping it (``WNOWAIT``): the pid stays the
  kernel's to signal until the kernel releases it. The report, not the pid, wakes the
  supervisor (a rank's ``sentinel``), so the exit code is known whenever it looks.
* A launch waits for its ranks while the helper makes progress: the modules it imports first
  (``Preloading``) may take seconds, a longer silence may not (``REPLY_WAIT``, ``IMPORT_WAIT``
  while it imports one module). A helper that stays
  silent (``hung``), died or became unsafe to fork (``unsafe``) is replaced by the starter.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

from nbddp.environment import WORKER_VARIABLE, without_launchers
from nbddp.local.processes import ForkedProcess, signal_group
from nbddp.wire.frames import Connection
from nbddp.wire.helper import (
    Exited,
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
from nbddp.worker.helper.preload import EXCLUDE_VARIABLE, user_excluded

REPLY_WAIT = 10.0  # seconds of silence from the helper before a launch gives up on it
IMPORT_WAIT = 30.0  # the same while it imports a module (a large one on a loaded machine: ~10 s)


class WarmProcess:
    """A rank forked by the helper, seen from the kernel."""

    def __init__(self, helper: Helper, pid: int) -> None:
        self._helper = helper
        self.pid = pid
        self.sentinel, self._reported = os.pipe()  # readable once the exit is known
        self.code: int | None = None

    def exited(self, code: int) -> None:
        """Called by the helper's reader thread with the exit status (once)."""
        if self.code is None:
            self.code = code
            with contextlib.suppress(OSError):
                os.write(self._reported, b"x")

    def exitcode(self) -> int | None:
        return self.code

    def signal_group(self, signum: int) -> None:
        signal_group(self.pid, signum)

    def release(self) -> None:
        self._helper.release(self.pid)
        for fd in (self.sentinel, self._reported):
            with contextlib.suppress(OSError):
                os.close(fd)


class Helper:
    """The helper process: started from a fresh interpreter, never a fork of the kernel.
    ``exclude``: modules it must not import (``NBDDP_PRELOAD_EXCLUDE``, the user's added).
    ``forked``: the socket and pid of a helper this process forked itself (a detached run's
    supervisor does: ``worker.own_helper.fork_server``), instead of starting one."""

    def __init__(
        self, exclude: Iterable[str] = (), forked: tuple[socket.socket, int] | None = None
    ) -> None:
        self._requests = itertools.count(1)
        self._replies: dict[int, WarmProcess | str] = {}  # a rank, or why it failed
        self._waiting: set[int] = set()  # requests whose caller still waits
        self._detached: set[int] = set()  # requests for a detached supervisor: not ours to track
        self._changed = threading.Condition()
        self._ranks: dict[int, WarmProcess] = {}
        self._heard = time.monotonic()
        self.ready = threading.Event()
        self.dead = threading.Event()
        self.preloaded = threading.Event()  # nothing left to import (after the last Preload)
        self.importing: str | None = None  # what it imports now, by its last word
        self.modules = 0  # how many it holds, by its last Preloaded
        self.unsafe: tuple[str, str] | None = None  # (module, reason): it forks no more
        self.hung = False
        self.retired = False  # replaced: closed once its last rank is released
        self.process: subprocess.Popen[bytes] | ForkedProcess
        if forked is not None:
            self._conn = Connection(forked[0])
            self.process = ForkedProcess(forked[1])
        else:
            self._conn, self.process = self._start(exclude)
        threading.Thread(target=self._read, name="nbddp-helper", daemon=True).start()

    @staticmethod
    def _start(exclude: Iterable[str]) -> tuple[Connection, subprocess.Popen[bytes]]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**without_launchers(os.environ), WORKER_VARIABLE: "helper", "PYTHONUNBUFFERED": "1"}
        env[EXCLUDE_VARIABLE] = ",".join(sorted(user_excluded() | set(exclude)))
        # torch.cuda.is_available() asks NVML, not the CUDA driver, when a module calls it at
        # import: the driver, once started, would make the helper unsafe to fork (a rank reads
        # its own environment again)
        env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from nbddp.worker.helper.server import serve; serve()",
                str(theirs.fileno()),
            ],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        return Connection(ours), process

    def alive(self) -> bool:
        return not self.dead.is_set() and self.process.poll() is None

    def crashed(self) -> bool:
        """It ended by itself (a fault, an exit), not killed from outside (SIGKILL: the OOM
        killer, a user) nor by the kernel."""
        if not self.dead.is_set() or self.retired:
            return False
        try:  # its socket closes as it exits, a moment before it can be reaped
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return False
        return code != -signal.SIGKILL

    def usable(self) -> bool:
        """Alive, and fit for the next launch."""
        return self.alive() and self.unsafe is None and not self.hung and not self.retired

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv().message
                self._heard = time.monotonic()
                match message:
                    case Ready():
                        self.ready.set()
                    case Exited(pid=pid, code=code):
                        rank = self._ranks.get(pid)
                        if rank is not None:
                            rank.exited(code)
                    case Spawned() | SpawnFailed():
                        self._answer(message)
                    case Preloading(module=module):
                        self.importing = module
                    case Preloaded(modules=modules):
                        self.importing, self.modules = None, modules
                        self.preloaded.set()
                    case Unsafe(module=module, reason=reason):
                        self.unsafe = (module, reason)
                with self._changed:
                    self._changed.notify_all()  # a waiting launch hears the progress
        except (EOFError, OSError):
            pass
        self.dead.set()
        self.preloaded.set()
        with self._changed:
            self._changed.notify_all()
        for rank in list(self._ranks.values()):  # PR_SET_PDEATHSIG took them along
            rank.exited(-signal.SIGKILL)

    def _answer(self, reply: Spawned | SpawnFailed) -> None:
        """On the reader thread, so a rank is known before its exit report is read."""
        with self._changed:
            if reply.request in self._waiting:
                answer: WarmProcess | str = (
                    reply.reason
                    if isinstance(reply, SpawnFailed)
                    else "detached"
                    if reply.request in self._detached
                    else self._track(reply.pid)
                )
                self._replies[reply.request] = answer
                return
        if isinstance(reply, Spawned) and reply.request not in self._detached:
            self._abandon(reply.pid)  # its caller gave up (interrupt, timeout): end it now

    def _track(self, pid: int) -> WarmProcess:
        rank = WarmProcess(self, pid)
        self._ranks[pid] = rank
        return rank

    def _abandon(self, pid: int) -> None:
        signal_group(pid, signal.SIGKILL)
        rank = self._ranks.get(pid)
        if rank is not None:
            rank.release()
        else:
            self.release(pid)

    def preload(self, modules: list[str], sys_path: list[str], exclude: list[str]) -> None:
        """Ask the helper to import ``modules`` before the next launch's ranks start."""
        self.preloaded.clear()
        self._conn.send(Preload(modules, sys_path, exclude))

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> WarmProcess:
        request = next(self._requests)
        with self._changed:
            self._waiting.add(request)
            self._heard = max(self._heard, time.monotonic())
        answer: WarmProcess | str | None = None
        try:
            self._conn.send(Spawn(request, argv, env), fds=[stdout, stderr])
            with self._changed:
                while request not in self._replies and not self.dead.is_set():
                    wait = REPLY_WAIT if self.importing is None else IMPORT_WAIT
                    silence = self._heard + wait - time.monotonic()
                    if silence <= 0:
                        self.hung = True
                        break
                    self._changed.wait(silence)
                answer = self._replies.pop(request, None)
            if isinstance(answer, WarmProcess):
                return answer
        finally:
            with self._changed:
                self._waiting.discard(request)
                late = self._replies.pop(request, None)  # answered as we were interrupted
            if isinstance(late, WarmProcess):
                self._abandon(late.pid)
        if answer is None:
            raise OSError(
                "the warm helper " + ("is gone" if self.dead.is_set() else "did not answer")
            )
        raise OSError(f"the warm helper could not fork a rank: {answer}")

    def spawn_detached(self, argv: list[str], env: dict[str, str], fds: list[int]) -> None:
        """Fork a detached run's supervisor (``worker/helper/leaving.py``); ``fds``: its stdout,
        stderr and link. Raises OSError when the helper cannot."""
        request = next(self._requests)
        with self._changed:
            self._waiting.add(request)
            self._detached.add(request)
        try:
            self._conn.send(Spawn(request, argv, env, detached=True), fds=fds)
            with self._changed:
                self._changed.wait_for(
                    lambda: request in self._replies or self.dead.is_set(), REPLY_WAIT
                )
                answer = self._replies.pop(request, None)
        finally:
            with self._changed:
                self._waiting.discard(request)
                self._detached.discard(request)
        if answer != "detached":
            raise OSError(
                "the warm helper could not fork the supervisor: "
                + (str(answer) if answer is not None else "it did not answer")
            )

    def release(self, pid: int) -> None:
        self._ranks.pop(pid, None)
        with contextlib.suppress(OSError):
            self._conn.send(Release(pid))
        if self.retired and not self._ranks:
            self.close()

    def retire(self) -> None:
        """Replaced: end it now if no rank of it runs, else once the last one is released."""
        self.retired = True
        if not self._ranks:
            self.close()

    def close(self) -> None:
        """End the helper (its ranks are the supervisor's business) and reap it."""
        self.dead.set()
        self._conn.close()
        try:
            self.process.wait(timeout=0 if self.hung else 5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
