"""What a detached run's supervisor and the kernels attached to it say to each other.

Every connection starts with the wire's HMAC handshake on the run's key (``transport.py``),
which only the run's owner can read; the launching kernel's own link is a socket pair.

    supervisor -> kernel   StandingBy(pid), once it is ready for a launch
    kernel -> supervisor   Handoff (the launch; its descriptors: the run's held lock, then
                           the call's shared memory), once, on the launching kernel's link
    supervisor -> kernel   Launched(offset) or LaunchFailed(error), in answer;
                           Attached(offset) first, on a link that attached later
                           Live(event): one recorded event (``records.Event``, pickled), for
                           every event after ``offset``; what came before is read from the
                           run's ``events.log`` up to ``offset``, so nothing is seen twice
                           or missed
                           Answer(rank, query, report): a rank's answer to this kernel's
                           roll-call
    kernel -> supervisor   StopRun(graceful, why), AskStacks(query, native)

Non-goal: what an event means (``replay.py``).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from typing import Any, NamedTuple

from nbddp.wire.frames import Connection
from nbddp.wire.messages import SharedLayout
from nbddp.wire.stacks import StackReport

SEND_TIMEOUT = 30.0  # seconds a send to an attached kernel may block before it is dropped
MAX_QUEUED = 64 << 20  # bytes queued for one kernel before it is dropped (it may attach again)


class StandingBy(NamedTuple):
    pid: int


class Handoff(NamedTuple):
    directory: str  # the run's
    plan: Any  # the LaunchPlan
    stream: bytes  # the pickled call
    layout: SharedLayout | None
    sources: dict[str, tuple[Any, ...]]  # the notebook's cells, for the ranks' tracebacks
    sys_path: tuple[str, ...]
    cwd: str
    environ: dict[str, str]
    ray: Any = None  # a run on Ray: the cluster as the supervisor reaches it (a RayAddress)


class Launched(NamedTuple):
    pid: int  # the supervisor's
    offset: int


class LaunchFailed(NamedTuple):
    error: bytes  # outcome.encode_error's


class Attached(NamedTuple):
    pid: int
    offset: int


class Live(NamedTuple):
    body: bytes


class Answer(NamedTuple):
    rank: int
    query: int
    report: StackReport


class StopRun(NamedTuple):
    graceful: bool = False  # at one step boundary (``Backend.stop_gracefully``), else now
    why: str = ""  # what asked for a graceful stop, as the panel and the warning say


class Outlet:
    """One attached kernel, seen from the supervisor: what it is sent is queued and sent by a
    thread of its own, so a kernel that stops reading holds up nothing but itself (past
    ``MAX_QUEUED`` bytes or ``SEND_TIMEOUT`` it is dropped; it can attach again)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue[tuple[Any, int] | None] = queue.SimpleQueue()
        self._queued = 0
        self._lock = threading.Lock()
        self.gone = threading.Event()
        conn.sock.settimeout(SEND_TIMEOUT)
        self._thread = threading.Thread(target=self._send_all, name=name, daemon=True)
        self._thread.start()

    def put(self, message: Any, size: int = 64) -> None:
        with self._lock:
            if self.gone.is_set():
                return
            self._queued += size
            if self._queued > MAX_QUEUED:
                self._drop()
                return
        self._queue.put((message, size))

    def _send_all(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            message, size = item
            try:
                self.conn.send(message)
            except OSError:
                with self._lock:
                    self._drop()
                break
            with self._lock:
                self._queued -= size
        with contextlib.suppress(OSError):
            self.conn.sock.shutdown(socket.SHUT_WR)

    def _drop(self) -> None:
        """Call with the lock held."""
        if not self.gone.is_set():
            self.gone.set()
            with contextlib.suppress(OSError):
                self.conn.sock.shutdown(socket.SHUT_RDWR)

    def close(self, timeout: float) -> None:
        """Send what is queued (within ``timeout`` seconds), then end the connection."""
        self._queue.put(None)
        self._thread.join(timeout)
        with self._lock:
            self._drop()
        self.conn.close()
