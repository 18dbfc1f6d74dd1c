"""Pre-warmed ranks, the kernel's side: launch as fast as a fork, with spawn's safety.

A helper process is started from a fresh interpreter (never a fork of the kernel). It imports
torch and the rank runtime, never touches CUDA, and forks one brand-new rank per request
(its server half is ``worker/forkserver.py``). Each rank is a fresh child: nothing of a
previous launch is in it (module state, process group, CUDA context), and it reseeds every
random generator, so it differs from a cold start only in not paying ``import torch``.

* The kernel talks to the helper over an inherited socketpair (nobody else can connect), with
  the framing of ``transport.py``; a rank's stdout/stderr pipe ends ride on its request.
* Requests carry an id. A request whose caller gave up (an interrupt, a timeout) leaves no
  stale reply behind: the reply is matched to nobody, and the rank it names is killed.
* The helper reports each rank's exit without reaping it (``WNOWAIT``): the pid stays the
  kernel's to signal until the kernel releases it. The report, not the pid, wakes the
  supervisor (a rank's ``sentinel``), so the exit code is known whenever it looks.
* It goes away with the kernel: when the kernel's end of the socket closes (exit, restart,
  SIGKILL), the helper exits, and its ranks with it (``PR_SET_PDEATHSIG``). If it dies, the
  next launch starts cold and a new helper.
* ``NBDDP_PREWARM=0`` turns it off (every launch starts cold).

Why not the stdlib's ``multiprocessing.forkserver``: its children inherit the server's
stdout/stderr (we need a pipe pair per rank), it cannot run a script as ``__main__``, and it
reaps its children (we need their status without reaping, so signalling a pid stays safe).

Non-goal: sharing anything between launches beyond the imported, unused modules.
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

from nbddp import interrupts
from nbddp.environment import WORKER_VARIABLE, without_launchers
from nbddp.local.processes import ColdStarter, Starter, WorkerProcess
from nbddp.local.processes import signal_group as _signal_group
from nbddp.wire.frames import Connection
from nbddp.wire.helper import Exited, Ready, Release, Spawn, Spawned, SpawnFailed

READY_WAIT = 10.0  # seconds a launch waits for a starting helper before starting cold
_REPLY_WAIT = 10.0


def enabled() -> bool:
    return os.environ.get("NBDDP_PREWARM", "1") != "0" and WORKER_VARIABLE not in os.environ


class _WarmProcess:
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
        _signal_group(self.pid, signum)

    def release(self) -> None:
        self._helper.release(self.pid)
        for fd in (self.sentinel, self._reported):
            with contextlib.suppress(OSError):
                os.close(fd)


class Helper:
    """The kernel's handle on the helper process: start it, fork ranks, notice its death."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn = Connection(ours)
        self._requests = itertools.count(1)
        self._replies: dict[int, _WarmProcess | str] = {}  # a rank, or why it failed
        self._waiting: set[int] = set()  # requests whose caller still waits
        self._changed = threading.Condition()
        self._ranks: dict[int, _WarmProcess] = {}
        self.ready = threading.Event()
        self.dead = threading.Event()
        env = {**without_launchers(os.environ), WORKER_VARIABLE: "helper", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from nbddp.worker.forkserver import serve; serve()",
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
        threading.Thread(target=self._read, name="nbddp-helper", daemon=True).start()

    def alive(self) -> bool:
        return not self.dead.is_set() and self.process.poll() is None

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv().message
                match message:
                    case Ready():
                        self.ready.set()
                    case Exited(pid=pid, code=code):
                        rank = self._ranks.get(pid)
                        if rank is not None:
                            rank.exited(code)
                    case Spawned() | SpawnFailed():
                        self._answer(message)
        except (EOFError, OSError):
            pass
        self.dead.set()
        with self._changed:
            self._changed.notify_all()
        for rank in list(self._ranks.values()):  # PR_SET_PDEATHSIG took them along
            rank.exited(-signal.SIGKILL)

    def _answer(self, reply: Spawned | SpawnFailed) -> None:
        """On the reader thread, so a rank is known before its exit report is read."""
        with self._changed:
            if reply.request in self._waiting:
                answer: _WarmProcess | str = (
                    reply.reason if isinstance(reply, SpawnFailed) else self._track(reply.pid)
                )
                self._replies[reply.request] = answer
                self._changed.notify_all()
                return
        if isinstance(reply, Spawned):  # its caller gave up (interrupt, timeout): end it now
            self._abandon(reply.pid)

    def _track(self, pid: int) -> _WarmProcess:
        rank = _WarmProcess(self, pid)
        self._ranks[pid] = rank
        return rank

    def _abandon(self, pid: int) -> None:
        _signal_group(pid, signal.SIGKILL)
        rank = self._ranks.get(pid)
        if rank is not None:
            rank.release()
        else:
            self.release(pid)

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> _WarmProcess:
        request = next(self._requests)
        with self._changed:
            self._waiting.add(request)
        answer: _WarmProcess | str | None = None
        try:
            self._conn.send(Spawn(request, argv, env), fds=[stdout, stderr])
            with self._changed:
                self._changed.wait_for(
                    lambda: request in self._replies or self.dead.is_set(), _REPLY_WAIT
                )
                answer = self._replies.pop(request, None)
            if isinstance(answer, _WarmProcess):
                return answer
        finally:
            with self._changed:
                self._waiting.discard(request)
                late = self._replies.pop(request, None)  # answered as we were interrupted
            if isinstance(late, _WarmProcess):
                self._abandon(late.pid)
        if answer is None:
            raise OSError(
                "the warm helper " + ("is gone" if self.dead.is_set() else "did not answer")
            )
        raise OSError(f"the warm helper could not fork a rank: {answer}")

    def release(self, pid: int) -> None:
        self._ranks.pop(pid, None)
        with contextlib.suppress(OSError):
            self._conn.send(Release(pid))

    def close(self) -> None:
        """End the helper (its ranks are the supervisor's business) and reap it."""
        self.dead.set()
        self._conn.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class WarmStarter:
    """Starts ranks through the helper when it is ready, cold otherwise."""

    def __init__(self) -> None:
        self._cold = ColdStarter()
        self._helper: Helper | None = None
        self._lock = threading.Lock()

    def prestart(self) -> None:
        """Start the helper in the background (cheap: one Popen)."""
        with interrupts.deferred(), self._lock:  # a helper is owned, or not started
            if self._helper is None or not self._helper.alive():
                if self._helper is not None:
                    self._helper.close()
                self._helper = Helper()

    @property
    def helper(self) -> Helper | None:
        return self._helper

    def warm_up(self) -> None:
        """Start the helper if there is none (the first launch of a script, or after it died)
        and wait for it: it imports torch once, about what one cold rank costs."""
        with contextlib.suppress(OSError):
            self.prestart()
        helper = self._helper
        if helper is not None:
            helper.ready.wait(READY_WAIT)

    def start(
        self, argv: list[str], env: dict[str, str], stdout: int, stderr: int
    ) -> WorkerProcess:
        helper = self._helper
        if helper is None or not helper.alive() or not helper.ready.is_set():
            return self._cold.start(argv, env, stdout, stderr)  # warm_up() waited already
        try:
            return helper.spawn(argv, env, stdout, stderr)
        except OSError:
            self.prestart()
            return self._cold.start(argv, env, stdout, stderr)


_starter: WarmStarter | None = None


def warm_starter() -> WarmStarter:
    global _starter
    if _starter is None:
        _starter = WarmStarter()
    return _starter


def default_starter() -> Starter:
    """The pre-warmed starter unless NBDDP_PREWARM=0; it starts cold by itself whenever its
    helper is not there or not ready."""
    return warm_starter() if enabled() else ColdStarter()


def prestart() -> None:
    """Get the helper going now, so the first launch is fast already (a no-op when the
    pre-warmed start is turned off)."""
    if enabled():
        with contextlib.suppress(OSError):  # then launches start cold; nothing else changes
            warm_starter().prestart()


def helper_pid() -> int | None:
    """The helper's pid, if one runs (tests and diagnostics)."""
    helper = _starter.helper if _starter is not None else None
    return helper.process.pid if helper is not None and helper.alive() else None


def wait_until_ready(timeout: float = 30.0) -> bool:
    helper = _starter.helper if _starter is not None else None
    deadline = time.monotonic() + timeout
    return helper is not None and helper.ready.wait(max(0.0, deadline - time.monotonic()))
