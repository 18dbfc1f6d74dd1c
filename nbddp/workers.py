"""Start one process per rank, supervise them all-or-nothing, and leave nothing behind.

* :class:`ColdStarter` starts each rank as a fresh interpreter (``sys.executable``) running a
  temporary script whose body sits under ``if __name__ == "__main__":``; never a fork of the
  kernel. It is the one component that creates worker processes, so a pre-warmed starter can
  take its place without the supervisor noticing.
* :class:`WorkerGroup` owns a run's private directory, channel, processes and output. It
  watches every process exit (pidfds) and every channel message in one loop, so a rank that
  dies is noticed at once, not after a collective's timeout; the first failure ends the run.
* Teardown is the same for every ending: SIGTERM to each worker's process group (a worker leads
  its own session, so DataLoader workers go too), SIGKILL after a grace period, reap, close,
  remove the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, TextIO

from . import payload
from .channel import KernelChannel
from .display.state import RunState
from .errors import LaunchTimeout, NbddpError, SerializationError, WorkerError
from .output import OutputPump
from .plan import LaunchPlan

TERM_GRACE = 2.0  # seconds between SIGTERM and SIGKILL
# After the first failure, how long to wait for the other ranks' news before choosing the root
# cause: a rank that dies closes its sockets before it can be seen to exit, so a peer's
# "Connection closed by peer" report can reach the kernel before the death that caused it.
SETTLE = 0.5
_DIR_PREFIX = "nbddp-"
_SCRIPT = '''\
# Written by nbddp for one run and removed when it ends.
if __name__ == "__main__":
    import sys

    sys.path.append({package_parent!r})
    from nbddp.worker.entry import main

    sys.exit(main({job_dir!r}))
'''


# -- starting processes ---------------------------------------------------------------------


class WorkerProcess(Protocol):
    """One started rank, as the supervisor sees it."""

    pid: int
    sentinel: int  # a file descriptor that becomes readable when the process has ended

    def exitcode(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while running."""

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker and every process it started."""

    def release(self) -> None:
        """Reap the ended process and free what tracks it."""


class Starter(Protocol):
    def start(
        self, argv: list[str], env: dict[str, str], stdout: int, stderr: int
    ) -> WorkerProcess:
        """Start one worker with these pipe ends as its stdout/stderr."""


def signal_group(leader: int, signum: int) -> None:
    """Signal a worker's whole process group (it leads its own session); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signum)


class _ColdProcess:
    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid)
        self._code: int | None = None

    def exitcode(self) -> int | None:
        if self._code is None:
            # WNOWAIT: look without reaping, so the pid (our process group id) stays ours
            # until release(), and signal_group() can never hit a recycled pid.
            result = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if result is not None and result.si_pid == self.pid:
                exited = result.si_code == os.CLD_EXITED
                self._code = result.si_status if exited else -result.si_status
        return self._code

    def signal_group(self, signum: int) -> None:
        signal_group(self.pid, signum)

    def release(self) -> None:
        self._popen.wait()
        os.close(self.sentinel)


class ColdStarter:
    """A brand-new interpreter per rank: ~1-2 s of ``import torch`` each, nothing inherited."""

    def start(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> _ColdProcess:
        popen = subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            close_fds=True,
        )
        return _ColdProcess(popen)


def default_starter() -> Starter:
    """The pre-warmed starter (``warm.py``) unless NBDDP_PREWARM=0; it starts cold by itself
    whenever its helper is not there or not ready."""
    from . import warm

    if not warm.enabled():
        return ColdStarter()
    return warm.starter(ColdStarter())


# -- the run's private directory -------------------------------------------------------------


def make_private_dir() -> str:
    """A 0700 directory named after the kernel's pid, so leftovers of a killed kernel can be
    recognised and swept by the next launch."""
    sweep_stale_dirs()
    return tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")


def sweep_stale_dirs() -> None:
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(_DIR_PREFIX):
            continue
        try:
            owner = int(name[len(_DIR_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if owner != os.getpid() and not _alive(owner):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# -- the environment each rank sees ----------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(plan: LaunchPlan, rank: int, port: int, run_id: str) -> dict[str, str]:
    """The kernel's environment plus what torchrun would set, plus the user's ``env=``."""
    env = dict(os.environ)
    n = plan.world_size
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "ROLE_WORLD_SIZE": str(n),
        "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        # Lightning and Accelerate recognise a torchrun launch by these.
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "PYTHONUNBUFFERED": "1",
        "NBDDP_WORKER": str(rank),  # importing nbddp in a worker starts no helper
    })
    if "OMP_NUM_THREADS" not in os.environ:  # split the cores instead of oversubscribing them
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        env["OMP_NUM_THREADS"] = str(max(1, (cores or 1) // n))
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        env["MPLBACKEND"] = "Agg"  # the notebook's inline backend means nothing in a worker
    if plan.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(_physical_gpus(plan.gpus))
    env.update(plan.env)
    return env


def _physical_gpus(gpus: tuple[int, ...]) -> list[str]:
    """The kernel's GPU indices, translated through its own CUDA_VISIBLE_DEVICES, deduplicated."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",")] if visible else None
    unique = list(dict.fromkeys(gpus))
    return [names[i] if names else str(i) for i in unique]


def device_indices(gpus: tuple[int, ...]) -> list[int]:
    """Each rank's cuda index inside its worker (its GPU's place among the selected ones)."""
    unique = list(dict.fromkeys(gpus))
    return [unique.index(g) for g in gpus]


# -- supervision ---------------------------------------------------------------------------


@dataclass
class _Failure:
    time: float
    error: BaseException
    silent: bool = False  # the rank ended without a report: no traceback, or no result


_PEER_LOST = (  # what gloo and NCCL say in a rank whose peer went away
    "closed by peer", "reset by peer", "broken pipe", "remote process exited",
    "communicator was aborted", "distnetworkerror",
)


def _lost_a_peer(error: BaseException) -> bool:
    if not isinstance(error, WorkerError):
        return False
    text = f"{error.exc_type} {error.exc_message}".lower()
    return any(words in text for words in _PEER_LOST)


class WorkerGroup:
    """One run's processes from start to teardown; calls ``on_finish(status, value, error)``
    exactly once, after the teardown."""

    def __init__(self, plan: LaunchPlan, call: bytes, state: RunState,
                 on_finish: Callable[[str, Any, BaseException | None], None],
                 output: TextIO | None = None, starter: Starter | None = None) -> None:
        self.plan = plan
        self._call = call
        self._state = state
        self._on_finish = on_finish
        self._starter = starter or default_starter()
        self._workers: list[WorkerProcess] = []
        self._conns: dict[Connection, int] = {}
        self._conn_lock = threading.Lock()
        self._results: dict[int, tuple[bytes, list[bytearray]] | None] = {}
        self._failures: list[_Failure] = []
        self._stop_requested = False
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()
        self._wake_closed = False
        self._finished = threading.Event()
        self._dir = ""
        self._channel: KernelChannel | None = None
        self._pump = OutputPump(plan.output, output)
        self._hello: set[int] = set()
        self._monitor: threading.Thread | None = None

    # lifecycle

    def start(self) -> None:
        """Write the job, start every rank and the supervisor. Cleans up if anything fails."""
        try:
            self._dir = make_private_dir()
            self._channel = KernelChannel(self._dir, self._on_connect)
            self._write_job()
            port = free_port()
            run_id = f"nbddp-{os.getpid()}-{os.path.basename(self._dir)}"
            argv = [os.path.join(self._dir, "launch.py")]
            for rank in range(self.plan.world_size):
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                try:
                    env = worker_env(self.plan, rank, port, run_id)
                    self._workers.append(self._starter.start(argv, env, out_w, err_w))
                finally:
                    os.close(out_w)
                    os.close(err_w)
                self._pump.add(rank, out_r, err_r)
        except BaseException:
            self._teardown()
            raise
        self._pump.start()
        self._monitor = threading.Thread(target=self._supervise, name="nbddp-monitor", daemon=True)
        self._monitor.start()

    def stop(self) -> None:
        """Ask the supervisor to end the run; it tears down and reports "stopped"."""
        self._stop_requested = True
        self._wake()

    # internals

    def _write_job(self) -> None:
        plan = self.plan
        spec = {
            "address": self._channel.address,
            "authkey": self._channel.authkey.hex(),
            "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
            "cwd": os.getcwd(),
            "device": plan.device,
            "device_index": device_indices(plan.gpus),
            "backend": plan.backend,
            "return_all": plan.return_all,
        }
        job = payload._dumps({"sources": payload.notebook_sources(), "call": self._call})
        _write_private(os.path.join(self._dir, "spec.json"), json.dumps(spec).encode())
        _write_private(os.path.join(self._dir, "job.pkl"), job)
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        script = _SCRIPT.format(package_parent=package_parent, job_dir=self._dir)
        _write_private(os.path.join(self._dir, "launch.py"), script.encode())

    def _on_connect(self, rank: int, conn: Connection) -> None:
        with self._conn_lock:
            self._conns[conn] = rank
            self._hello.add(rank)
            if len(self._hello) == self.plan.world_size:
                self._state.set_running()
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_closed:
                os.write(self._wake_w, b"x")

    def _supervise(self) -> None:
        status, value, error = "failed", None, None
        try:
            status, value, error = self._watch()
        except BaseException as exc:  # a bug of ours must still end the run cleanly
            error = NbddpError(f"nbddp's supervisor failed: {exc!r}")
        finally:
            self._teardown()
            self._finished.set()
            self._on_finish(status, value, error)

    def _watch(self) -> tuple[str, Any, BaseException | None]:
        plan = self.plan
        deadline = time.monotonic() + plan.timeout if plan.timeout else None
        exited: set[int] = set()
        sentinels = {w.sentinel: rank for rank, w in enumerate(self._workers)}
        settled: float | None = None  # when to stop waiting for more failures
        while True:
            with self._conn_lock:
                conns = list(self._conns)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if settled is not None:
                until_settled = max(0.0, settled - time.monotonic())
                remaining = until_settled if remaining is None else min(remaining, until_settled)
            ready = wait([self._wake_r, *conns, *(s for s, r in sentinels.items()
                                                  if r not in exited)], timeout=remaining)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            for conn in conns:
                if conn in ready:
                    self._drain(conn)
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank not in exited:
                    exited.add(rank)
                    self._on_exit(rank)
            if self._failures:
                settled = settled or time.monotonic() + SETTLE
                everyone = len(exited | self._failed_ranks()) == plan.world_size
                if everyone or time.monotonic() >= settled:
                    return "failed", None, self._root_cause().error
                continue  # a failure is decided: only the choice of root cause is left
            if self._stop_requested:
                return "stopped", None, None
            if len(exited) == plan.world_size:
                return self._collect()
            if deadline is not None and time.monotonic() >= deadline:
                return "failed", None, LaunchTimeout(plan.timeout)

    def _failed_ranks(self) -> set[int]:
        return {f.error.rank for f in self._failures if isinstance(f.error, WorkerError)}

    def _root_cause(self) -> _Failure:
        """The earliest failure, leaving out peers' "lost a peer" errors when a rank died
        silently: those errors are about that death, however early they reached us."""
        failures = self._failures
        if any(f.silent for f in failures):
            failures = [f for f in failures if f.silent or not _lost_a_peer(f.error)]
        return min(failures, key=lambda f: f.time)

    def _drain(self, conn: Connection) -> None:
        """Read every message waiting on ``conn``; forget it at EOF."""
        try:
            while conn.poll():
                self._handle(conn.recv(), conn)
        except (EOFError, OSError):
            with self._conn_lock:
                self._conns.pop(conn, None)
            conn.close()

    def _handle(self, message: tuple, conn: Connection) -> None:
        kind, rank = message[0], message[1]
        if kind == "log":
            first, rows = message[2]
            self._state.add_rows(rank, first, rows)
        elif kind == "progress":
            self._state.set_bars(message[2])
        elif kind == "device":
            self._state.device_name = message[2]
        elif kind == "result":
            stream, sizes = message[2], message[3]
            buffers = [bytearray(size) for size in sizes]
            for buffer in buffers:  # straight from the socket into the tensors' future memory
                conn.recv_bytes_into(buffer)
            self._results[rank] = None if stream is None else (stream, buffers)
        elif kind == "error":
            self._failures.append(_Failure(message[2]["time"], _rebuild_error(rank, message[2])))
        elif kind == "unsendable":
            what = f"rank {rank}'s return value back to the notebook"
            self._failures.append(_Failure(time.time(), SerializationError(
                what, message[2], message[3],
                hint="Return something picklable instead: tensors, numbers, a state_dict().",
            )))

    def _on_exit(self, rank: int) -> None:
        for conn, conn_rank in list(self._conns.items()):
            if conn_rank == rank:  # its last words may still sit in the socket
                self._drain(conn)
        code = self._workers[rank].exitcode()
        reported = rank in self._results or rank in self._failed_ranks()
        if code != 0 and not reported:
            self._failures.append(_Failure(time.time(), self._crash_error(rank, code), True))
        elif code == 0 and rank not in self._results:
            self._failures.append(_Failure(time.time(), WorkerError(rank, exitcode=0), True))

    def _crash_error(self, rank: int, code: int | None) -> WorkerError:
        self._pump.wait_closed(rank, timeout=0.5)  # let its last words reach the tail
        tail = self._pump.stderr_tail(rank)
        return WorkerError(
            rank, exitcode=code,
            remote_traceback=f"last lines of rank {rank}'s stderr:\n{tail}" if tail.strip() else "",
        )

    def _collect(self) -> tuple[str, Any, BaseException | None]:
        try:
            if self.plan.return_all:
                value = [payload.loads(*self._results[r]) for r in range(self.plan.world_size)]
            else:
                value = payload.loads(*self._results[0])
        except Exception as exc:
            return "failed", None, NbddpError(
                f"the return value arrived but cannot be rebuilt in the notebook ({exc!r}); "
                "is a module it needs importable in the kernel?"
            )
        return "succeeded", value, None

    def _teardown(self) -> None:
        """Same path for every ending: TERM, grace, KILL, reap, close, remove."""
        alive = [w for w in self._workers if w.exitcode() is None]
        for worker in alive:
            worker.signal_group(signal.SIGTERM)
        give_up = time.monotonic() + TERM_GRACE
        while alive and time.monotonic() < give_up:
            wait([w.sentinel for w in alive], timeout=give_up - time.monotonic())
            alive = [w for w in alive if w.exitcode() is None]
        for worker in self._workers:  # the leader and anything it left in its group
            worker.signal_group(signal.SIGKILL)
        for worker in self._workers:
            worker.release()
        self._pump.join(timeout=2.0)
        with self._conn_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        if self._channel is not None:
            self._channel.close()
        with self._wake_lock:
            self._wake_closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def _rebuild_error(rank: int, report: dict[str, Any]) -> WorkerError:
    error = WorkerError(
        rank, exc_type=report["exc_type"], exc_message=report["message"],
        remote_traceback=report["traceback"],
    )
    if report["exception"] is not None:
        try:
            cause = payload.loads(report["exception"])
        except Exception:
            cause = None  # e.g. its class lives in a module the kernel cannot import
        if isinstance(cause, BaseException):
            error.__cause__ = cause
    return error
