"""A detached run's supervisor: the process that owns its ranks, outside the kernel's tree.

Forked from the kernel's pre-warmed helper (or started cold), it has left every process tree
before this code runs (``worker/helper/leaving.py``), and forked a helper of its own for its ranks.
It takes the launch from the kernel's link (the call, the kernel's working directory, path
and environment, and the run's held lock), runs it through the same backend as an attached
launch, with a :class:`~nbddp.detached.recorder.Recorder` as the run's events, and serves
kernels that attach (``link.py``) until the run ends. Then it records the end (and the
value), sends the attached kernels what is queued for them, and exits; its helper and every
rank are gone by then. If it is killed, its helper dies with it (parent-death signal) and the
ranks with the helper (on Ray it is a driver of its own, and the ranks' node helpers are its
actors, which Ray ends with their owner): nothing of the run is left running, and its lock
is free, which tells any later reader that nobody supervises the run any more.

SIGTERM stops the run (as ``Run.stop()`` does).

Non-goal: starting this process (``spawn.py``) or following it (``attached.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pickle
import select
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any

from nbddp.backend import Backend, Outcome
from nbddp.detached import store
from nbddp.detached.link import (
    Attached,
    Handoff,
    Launched,
    LaunchFailed,
    Outlet,
    StandingBy,
    StopRun,
)
from nbddp.detached.outcome import Ending, encode_error, write_value
from nbddp.detached.recorder import STATUS_EVERY, Recorder
from nbddp.environment import is_launcher_variable
from nbddp.local.forkserver import WarmStarter
from nbddp.local.helper import Helper
from nbddp.local.processes import ColdStarter, Starter
from nbddp.ranks import ranks_for
from nbddp.supervised import Supervised
from nbddp.wire import payload
from nbddp.wire.call import Call
from nbddp.wire.frames import Connection
from nbddp.wire.stacks import AskStacks
from nbddp.wire.transport import AuthenticationFailed, Listener, PendingHandshake

FLUSH_WAIT = 5.0  # seconds the attached kernels get for what is queued for them at the end
PROCESS_NAME = "nbddp-detached"  # what ps calls a supervisor (one standing by: STANDBY_NAME)
STANDBY_NAME = "nbddp-standby"
_SOCKET = "attach.sock"
_SUN_PATH = 100  # longest Unix socket path bound in the run directory (Linux: 107)


def main(link_fd: int, helper: tuple[socket.socket, int] | None) -> int:
    """A run on this machine: stand by on ``link_fd`` until the kernel hands one over (or
    goes: then nothing started, and this process ends)."""
    _name_process(STANDBY_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.umask(0o077)
    link = Connection(socket.socket(fileno=link_fd))
    try:
        link.send(StandingBy(os.getpid()))
        frame = link.recv()
    except (EOFError, OSError):
        return 0
    _name_process(PROCESS_NAME)
    handoff: Handoff = frame.message
    for fd in frame.fds:  # nothing this process starts may hold them (the lock above all)
        os.set_inheritable(fd, False)
    lock, *call_fds = frame.fds  # the lock stays open (held) for this process's life
    run = store.StoredRun(handoff.directory)
    _log_to(run.join("supervisor.log"))
    _take_the_kernels_place(handoff, keep=())
    starter: Starter = (
        WarmStarter(helper=Helper(forked=helper)) if helper else ColdStarter(die_with_starter=True)
    )
    layout = handoff.layout
    placed = list(zip(call_fds, layout.sizes, strict=True)) if layout is not None else []
    call = Call(handoff.stream, placed=placed, spans=layout.spans if layout else None)
    plan = handoff.plan
    if handoff.ray is not None:  # this process is a Ray driver of its own, owning the ranks
        plan = dataclasses.replace(plan, cluster=handoff.ray.connect())
    # the one path an attached launch takes: the same backend, with the record as its events
    backend = Supervised(plan, ranks_for(plan, call, starter=starter))
    supervisor = Supervisor(run, plan, backend, _unix_address(run))
    try:
        return supervisor.serve(link)
    finally:
        supervisor.close()
        if plan.cluster is not None:
            _leave_ray(plan.cluster)
        if isinstance(starter, WarmStarter) and starter.helper is not None:
            starter.helper.close()
        os.close(lock)


def _leave_ray(cluster: Any) -> None:
    """The run's reservation removed and this driver gone: Ray ends what it owns."""
    import ray

    with contextlib.suppress(Exception):
        cluster.release_reservations()
    with contextlib.suppress(Exception):
        ray.shutdown()


def _log_to(path: str) -> None:
    """This process's stdout and stderr into ``path`` (its helper, forked earlier, keeps the
    standby log)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def main_batch(directory: str) -> int:
    """A run on Slurm: this process is its batch job's script, on the job's first node."""
    from nbddp.clusters.slurm.allocation import current_allocation
    from nbddp.detached.batch import JOB, node_address

    _name_process(PROCESS_NAME)
    os.umask(0o077)
    run = store.StoredRun(directory)
    lock = os.open(run.join(store.LOCK), os.O_RDWR | os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # a shared filesystem may not lock: squeue tells then
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(run.join(JOB), "rb") as f:
        handoff, buffers = pickle.load(f)
    _take_the_kernels_place(handoff, keep=tuple(n for n in os.environ if is_launcher_variable(n)))
    plan = dataclasses.replace(handoff.plan, cluster=current_allocation())
    call = Call(handoff.stream, buffers=[memoryview(b) for b in buffers])
    backend = Supervised(plan, ranks_for(plan, call))  # the allocation's node helpers
    supervisor = Supervisor(run, plan, backend, f"tcp:{node_address()}:0")
    try:
        return supervisor.serve(None)
    finally:
        supervisor.close()
        os.close(lock)


def _unix_address(run: store.StoredRun) -> str:
    path = run.join(_SOCKET)
    if len(path) > _SUN_PATH:  # a deep runs directory: the socket goes to /tmp instead
        path = os.path.join(tempfile.mkdtemp(prefix=f"nbddp-attach-{run.id}-"), _SOCKET)
    return f"unix:{path}"


def _name_process(name: str) -> None:
    """What ``ps -o comm`` and ``top`` call this process (Linux ``PR_SET_NAME``)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)


def _take_the_kernels_place(handoff: Handoff, keep: tuple[str, ...]) -> None:
    """What the ranks inherit from the kernel at launch: its directory, path, environment
    (``keep``: this process's own variables that stay, a batch job's)."""
    with contextlib.suppress(OSError):
        os.chdir(handoff.cwd)
    sys.path[:] = [*handoff.sys_path, *(p for p in sys.path if p not in handoff.sys_path)]
    kept = {name: os.environ[name] for name in keep}
    os.environ.clear()
    os.environ.update({n: v for n, v in handoff.environ.items() if not is_launcher_variable(n)})
    os.environ.update(kept)
    payload.install_sources(handoff.sources)


class Supervisor:
    """Runs ``backend`` with the run's record as its events, and serves kernels attaching at
    ``address``, until the run ends."""

    def __init__(self, run: store.StoredRun, plan: Any, backend: Backend, address: str) -> None:
        self.run = run
        self.plan = plan
        self.recorder = Recorder(run, plan.world_size, plan.device, plan.backend)
        self.backend = backend
        self.recorder.tell = backend.tell  # the refusal of a rank's prompt
        self._address = address
        self._finished = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._stop_asked = False
        self._links = 0
        self._listener: Listener | None = None

    def serve(self, link: Connection | None) -> int:
        """Start the ranks, answer the launching kernel (``link``, if one waits), serve until
        the run ended."""
        self._listen()
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        try:
            self.backend.start(self.recorder, self._finish)
        except BaseException as exc:
            error = encode_error(exc)
            self._end(Ending("failed", error, None, (), self._duration(), False))
            if link is not None:
                with contextlib.suppress(OSError):
                    link.send(LaunchFailed(error))
            return 1
        if link is not None:
            self._attach(link, lambda offset: Launched(os.getpid(), offset))
        self._loop()
        return 0

    def stop(self) -> None:
        self._stop_asked = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"s")

    def _listen(self) -> None:
        self._listener = Listener(self._address, key=self.run.key())
        store.write_json(
            self.run.join(store.SUPERVISOR),
            {"pid": os.getpid(), "address": self._listener.address, "host": socket.gethostname()},
        )

    def _loop(self) -> None:
        """Accept kernels that attach until the run ended; keep status.json fresh."""
        assert self._listener is not None
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, "accept")
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._finished.is_set():
                for key, _ in selector.select(STATUS_EVERY):
                    if key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 64)
                    else:
                        pending = self._listener.accept()
                        if pending is not None:
                            self._start_thread(self._handshake, pending)
                if self._stop_asked:
                    self._stop_asked = False
                    self.backend.stop()
                self.recorder.write_status()
        finally:
            selector.close()

    def _start_thread(self, target: Any, *args: Any) -> None:
        self._links += 1
        threading.Thread(
            target=target, args=args, name=f"nbddp-link-{self._links}", daemon=True
        ).start()

    def _handshake(self, pending: PendingHandshake) -> None:
        """A kernel attaching: it must prove the run's key before anything else."""
        conn = None
        try:
            while conn is None:
                wait = pending.deadline - time.monotonic()
                if wait <= 0 or not select.select([pending], [], [], wait)[0]:
                    raise TimeoutError("the handshake took too long")
                with contextlib.suppress(BlockingIOError):
                    conn = pending.advance()
        except (AuthenticationFailed, EOFError, OSError):
            pending.close()
            return
        conn.sock.setblocking(True)
        self._attach(conn, lambda offset: Attached(os.getpid(), offset), thread=False)

    def _attach(self, conn: Connection, first: Any, thread: bool = True) -> None:
        outlet = Outlet(conn, f"nbddp-outlet-{self._links}")
        self.recorder.attach(outlet, first)
        if thread:
            self._start_thread(self._commands, outlet)
        else:
            self._commands(outlet)

    def _commands(self, outlet: Outlet) -> None:
        """What one attached kernel asks: a stop, a roll-call."""
        conn = outlet.conn
        while not outlet.gone.is_set():
            try:
                frame = conn.reader.read(conn.sock)
            except TimeoutError:
                continue
            except (EOFError, OSError):
                break
            if frame is None:
                continue
            message = frame.message
            if isinstance(message, StopRun) and message.graceful:
                self.backend.stop_gracefully(message.why)  # the ranks agree on a step
            elif isinstance(message, StopRun):
                self.stop()
            elif isinstance(message, AskStacks):
                ours = self.recorder.ask(outlet, message.query)
                self.backend.ask(AskStacks(ours, message.native))
        outlet.close(0)

    def _finish(self, outcome: Outcome) -> None:
        """The backend's end (on its thread): the value, then the end event."""
        has_value = False
        error = outcome.error
        status = outcome.status
        if error is None and (status == "succeeded" or outcome.value is not None):
            try:
                write_value(self.run.path, outcome.value)
                has_value = True
            except Exception as exc:
                error, status = exc, "failed"
        encoded = encode_error(error) if error is not None else None
        warnings = (outcome.warning, outcome.exit_warnings)
        ending = Ending(status, encoded, *warnings, self._duration(), has_value, outcome.graceful)
        self._end(ending)

    def _end(self, ending: Ending) -> None:
        self.recorder.end(ending)
        self._finished.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"e")

    def _duration(self) -> float:
        return max(0.0, time.time() - float(self.run.info.get("started", time.time())))

    def close(self) -> None:
        self.recorder.close(FLUSH_WAIT)
        if self._listener is not None:
            self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.run.join(store.SUPERVISOR))
        if self._address.startswith("unix:") and not self._address.startswith(
            f"unix:{self.run.path}"
        ):
            with contextlib.suppress(OSError):  # the /tmp directory of a deep runs directory
                os.rmdir(os.path.dirname(self._address[5:]))
