"""One run's rank processes on one machine, and everything they talk through.

:class:`RankGroup` starts the ranks given to it (every rank of a local launch; one node's ranks
on a cluster), writes their job spec and script into a private directory, and runs one
``selectors`` loop over everything they have: the listening socket and each handshake, every
rank's connection (frames read a piece at a time), its stdout/stderr pipes, its exit (the
starter's sentinel), and a wake-up pipe for commands from other threads. A rank's ``Hello`` is
answered with its job here; everything else a rank says, and its end, become
:data:`~nbddp.wire.messages.RankEvent`\\ s handed to a :class:`Judge`, which decides when the run is
over: a :class:`~nbddp.rules.referee.Referee` for a launch on this machine, a forwarder to the
kernel on a cluster node. Teardown is the same for every ending.

Non-goal: deciding anything about the run; this is the plumbing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import selectors
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbddp.backend import Judge, Writable
from nbddp.local.dumps import SignalDumps
from nbddp.local.processes import Starter, WorkerProcess, terminate
from nbddp.local.pump import OutputPump
from nbddp.local.rundir import RunDir
from nbddp.wire import payload
from nbddp.wire.call import Call
from nbddp.wire.messages import (
    SPEC,
    Display,
    Ended,
    Hello,
    Job,
    JobSpec,
    Output,
    Received,
    Shown,
    Started,
)
from nbddp.wire.stacks import AskStacks, RankStacks
from nbddp.wire.transport import AuthenticationFailed, Connection, Listener, PendingHandshake

_READ_BUDGET = 16 << 20  # bytes read from one connection before the loop looks around
_SEND_TIMEOUT = 60.0


class RankGroup:
    """Start with :meth:`start`, run the loop with :meth:`run` (on its own thread); ``stop``
    and ``send_all`` may be called from any thread."""

    def __init__(
        self,
        ranks: Sequence[int],
        envs: Mapping[int, dict[str, str]],
        spec: JobSpec,
        call: Call,
        starter: Starter,
        output: Output,
        target: Writable | None = None,
        store: socket.socket | None = None,
    ) -> None:
        self.ranks = tuple(ranks)
        self._store = store  # the rendezvous store's listening socket, for rank 0 (owned)
        self._envs = envs
        self._spec = spec
        self._call: Call | None = call
        self._starter = starter
        self._output = output
        self._target = target
        self._dir: RunDir | None = None
        self._listener: Listener | None = None
        self._workers: dict[int, WorkerProcess] = {}
        self._pump: OutputPump | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopping = False
        self._started_at = time.time()
        self._connections: dict[Connection, int | None] = {}
        self._sent_job: set[int] = set()
        self._sources: dict[str, tuple[Any, ...]] = {}
        self._torn_down = False
        self._dumps = SignalDumps(lambda: self._dir.path if self._dir else None, lambda: self.pids)

    # -- from any thread -------------------------------------------------------------------

    def stop(self) -> None:
        """End the loop (it returns None unless the judge decided first) and tear down."""
        self._stopping = True
        self._wake()

    def send_all(
        self, message: Any, fds: Sequence[int] = (), then: Callable[[], None] | None = None
    ) -> None:
        """Send ``message`` (and ``fds``) to every rank that has its job, from the loop's thread;
        ``then`` runs there once it was sent (e.g. to close what the fds refer to)."""
        self._commands.put((message, fds, then))
        self._wake()

    def set_output(self, mode: Output, target: Writable | None = None) -> None:
        """Where the ranks' output goes from now on (a session's next task)."""
        assert self._pump is not None
        self._pump.retarget(mode, target)

    def drain_output(self) -> None:
        """Pass on what the ranks wrote so far (called on the loop's thread: a session's
        task is over once a rank's answer arrived, and what it printed before is shown)."""
        if self._pump is not None:
            for rank in self.ranks:
                self._pump.drain(rank)

    def wake(self) -> None:
        """Make the loop ask the judge again (its state changed on another thread)."""
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"x")

    # -- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """Write the spec and the script, start every rank. Cleans up if anything fails."""
        try:
            self._dir = RunDir()
            self._listener = Listener(f"unix:{self._dir.join('channel.sock')}")
            spec = dataclasses.replace(
                self._spec, address=self._listener.address, authkey=self._listener.key.hex()
            )
            self._dir.write(SPEC, spec.to_json())
            argv = [self._dir.write_script()]
            self._pump = OutputPump(self._output, self._target)
            self._sources = payload.notebook_sources()
            for rank in self.ranks:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                try:
                    self._workers[rank] = self._starter.start(argv, self._envs[rank], out_w, err_w)
                except BaseException:
                    os.close(out_r)
                    os.close(err_r)
                    raise
                finally:
                    os.close(out_w)
                    os.close(err_w)
                self._pump.add(rank, out_r, err_r)
        except BaseException:
            self.teardown()
            raise

    @property
    def pids(self) -> dict[int, int]:
        return {rank: worker.pid for rank, worker in self._workers.items()}

    # -- the loop --------------------------------------------------------------------------

    def run(self, judge: Judge) -> Any:
        """Serve the ranks until the judge's verdict (returned) or a stop (None); tears down."""
        try:
            return self._serve(judge)
        finally:
            self.teardown()

    def _serve(self, judge: Judge) -> Any:
        selector = self._selector
        assert self._listener is not None and self._pump is not None
        selector.register(self._wake_r, selectors.EVENT_READ, ("wake",))
        selector.register(self._listener, selectors.EVENT_READ, ("accept",))
        for rank, worker in self._workers.items():
            selector.register(worker.sentinel, selectors.EVENT_READ, ("exit", rank))
            for fd in self._pump.fds(rank):
                selector.register(fd, selectors.EVENT_READ, ("pipe",))
        self._judge = judge
        while True:
            for key, _ in selector.select(self._timeout(judge.deadline())):
                self._dispatch(key)
            self._expire_handshakes()
            for dumped in self._dumps.due():  # the ranks that could not answer a roll-call
                judge.event(Received(dumped.rank, dumped, []))
            verdict = judge.verdict()
            if verdict is not None:
                return verdict
            if self._stopping:
                return None

    def _timeout(self, deadline: float | None) -> float | None:
        times = [t for t in (deadline, self._dumps.deadline()) if t is not None]
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
            while not self._commands.empty():
                message, fds, then = self._commands.get()
                # Only to ranks that have their job: a rank still starting waits for the job
                # alone (a roll-call there is "did not answer": it is importing, connecting).
                working = {c: r for c, r in self._connections.items() if r in self._sent_job}
                if isinstance(message, AskStacks) and not message.native:  # py-spy is slow
                    self._dumps.asked(message.query, list(working.values()))
                for conn in working:
                    self._send(conn, message, list(fds))
                if then is not None:
                    then()
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
        try:
            while conn in self._connections:
                frame = conn.reader.read(conn.sock, budget=_READ_BUDGET)
                if frame is None:
                    return  # the budget is spent: the rest on the loop's next turn
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
        rank = self._connections.get(conn)
        if rank is None:
            if isinstance(message, Hello):
                self._welcome(conn, message.rank)
            else:
                self._forget(conn)  # a stranger that knew the key but is no rank of ours
        elif getattr(message, "rank", None) == rank:
            shown = isinstance(message, Display) and not message.update
            if shown and self._pump is not None:
                self._pump.drain(rank)  # what the rank printed before it goes first
            if isinstance(message, RankStacks):
                self._dumps.answered(rank, message.query)
            self._judge.event(Received(rank, message, buffers))
            if shown:
                self._send(conn, Shown())  # the rank may go on printing
        else:
            self._forget(conn)  # a message out of place

    def _welcome(self, conn: Connection, rank: int) -> None:
        """A rank said hello: give it the job, once."""
        if rank not in self._workers or rank in self._sent_job or self._call is None:
            self._forget(conn)
            return
        self._connections[conn] = rank
        call = self._call
        store = self._store if rank == 0 else None
        fds = [*call.fds, store.fileno()] if store is not None else call.fds
        self._send(conn, Job(call.stream, self._sources, call.layout, store is not None), fds=fds)
        if conn not in self._connections:
            return
        if store is not None:
            self._close_store()  # rank 0 serves it now
        self._sent_job.add(rank)
        if len(self._sent_job) == len(self.ranks):
            self._drop_call()  # every rank has it: nobody here keeps a copy
            self._judge.event(Started())

    def _send(self, conn: Connection, message: Any, fds: list[int] | None = None) -> None:
        """Send on a connection the loop reads without blocking; drop it if that fails."""
        conn.sock.settimeout(_SEND_TIMEOUT)
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
        self._judge.event(Ended(rank, code, self._pump.stderr_tail(rank)))

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def _drop_call(self) -> None:
        if self._call is not None:
            self._call.close()  # the ranks' mappings keep the shared pages as long as needed
            self._call = None

    # -- the end ---------------------------------------------------------------------------

    def teardown(self) -> None:
        """Same path for every ending: TERM, grace, KILL, reap, close, remove. Idempotent."""
        if self._torn_down:
            return
        self._torn_down = True
        terminate(list(self._workers.values()), self._spec.run_id, self._started_at)
        self._workers.clear()
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
        self._wake_r = self._wake_w = -1
        if self._dir is not None:
            self._dir.remove()
            self._dir = None
        self._drop_call()
        self._close_store()
