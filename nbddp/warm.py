"""Pre-warmed workers: launch as fast as fork, with spawn's safety.

A helper process is started from a fresh interpreter (never a fork of the kernel) as soon as
nbddp is imported. It imports torch and the worker runtime, never touches CUDA, and then
forks one brand-new worker per rank on request. Each worker is a fresh child: nothing of a
previous launch is in it (module state, process group, CUDA context), and it reseeds every
random generator, so it differs from a cold start only in not paying ``import torch``.

* The kernel talks to the helper over an inherited socketpair (nobody else can connect);
  each worker's stdout/stderr pipe ends travel with the request (``SCM_RIGHTS``).
* The helper reports each worker's exit status without reaping it (``WNOWAIT``), so the pid
  stays the kernel's to signal until the kernel releases it.
* It goes away with the kernel: when the kernel's end of the socket closes (exit, restart,
  SIGKILL), the helper exits. If it dies, the next launch starts cold and a new helper.
* ``NBDDP_PREWARM=0`` turns it off (every launch starts cold).

Non-goal: sharing anything between launches beyond the imported, unused modules.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

READY_WAIT = 3.0  # seconds a launch waits for a starting helper before starting cold
_EXIT_REPORT_WAIT = 2.0


def enabled() -> bool:
    return os.environ.get("NBDDP_PREWARM", "1") != "0" and "NBDDP_WORKER" not in os.environ


# -- the kernel side ------------------------------------------------------------------------


class _WarmProcess:
    """A worker forked by the helper, seen from the kernel."""

    def __init__(self, helper: Helper, pid: int) -> None:
        self._helper = helper
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)  # readable once it exits, child of ours or not
        self.code: int | None = None
        self.reported = threading.Event()

    def exitcode(self) -> int | None:
        if self.code is None:
            ready, _, _ = select.select([self.sentinel], [], [], 0)
            if ready:  # it has exited: its status is on its way from the helper
                self.reported.wait(_EXIT_REPORT_WAIT)
                if self.code is None and not self._helper.alive():
                    self.code = -signal.SIGKILL  # helper gone: status unknown, but it ended
        return self.code

    def signal_group(self, signum: int) -> None:
        from .workers import signal_group  # not at the top: the helper never needs workers.py

        signal_group(self.pid, signum)

    def release(self) -> None:
        self._helper.release(self.pid)
        os.close(self.sentinel)


class Helper:
    """The kernel's handle on the helper process: start, spawn workers, notice its death."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket = ours
        self._conn = Connection(os.dup(ours.fileno()))
        self._lock = threading.Lock()  # one request at a time
        self._replies: list[Any] = []
        self._reply = threading.Condition()
        self._workers: dict[int, _WarmProcess] = {}
        self.ready = threading.Event()
        self.dead = threading.Event()
        env = {**os.environ, "NBDDP_WORKER": "helper", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from nbddp.warm import serve; serve()", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        theirs.close()
        threading.Thread(target=self._read, name="nbddp-helper", daemon=True).start()

    def alive(self) -> bool:
        return not self.dead.is_set() and self.process.poll() is None

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "ready":
                    self.ready.set()
                elif message[0] == "exit":
                    worker = self._workers.get(message[1])
                    if worker is not None:
                        worker.code = message[2]
                        worker.reported.set()
                else:
                    with self._reply:
                        self._replies.append(message)
                        self._reply.notify_all()
        except (EOFError, OSError):
            pass
        self.dead.set()
        with self._reply:
            self._reply.notify_all()
        for worker in list(self._workers.values()):
            worker.reported.set()

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> _WarmProcess:
        with self._lock:
            self._conn.send(("spawn", argv, env))
            socket.send_fds(self._socket, [b"f"], [stdout, stderr])
            with self._reply:
                if not self._reply.wait_for(lambda: self._replies or self.dead.is_set(), 10):
                    raise OSError("the warm helper did not answer")
                if not self._replies:
                    raise OSError("the warm helper is gone")
                kind, value = self._replies.pop(0)
            if kind != "spawned":
                raise OSError(f"the warm helper could not fork a worker: {value}")
            worker = _WarmProcess(self, value)
            self._workers[value] = worker
            return worker

    def release(self, pid: int) -> None:
        self._workers.pop(pid, None)
        with contextlib.suppress(OSError), self._lock:
            self._conn.send(("release", pid))

    def close(self) -> None:
        """End the helper (its workers are the supervisor's business) and reap it."""
        self.dead.set()
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        self._conn.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class WarmStarter:
    """Starts workers through the helper when it is ready, cold otherwise."""

    def __init__(self, cold: Any) -> None:
        self._cold = cold
        self._helper: Helper | None = None
        self._lock = threading.Lock()

    def prestart(self) -> None:
        """Start the helper in the background (cheap: one Popen)."""
        with self._lock:
            if self._helper is None or not self._helper.alive():
                if self._helper is not None:
                    self._helper.close()
                self._helper = Helper()

    @property
    def helper(self) -> Helper | None:
        return self._helper

    def start(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> Any:
        helper = self._helper
        if helper is None or not helper.alive():
            self.prestart()  # a new helper for the next launch; this one starts cold
            return self._cold.start(argv, env, stdout, stderr)
        if not helper.ready.wait(READY_WAIT):
            return self._cold.start(argv, env, stdout, stderr)
        try:
            return helper.spawn(argv, env, stdout, stderr)
        except OSError:
            self.prestart()
            return self._cold.start(argv, env, stdout, stderr)

    def shutdown(self) -> None:
        with self._lock:
            if self._helper is not None:
                self._helper.close()
                self._helper = None


# -- the helper process -----------------------------------------------------------------------


def serve() -> None:
    """The helper's main loop: import, announce readiness, fork workers on request."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    conn = Connection(os.dup(sock.fileno()))
    import torch  # noqa: F401 - the point of the helper: imported once, used by every worker

    import nbddp.worker.entry  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, bool] = {}  # pid -> exit reported
    conn.send(("ready",))
    while True:
        readable, _, _ = select.select([conn, wake_r], [], [], 1.0)
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        for pid, reported in list(children.items()):
            if not reported:
                status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if status is not None and status.si_pid == pid:
                    exited = status.si_code == os.CLD_EXITED
                    children[pid] = True
                    _send(conn, ("exit", pid, status.si_status if exited else -status.si_status))
        if conn not in readable:
            continue
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the kernel is gone: so are we (workers watch the kernel themselves)
        if message[0] == "spawn":
            _, argv, env = message
            _, fds, _, _ = socket.recv_fds(sock, 1, 2)
            try:
                pid = _fork_worker(argv, env, fds, [sock.fileno(), conn.fileno(), wake_r, wake_w])
            except OSError as exc:
                _send(conn, ("failed", repr(exc)))
            else:
                children[pid] = False
                _send(conn, ("spawned", pid))
            finally:
                for fd in fds:
                    os.close(fd)
        elif message[0] == "release":
            pid = message[1]
            if children.pop(pid, None) is not None:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def _send(conn: Connection, message: tuple) -> None:
    with contextlib.suppress(OSError):
        conn.send(message)


def _fork_worker(argv: list[str], env: dict[str, str], fds: list[int], ours: list[int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: become a fresh worker, then run the launch script as __main__
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in ours:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.environ.clear()
        os.environ.update(env)
        _reseed_and_thread(env)
        import runpy

        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
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


def _reseed_and_thread(env: dict[str, str]) -> None:
    """What a fresh interpreter would have: its own random state and thread count."""
    import random

    import torch

    random.seed()
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


_starter: WarmStarter | None = None


def starter(cold: Any) -> WarmStarter:
    global _starter
    if _starter is None:
        _starter = WarmStarter(cold)
    return _starter


def prestart(cold: Any) -> None:
    """Called when nbddp is imported: get the helper going unless it is turned off."""
    if enabled():
        starter(cold).prestart()


def helper_pid() -> int | None:
    """The helper's pid, if one runs (tests and diagnostics)."""
    helper = _starter.helper if _starter is not None else None
    return helper.process.pid if helper is not None and helper.alive() else None


def wait_until_ready(timeout: float = 30.0) -> bool:
    helper = _starter.helper if _starter is not None else None
    deadline = time.monotonic() + timeout
    return helper is not None and helper.ready.wait(max(0.0, deadline - time.monotonic()))

