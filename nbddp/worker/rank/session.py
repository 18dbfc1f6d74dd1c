"""A session's rank: joins the process group once, then runs task after task in one namespace.

The kernel's half is ``nbddp/sessions/``. The rank's main thread runs the tasks; a listener
thread reads the channel, queues each ``Task``, answers a ``Probe`` at once (even while a task
runs), and turns an ``Interrupt`` into ``KeyboardInterrupt`` in the task's code: a SIGINT sent
to the main thread, whose handler raises only while a task is running, so an interrupt that
comes late can never break the rank's own bookkeeping. Code blocked in a native call (a
collective waiting for a peer) sees it only when the call returns; the kernel restarts ranks
that do not come back, and ranks that came back with their collectives out of step (each
reports how many it issued per process group, ``worker/diagnosis/collectives.py``).

A graceful stop works as in a launch (``stopping.py``): each task has an agreement of its own,
installed while its code runs; the listener answers ``StopAsked`` with that task's count of
checks (0 between tasks: the kernel then has the task's result already) and passes on
``StopAt``. A ``StopAt`` can never reach the next task: the kernel sends it before that task,
on the same channel, and the listener reads in order.

When the kernel closes the session (``Close``, while no task runs), the rank leaves as a
launched rank does after its result: its exit handlers run (``worker/rank/exiting.py``). When the
kernel end closes, the rank kills its own process group at once, as a launch's does.
"""

from __future__ import annotations

import builtins
import os
import queue
import signal
import sys
import threading
import types
from typing import Any

from nbddp.wire import payload
from nbddp.wire.call import loads_call, rebind_globals
from nbddp.wire.frames import Connection, Frame
from nbddp.wire.messages import (
    BEFORE_THE_TASK,
    Close,
    Failed,
    Interrupt,
    Names,
    Probe,
    RankStatus,
    Shown,
    Task,
)
from nbddp.wire.prompts import Release, Reply
from nbddp.wire.spec import JobSpec
from nbddp.wire.stacks import AskStacks
from nbddp.worker.context import Context
from nbddp.worker.debugging import asking
from nbddp.worker.diagnosis import collectives, stacks
from nbddp.worker.output import rich
from nbddp.worker.rank import world
from nbddp.worker.rank.job import join_process_group, kill_own_group, receive_job, send_result
from nbddp.worker.rank.runtime import Call, RankProcess
from nbddp.worker.recovery import stopping
from nbddp.worker.streams import flush_output

_MISSING = object()


class _Busy:
    """Which task the main thread runs now (None while idle), read by the SIGINT handler,
    and the last task interrupted (an interrupt may come before its task started)."""

    def __init__(self) -> None:
        self.task: int | None = None
        self.interrupted = 0

    def start(self, task: int) -> None:
        __tracebackhide__ = True  # the rank's traceback ends where the task was
        self.task = task  # first: the listener, which sets ``interrupted`` first, sees one
        if self.interrupted >= task:
            raise KeyboardInterrupt(BEFORE_THE_TASK)

    def interrupt(self, task: int) -> None:
        self.interrupted = max(self.interrupted, task)
        if self.task == task:
            main = threading.main_thread().ident
            assert main is not None
            signal.pthread_kill(main, signal.SIGINT)  # wakes a sleep, unlike a flag

    def on_sigint(self, signum: int, frame: Any) -> None:
        __tracebackhide__ = True  # the rank's traceback ends where the task was
        if self.task is not None:
            raise KeyboardInterrupt


SESSION_CHECKPOINTS = "nbddp-checkpoints/session"


def serve(spec: JobSpec, rank: int, conn: Connection) -> int:
    """Join the process group, then run tasks until the kernel closes the session (0: the
    rank then leaves as a launched one does after its result) or its channel."""
    frame = receive_job(conn, rank)
    store = frame.fds.pop() if frame.message.store and frame.fds else None
    for fd in frame.fds:  # a session's job carries no call
        os.close(fd)
    payload.install_sources(frame.message.sources)
    busy = _Busy()
    tasks: queue.SimpleQueue[Frame | None] = queue.SimpleQueue()  # None: the session closes
    threading.Thread(
        target=_listen, args=(conn, rank, tasks, busy, spec), name="nbddp-session", daemon=True
    ).start()
    process = RankProcess(spec, rank, conn)

    def start() -> Context:
        # a session's tasks checkpoint into one directory (its plan has none of a function's)
        context = process.prepare(default_checkpoints=SESSION_CHECKPOINTS)
        join_process_group(spec, rank, context.world_size, store)
        return context

    started = Call.run(start)
    if started.failure is not None:
        conn.send(Failed(rank, started.failure))
        return 1
    context: Context = started.value
    process.joined()
    # Ray starts its processes with SIGINT blocked (services.py), and a node's ranks inherit the
    # mask: unblocked, an Interrupt reaches the task on a cluster as it does here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, busy.on_sigint)
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    reporter = collectives.Reporter(rank)
    while True:
        try:
            task = tasks.get()
            if task is None:
                return 0
            _run_task(task, process, context, namespace, busy, reporter)
        except KeyboardInterrupt:  # came after the task ended: nothing left to stop
            continue


def _run_task(
    frame: Frame,
    process: RankProcess,
    context: Context,
    namespace: dict[str, Any],
    busy: _Busy,
    reporter: collectives.Reporter,
) -> None:
    task = frame.message
    assert isinstance(task, Task)
    rank, conn = process.rank, process.conn

    def body() -> Any:
        nonlocal frame, task
        assert isinstance(task, Task)
        fn, args, kwargs = loads_call(task.call, task.shared, frame.fds, context.device)
        del frame  # nothing here keeps the pickled call while fn runs
        task = task._replace(call=b"")
        busy.start(task.task)
        try:
            world.ensure_group()  # the task before may have destroyed it (a tutorial's cleanup)
            if task.kind == "cell":
                return fn(*args, namespace=namespace, **kwargs)
            return call_in(namespace, fn, args, kwargs)
        finally:
            busy.task = None  # before the services are undone: a late interrupt is ignored

    with process.runtime.call(
        stopping.for_rank(conn.send, rank),  # removed before the answer: a later ask finds none
        process.checkpoints(),
        sources=task.sources,
        output=task.output,
        world_size=context.world_size,
        task=task.task,
        debug=task.debug,
        context=context,
    ) as call:
        ended = call.run(body)
    flush_output()
    reporter.report(conn)  # the task's code is over: the numbers stay as they are
    if rank == 0:
        conn.send(Names(rank, tuple(n for n in namespace if not n.startswith("__"))))
    if ended.failure is not None:
        conn.send(Failed(rank, ended.failure))
    else:
        send_result(conn, rank, ended.value, False, rank == 0 or task.return_all)


def call_in(
    namespace: dict[str, Any], fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Call a notebook-defined ``fn`` with the session namespace as its globals: a global it
    reads resolves here first, then to what was shipped with it; a global it assigns stays
    for later tasks. Shipped values are visible only during the call (the notebook may change
    them before the next one). A function of a module imported here runs as it is."""
    if not isinstance(fn, types.FunctionType) or _of_a_module(fn):
        return fn(*args, **kwargs)
    added = {}
    for name, value in fn.__globals__.items():
        if name not in namespace and not name.startswith("__"):
            namespace[name] = added[name] = value
    bound = rebind_globals(fn, namespace)
    try:
        return bound(*args, **kwargs)
    finally:
        for name, value in added.items():
            if namespace.get(name, _MISSING) is value:
                del namespace[name]


def _of_a_module(fn: types.FunctionType) -> bool:
    """Pickled by reference: its globals are an imported module's own (not the notebook's
    names, shipped by value)."""
    module = sys.modules.get(fn.__module__)
    return module is not None and getattr(module, "__dict__", None) is fn.__globals__


def _listen(
    conn: Connection,
    rank: int,
    tasks: queue.SimpleQueue[Frame | None],
    busy: _Busy,
    spec: JobSpec,
) -> None:
    try:
        while True:
            frame = conn.recv()
            match frame.message:
                case Task():
                    tasks.put(frame)
                case Close():
                    tasks.put(None)
                case Interrupt(task=task):
                    busy.interrupt(task)
                case Probe():
                    conn.send(_status(rank, busy, spec))
                case Shown():
                    rich.shown()
                case AskStacks():
                    stacks.answer(conn, rank, frame.message)
                case Reply() | Release():
                    asking.received(frame.message)
                case _:
                    stopping.listened(frame.message, stopping.current(), rank, conn.send)
    except (EOFError, OSError):
        pass
    kill_own_group()


def _status(rank: int, busy: _Busy, spec: JobSpec) -> RankStatus:
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    device_memory = None
    if spec.device == "cuda" and "torch" in sys.modules:
        import torch

        device_memory = int(torch.cuda.memory_reserved())
    return RankStatus(rank, busy.task is not None, resident, device_memory)
