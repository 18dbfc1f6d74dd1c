"""One run's rank processes on one machine, and everything they talk through.

:class:`RankGroup` starts the ranks given to it (every rank of a local launch; one node's ranks
on a cluster), writes their job spec and script into a private directory, and runs one
``selectors`` loop over everything they have: the listening socket and each handshake, every
rank's connection (frames read a piece at a time), its stdout/stderr pipes, its exit (the
starter's sentinel), and a wake-up pipe for commands from other threads. A rank's ``Hello`` is
answered with its job here; everything else a rank says, and its end, become
:data:`~nbddp.wire.messages.RankEvent`\\ s handed to a :class:`Judge`, which decides when the run is
over: a :class:`~nbddp.rules.referee.Referee` for a launch on this machine, a session's judge,
a forwarder to the kernel on a cluster node. Teardown is the same for every ending.

In the kernel it is the :class:`~nbddp.backend.Ranks` of this machine (``local/ranks.py``
makes it).

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
from typing import Any, NamedTuple, TypeVar

from nbddp import interrupts
from nbddp.backend import Judge, Writable
from nbddp.local.channels import KINDS, Channels
from nbddp.local.processes import Starter, WorkerProcess, terminate
from nbddp.local.pump import OutputPump
from nbddp.local.rundir import RunDir
from nbddp.local.stack_dumps import SignalDumps
from nbddp.wire import payload
from nbddp.wire.call import Call
from nbddp.wire.frames import Connection
from nbddp.wire.messages import Display, Ended, Hello, Job, Output, Received, Shown, Started, Task
from nbddp.wire.prompts import Prompt
from nbddp.wire.spec import SPEC, JobSpec
from nbddp.wire.stacks import AskStacks, RankStacks
from nbddp.wire.transport import Listener

T = TypeVar("T")


class Environments(NamedTuple):
    """What the ranks of a group start with: each one's environment, and the rendezvous
    store's listening socket when this group's rank 0 serves it (the group owns it)."""

    envs: Mapping[int, dict[str, str]]
    store: socket.socket | None = None


class RankGroup:
    """The :class:`~nbddp.backend.Ranks` of one machine. Start with :meth:`start`, run the loop
    with :meth:`serve` (on its own thread); ``stop``, ``send_all``, ``send_task``, ``wake`` and
    ``set_output`` may be called from any thread. Making one opens nothing: ``environments``
    (the ranks' environments and the store's socket) is called by :meth:`start`."""

    nodes: tuple[str, ...] = ("localhost",)

    def __init__(
        self,
        ranks: Sequence[int],
        environments: Callable[[], Environments],
        spec: JobSpec,
        call: Call,
        starter: Starter,
        output: Output,
        target: Writable | None = None,
    ) -> None:
        self.ranks = tuple(ranks)
        self._environments = environments
        self._store: socket.socket | None = None  # the rendezvous store's socket, for rank 0
        self._spec = spec
        self._call: Call | None = call
        self._starter = starter
        self._output = output
        self._target = target
        self._dir: RunDir | None = None
        self._workers: dict[int, WorkerProcess] = {}
        self._pump: OutputPump | None = None
        self._selector = selectors.DefaultSelector()  # an epoll object: closed when collected
        self._wake_r = self._wake_w = -1  # the wake-up pipe, opened by start
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopping = False
        self._started_at = time.time()
        self._channels = Channels(self._selector, self._handle)
        self._sent_job: set[int] = set()
        self._sources: dict[str, tuple[Any, ...]] = {}
        self._torn_down = False
        self._dumps = SignalDumps(lambda: self._dir.path if self._dir else None, lambda: self.pids)

    def node_of(self, rank: int) -> str | None:
        return None  # one machine: errors need not name it

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

    def send_task(self, task: Task, call: Call) -> None:
        """A session's task, its tensors in ``call``'s segment (closed once sent)."""
        self.send_all(task, call.fds, then=call.close)

    def set_output(self, mode: Output, target: Writable | None = None) -> None:
        """Where the ranks' output goes from now on (a session's next task; before the start:
        a launch's panel)."""
        if self._pump is None:
            self._output, self._target = mode, target
        else:
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
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway), or not open
            os.write(self._wake_w, b"x")

    # -- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """Wait for the warm helper (interruptibly: nothing is open yet), then, with interrupts
        held back, open the store, write the spec and the script and start every rank.
        Cleans up if anything fails."""
        interrupts.reached("waiting for the helper")
        self._starter.warm_up()
        with interrupts.deferred():  # an interrupt lands after the whole start (or cleanup)
            try:
                self._open()
            except BaseException:
                self.teardown()
                raise

    def _open(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        envs, self._store = self._environments()
        self._dir = RunDir()
        listener = Listener(f"unix:{self._dir.join('channel.sock')}")
        self._channels.listen(listener)
        spec = dataclasses.replace(self._spec, address=listener.address, authkey=listener.key.hex())
        self._dir.write(SPEC, spec.to_json())
        argv = [self._dir.write_script()]
        self._pump = OutputPump(self._output, self._target)
        self._sources = payload.notebook_sources()
        self._started_at = time.time()
        interrupts.reached("starting the ranks")
        for rank in self.ranks:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                self._workers[rank] = self._starter.start(argv, envs[rank], out_w, err_w)
            except BaseException:
                os.close(out_r)
                os.close(err_r)
                raise
            finally:
                os.close(out_w)
                os.close(err_w)
            self._pump.add(rank, out_r, err_r)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: worker.pid for rank, worker in self._workers.items()}

    # -- the loop --------------------------------------------------------------------------

    def serve(self, judge: Judge[T]) -> T | None:
        """Serve the ranks until the judge's verdict (returned) or a stop (None); tears down."""
        try:
            return self._serve(judge)
        finally:
            self.teardown()

    def _serve(self, judge: Judge[T]) -> T | None:
        selector = self._selector
        assert self._pump is not None
        selector.register(self._wake_r, selectors.EVENT_READ, ("wake",))
        self._channels.register()
        for rank, worker in self._workers.items():
            selector.register(worker.sentinel, selectors.EVENT_READ, ("exit", rank))
            for fd in self._pump.fds(rank):
                selector.register(fd, selectors.EVENT_READ, ("pipe",))
        self._judge = judge
        while True:
            for key, _ in selector.select(self._timeout(judge.deadline())):
                self._dispatch(key)
            self._channels.expire()
            for dumped in self._dumps.due():  # the ranks that could not answer a roll-call
                judge.event(Received(dumped.rank, dumped, []))
            verdict = judge.verdict()
            if verdict is not None:
                return verdict
            if self._stopping:
                return None

    def _timeout(self, deadline: float | None) -> float | None:
        candidates = (deadline, self._dumps.deadline(), self._channels.deadline())
        times = [t for t in candidates if t is not None]
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
                working = {c: r for c, r in self._channels.rank_of.items() if r in self._sent_job}
                if isinstance(message, AskStacks) and not message.native:  # py-spy is slow
                    self._dumps.asked(message.query, list(working.values()))
                for conn in working:
                    self._channels.send(conn, message, list(fds))
                if then is not None:
                    then()
        elif kind in KINDS:
            self._channels.ready(key)
        elif kind == "pipe":
            assert self._pump is not None
            if not self._pump.read(key.fd):
                self._selector.unregister(key.fd)
        elif kind == "exit":
            self._on_exit(key.data[1])

    def _handle(self, conn: Connection, message: Any, buffers: list[Any]) -> None:
        rank = self._channels.rank_of.get(conn)
        if rank is None:
            if isinstance(message, Hello):
                self._welcome(conn, message.rank)
            else:
                self._channels.forget(conn)  # a stranger that knew the key but is no rank of ours
        elif getattr(message, "rank", None) == rank:
            shown = isinstance(message, Display) and not message.update
            if (shown or isinstance(message, Prompt)) and self._pump is not None:
                self._pump.drain(rank)  # what the rank printed before it goes first
            if isinstance(message, RankStacks):
                self._dumps.answered(rank, message.query)
            self._judge.event(Received(rank, message, buffers))
            if shown:
                self._channels.send(conn, Shown())  # the rank may go on printing
        else:
            self._channels.forget(conn)  # a message out of place

    def _welcome(self, conn: Connection, rank: int) -> None:
        """A rank said hello: give it the job, once."""
        if rank not in self._workers or rank in self._sent_job or self._call is None:
            self._channels.forget(conn)
            return
        if not self._sent_job:
            interrupts.reached("handing out the job")
        self._channels.speaks_for(conn, rank)
        call = self._call
        store = self._store if rank == 0 else None
        fds = [*call.fds, store.fileno()] if store is not None else call.fds
        self._channels.send(
            conn, Job(call.stream, self._sources, call.layout, store is not None), fds=fds
        )
        if conn not in self._channels.rank_of:
            return
        if store is not None:
            self._close_store()  # rank 0 serves it now
        self._sent_job.add(rank)
        if len(self._sent_job) == len(self.ranks):
            self._drop_call()  # every rank has it: nobody here keeps a copy
            self._judge.event(Started())

    def _on_exit(self, rank: int) -> None:
        assert self._pump is not None
        self._selector.unregister(self._workers[rank].sentinel)
        for conn, conn_rank in list(self._channels.rank_of.items()):
            if conn_rank == rank:  # its last words may still sit in the socket
                self._channels.read(conn)
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
        self._channels.close()
        self._selector.close()
        if self._pump is not None:
            self._pump.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._dir is not None:
            self._dir.remove()
            self._dir = None
        self._drop_call()
        self._close_store()
