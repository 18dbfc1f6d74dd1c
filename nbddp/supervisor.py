"""Ranks as processes on this machine: start them, watch them all-or-nothing, leave nothing.

:class:`LocalWorkers` is the :class:`~nbddp.backend.Backend` for a launch with more than one
rank. One thread runs one ``selectors`` loop over everything a run has: the listening socket
and each handshake, every rank's connection (frames read a piece at a time), every rank's
stdout/stderr pipes, every rank's exit (pidfds), and a wake-up pipe for ``stop()``. So a rank
that dies is noticed at once, not after a collective's timeout; a large result arriving does
not hold up anything else; and a stop is honoured within a few milliseconds.

The first failure ends the run; :mod:`nbddp.outcome` picks the root cause among the failures
that arrive within ``SETTLE`` seconds. Teardown is the same for every ending
(``processes.terminate``), then the connections, the pipes and the private directory go.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import sys
import threading
import time
from typing import Any

from . import interrupts, outcome, payload
from .backend import Finish, Outcome, RunEvents
from .call import Call
from .environment import (
    device_indices,
    free_port,
    notebook_logging,
    single_node,
    worker_env,
)
from .errors import LaunchTimeout, NbddpError
from .forkserver import default_starter
from .plan import LaunchPlan
from .processes import Starter, WorkerProcess, terminate
from .pump import OutputPump
from .rundir import SPEC, RunDir
from .transport import AuthenticationFailed, Connection, Listener, PendingHandshake
from .wire import (
    AllJoined,
    Bars,
    DeviceName,
    Failed,
    Hello,
    Job,
    JobSpec,
    Joined,
    MainRows,
    Result,
    Rows,
    Unsendable,
)

# After the first failure, how long to wait for the other ranks' news before choosing the root
# cause: a rank that dies closes its sockets before it can be seen to exit, so a peer's
# "Connection closed by peer" report can reach the kernel before the death that caused it.
SETTLE = 0.5
_READ_BUDGET = 16 << 20  # bytes read from one connection before the loop looks around
_JOB_SEND_TIMEOUT = 60.0


class LocalWorkers:
    """One launch's processes from start to teardown."""

    def __init__(self, plan: LaunchPlan, call: Call, starter: Starter | None = None) -> None:
        self.plan = plan
        self._call: Call | None = call
        self._starter = starter
        self._events: RunEvents | None = None
        self._finish: Finish | None = None
        self._dir: RunDir | None = None
        self._listener: Listener | None = None
        self._workers: list[WorkerProcess] = []
        self._pump: OutputPump | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop_requested = False
        self._run_id = ""
        self._started_at = time.time()
        # what the loop learns
        self._connections: dict[Connection, int | None] = {}
        self._sent_job: set[int] = set()
        self._joined: set[int] = set()
        self._tracker = outcome.RunTracker(plan.world_size, plan.return_all)
        self._sources: dict[str, tuple[Any, ...]] = {}

    # -- the Backend protocol ----------------------------------------------------------------

    def start(self, events: RunEvents, finish: Finish) -> None:
        """Write the spec, start every rank and the loop. Cleans up if anything fails."""
        self._events, self._finish = events, finish
        starter = self._starter or default_starter()
        starter.warm_up()
        supervisor = threading.Thread(target=self._supervise, name="nbddp-supervisor", daemon=True)
        try:
            with interrupts.deferred():  # an interrupt lands after the whole start (or cleanup)
                self._start(starter, events)
                supervisor.start()
        except BaseException:
            if supervisor.is_alive():  # interrupted right after the start: end it all first
                self.stop()
                with interrupts.deferred():
                    supervisor.join()
            raise

    def _start(self, starter: Starter, events: RunEvents) -> None:
        plan = self.plan
        try:
            self._dir = RunDir()
            self._run_id = f"nbddp-{os.getpid()}-{secrets.token_hex(4)}"
            self._listener = Listener(f"unix:{self._dir.join('channel.sock')}")
            spec = JobSpec(
                address=self._listener.address,
                authkey=self._listener.key.hex(),
                run_id=self._run_id,
                sys_path=tuple(os.path.abspath(p) if p else os.getcwd() for p in sys.path),
                cwd=os.getcwd(),
                device=plan.device,
                device_index=device_indices(plan.gpus),
                backend=plan.backend,
                return_all=plan.return_all,
                output=plan.output,
                logging=notebook_logging(),
            )
            self._dir.write(SPEC, spec.to_json())
            argv = [self._dir.write_script()]
            port = free_port()
            self._pump = OutputPump(plan.output, events.output)
            self._sources = payload.notebook_sources()
            for rank in range(plan.world_size):
                env = worker_env(
                    single_node(rank, plan.world_size),
                    port,
                    self._run_id,
                    device=plan.device,
                    gpus=plan.gpus,
                    user_env=plan.env,
                )
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                try:
                    self._workers.append(starter.start(argv, env, out_w, err_w))
                except BaseException:
                    os.close(out_r)
                    os.close(err_r)
                    raise
                finally:
                    os.close(out_w)
                    os.close(err_w)
                self._pump.add(rank, out_r, err_r)
        except BaseException:
            self._teardown()
            raise

    def stop(self) -> None:
        self._stop_requested = True
        self._wake()

    # -- the loop ------------------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"x")

    def _supervise(self) -> None:
        result = Outcome("failed")
        try:
            result = self._watch()
        except BaseException as exc:  # a bug of ours must still end the run cleanly
            error = NbddpError(f"nbddp's supervisor failed: {exc!r} (see the cause below)")
            error.__cause__ = exc
            result = Outcome("failed", error=error)
        finally:
            self._teardown()
            assert self._finish is not None
            self._finish(result)

    def _watch(self) -> Outcome:
        plan, selector = self.plan, self._selector
        assert self._listener is not None and self._pump is not None
        selector.register(self._wake_r, selectors.EVENT_READ, ("wake",))
        selector.register(self._listener, selectors.EVENT_READ, ("accept",))
        for rank, worker in enumerate(self._workers):
            selector.register(worker.sentinel, selectors.EVENT_READ, ("exit", rank))
            for fd in self._pump.fds(rank):
                selector.register(fd, selectors.EVENT_READ, ("pipe",))
        deadline = time.monotonic() + plan.timeout if plan.timeout else None
        settled: float | None = None  # when to stop waiting for more failures
        while True:
            timeout = self._next_timeout(deadline, settled)
            for key, _ in selector.select(timeout):
                self._dispatch(key)
            self._expire_handshakes()
            tracker = self._tracker
            if tracker.failures:
                settled = settled or time.monotonic() + SETTLE
                if tracker.everyone_accounted_for or time.monotonic() >= settled:
                    return Outcome("failed", error=tracker.root_cause().error)
                continue  # a failure is decided: only the choice of root cause is left
            if self._stop_requested:
                return Outcome("stopped")
            if len(tracker.exited) == plan.world_size:
                return tracker.collect()
            if deadline is not None and time.monotonic() >= deadline:
                assert plan.timeout is not None
                return Outcome("failed", error=LaunchTimeout(plan.timeout))

    def _next_timeout(self, deadline: float | None, settled: float | None) -> float | None:
        times = [t for t in (deadline, settled) if t is not None]
        times += [
            key.data[1].deadline
            for key in self._selector.get_map().values()
            if key.data[0] == "handshake"
        ]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _dispatch(self, key: selectors.SelectorKey) -> None:
        kind = key.data[0]
        if kind == "wake":
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        elif kind == "accept":
            assert self._listener is not None
            pending = self._listener.accept()
            if pending is not None:
                self._selector.register(pending, selectors.EVENT_READ, ("handshake", pending))
        elif kind == "handshake":
            self._advance_handshake(key.data[1])
        elif kind == "conn":
            self._read(key.data[1])
        elif kind == "pipe":
            assert self._pump is not None
            if not self._pump.read(key.fd):
                self._selector.unregister(key.fd)
        elif kind == "exit":
            self._on_exit(key.data[1])

    def _advance_handshake(self, pending: PendingHandshake) -> None:
        try:
            conn = pending.advance()
        except BlockingIOError:
            return
        except (AuthenticationFailed, EOFError, OSError):
            assert self._listener is not None
            self._listener.rejected += 1
            self._selector.unregister(pending)
            pending.close()
            return
        if conn is not None:
            self._selector.modify(pending, selectors.EVENT_READ, ("conn", conn))
            self._connections[conn] = None

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for key in list(self._selector.get_map().values()):
            if key.data[0] == "handshake" and key.data[1].deadline < now:
                self._selector.unregister(key.fileobj)
                key.data[1].close()

    def _read(self, conn: Connection) -> None:
        """Read what the connection has; handle each complete frame; forget it at EOF."""
        budget = _READ_BUDGET
        try:
            while budget > 0:
                frame = conn.reader.read(conn.sock, budget=_READ_BUDGET)
                if frame is None:
                    budget = 0
                    continue
                self._handle(conn, frame.message, frame.buffers)
        except BlockingIOError:
            return
        except (EOFError, OSError):
            self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.reader.discard()
        self._connections.pop(conn, None)
        conn.close()

    def _handle(self, conn: Connection, message: Any, buffers: list[Any]) -> None:
        events = self._events
        assert events is not None
        rank = self._connections.get(conn)
        match message:
            case Hello(rank=hello_rank) if rank is None:
                self._welcome(conn, hello_rank)
            case Rows(rank=r, first=first, blocks=blocks) if r == rank:
                events.rows(r, first, blocks)
            case MainRows(rank=0, rows=rows) if rank == 0:
                events.main_rows(rows)
            case Bars(rank=r, bars=bars) if r == rank:
                events.bars(bars)
            case DeviceName(rank=r, name=name) if r == rank:
                events.device(name)
            case Joined(rank=r) if r == rank:
                self._joined.add(r)
                if len(self._joined) == self.plan.world_size:
                    self._broadcast(AllJoined())
            case Result(rank=r, stream=stream, early_exit=early) if r == rank:
                self._tracker.result(r, stream, buffers, early)
            case Failed(rank=r, report=report) if r == rank:
                self._tracker.raised(r, report)
            case Unsendable(rank=r, path=path, reason=reason) if r == rank:
                self._tracker.unsendable(r, path, reason)
            case _:  # a message out of place: the connection is not one of our ranks
                self._forget(conn)

    def _welcome(self, conn: Connection, rank: int) -> None:
        """A rank said hello: give it the job, once."""
        if (
            not isinstance(rank, int)
            or not 0 <= rank < self.plan.world_size
            or rank in self._sent_job
            or self._call is None
        ):
            self._forget(conn)
            return
        self._connections[conn] = rank
        call = self._call
        self._send(conn, Job(call.stream, self._sources, call.layout), fds=call.fds)
        if conn not in self._connections:
            return
        self._sent_job.add(rank)
        if len(self._sent_job) == self.plan.world_size:
            self._drop_call()  # every rank has it: the kernel keeps no copy
            assert self._events is not None
            self._events.started()

    def _broadcast(self, message: Any) -> None:
        for conn in list(self._connections):
            self._send(conn, message)

    def _drop_call(self) -> None:
        if self._call is not None:
            self._call.close()  # the ranks' mappings keep the shared pages as long as needed
            self._call = None

    def _send(self, conn: Connection, message: Any, fds: list[int] | None = None) -> None:
        """Send on a connection the loop reads without blocking; drop it if that fails."""
        conn.sock.settimeout(_JOB_SEND_TIMEOUT)
        try:
            conn.send(message, fds=fds or ())
        except OSError:
            self._forget(conn)
        else:
            conn.sock.setblocking(False)

    def _on_exit(self, rank: int) -> None:
        assert self._pump is not None
        self._selector.unregister(self._workers[rank].sentinel)
        for conn, conn_rank in list(self._connections.items()):
            if conn_rank == rank:  # its last words may still sit in the socket
                self._read(conn)
        self._pump.drain(rank)
        code = self._workers[rank].exitcode()
        self._tracker.ended(rank, code, self._pump.stderr_tail(rank))

    # -- the end ------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Same path for every ending: TERM, grace, KILL, reap, close, remove."""
        terminate(self._workers, self._run_id, self._started_at)
        for conn in list(self._connections):
            self._forget(conn)
        for key in list(self._selector.get_map().values()):
            if key.data[0] == "handshake":
                key.data[1].close()
        self._selector.close()
        if self._pump is not None:
            self._pump.close()
        if self._listener is not None:
            self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._dir is not None:
            self._dir.remove()
        self._drop_call()
