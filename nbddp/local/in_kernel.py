"""One rank: run ``fn`` in the kernel itself, with the same API as a multi-rank launch.

:class:`InKernel` is the :class:`~nbddp.backend.Backend` of a one-rank launch. No subprocess:
for the length of the call the kernel looks like rank 0 of a world of 1 (the torchrun
variables are set, a world-size-1 process group exists unless the user already made one, the
runtime functions answer for the plan's device), and all of it is undone afterwards.

A timeout or ``Run.stop()`` ends the call at a clean point first: the next ``nbddp.log`` or
``nbddp.progress`` step raises. If the function calls neither within ``ABORT_GRACE`` seconds,
the abort is raised inside its thread between two Python bytecodes; code blocked in one long
native call is interrupted when it returns to Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from nbddp import interrupts
from nbddp.backend import Finish, Outcome, RunEvents
from nbddp.environment import (
    RUN_ID_VARIABLE,
    free_port,
    is_launcher_variable,
    new_run_id,
    single_node,
    torchrun_env,
)
from nbddp.errors import LaunchTimeout
from nbddp.errors.remote import rank_raised
from nbddp.plan import LaunchPlan
from nbddp.wire import payload
from nbddp.wire.stacks import AskStacks, StackReport
from nbddp.worker import debugger, live, world
from nbddp.worker.context import Context, installed
from nbddp.worker.report import format_user_traceback, hint_for, message_of
from nbddp.worker.stacks import current_threads, recent_collectives

ABORT_GRACE = 0.5


class _Abort(BaseException):
    """Raised inside the call by a timeout or ``Run.stop()``."""


@contextmanager
def single_rank_world(plan: LaunchPlan, fn: Callable[..., Any] | None = None) -> Iterator[None]:
    """The kernel as rank 0 of a world of 1, for the length of the block. The user's own
    ``init_process_group`` is answered from its group, as a rank's is (``worker/world.py``),
    also through a name bound to torch's function before the launch (in the notebook, in
    ``fn``'s module or in the user's own modules)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", plan.gpus[0]) if plan.device == "cuda" else torch.device("cpu")
    run_id = new_run_id()
    saved: dict[str, str | None] = {}  # what the finally puts back
    made_group = False
    rebound: world.Rebound = []
    previous_cuda = None
    excepthook = sys.excepthook
    try:
        with interrupts.deferred():  # the world is built whole; the finally takes it down
            env = {  # free_port's socket is closed, whenever the interrupt comes
                **torchrun_env(single_node(0, 1), "127.0.0.1", free_port(), run_id),
                RUN_ID_VARIABLE: run_id,
                **plan.env,
            }
            # A launcher's variables in the kernel (a Slurm job's, torchrun's) are hidden.
            hidden = [n for n in os.environ if is_launcher_variable(n) and n not in env]
            saved.update({name: os.environ.get(name) for name in [*env, *hidden]})
            for name in hidden:
                del os.environ[name]
            os.environ.update(env)
            if device.type == "cuda":
                previous_cuda = torch.cuda.current_device()
                torch.cuda.set_device(device)
            if dist.is_available() and not dist.is_initialized():
                # the user's own init_process_group(rank=0, world_size=1) is answered from it
                world.join(plan.backend, 0, 1, store=dist.HashStore())  # type: ignore[attr-defined]
                made_group = True
                rebound = world.answer_bound_names(_user_namespaces(fn))
        with installed(Context(rank=0, local_rank=0, world_size=1, device=device)):
            yield
    finally:
        with interrupts.deferred():
            world.unbind(rebound)
            _restore(saved, made_group, previous_cuda, excepthook)


def _user_namespaces(fn: Callable[..., Any] | None) -> list[dict[str, Any]]:
    """Where the user's code looks its names up: the notebook's, ``fn``'s module's, and the
    user's own modules' (those outside the interpreter's and its packages' directories)."""
    found: dict[int, dict[str, Any]] = {}
    main = sys.modules.get("__main__")
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "__func__", target)
    for namespace in (getattr(main, "__dict__", None), getattr(target, "__globals__", None)):
        if isinstance(namespace, dict):
            found[id(namespace)] = namespace
    libraries = _library_directories()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and not file.startswith(libraries):
            found.setdefault(id(module.__dict__), module.__dict__)
    return list(found.values())


@functools.cache
def _library_directories() -> tuple[str, ...]:
    """The interpreter's and its packages' directories (as named and as resolved)."""
    paths = sysconfig.get_paths()
    places = [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    places += [*site.getsitepackages(), site.getusersitepackages()]
    return tuple({os.path.join(p, "") for p in places + [os.path.realpath(p) for p in places]})


def _restore(
    saved: dict[str, str | None],
    made_group: bool,
    previous_cuda: int | None,
    excepthook: Callable[..., Any],
) -> None:
    import torch

    if made_group:
        world.leave()  # the group, if the user's destroy_process_group() left it
    if made_group and getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
        # init_process_group wraps sys.excepthook to prefix "[rank0]: " and nothing unwraps
        # it: each in-kernel launch would add one more prefix to the kernel's tracebacks.
        sys.excepthook = excepthook
    if previous_cuda is not None:
        torch.cuda.set_device(previous_cuda)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class _EventsSink:
    """``nbddp.log`` and ``nbddp.progress`` of the one rank, straight into the run's state."""

    def __init__(self, events: RunEvents) -> None:
        self._events = events

    def rows(self, first: int, blocks: list[Any]) -> None:
        self._events.rows(0, first, blocks)

    def main_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        self._events.main_rows(rows)

    def bars(self, bars: list[Any]) -> None:
        self._events.bars(bars)


class InKernel:
    """Runs the call in the kernel: in the caller's thread when blocking, else in a thread."""

    nodes: tuple[str, ...] = ("localhost",)

    def __init__(
        self,
        plan: LaunchPlan,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.plan = plan
        self._call = (fn, args, kwargs)
        self._lock = threading.Lock()
        self._phase: Literal["setup", "calling", "returned"] = "setup"
        self._reason: Literal["stopped", "timeout"] | None = None
        self._thread_id = 0
        self._buffer: live.LiveBuffer | None = None
        self._events: RunEvents | None = None

    def start(self, events: RunEvents, finish: Finish) -> None:
        self._events = events
        if self.plan.block:
            self._run(events, finish)
        else:
            threading.Thread(
                target=self._run, args=(events, finish), name="nbddp-in-kernel", daemon=True
            ).start()

    def stop(self) -> None:
        self._abort("stopped")

    def tell(self, message: Any) -> None:
        """The one rank is the kernel itself: its pdb asks the input box directly."""

    def ask(self, message: AskStacks) -> None:
        """The one rank is the kernel's thread that runs fn: its stack is taken right here."""
        events, ident = self._events, self._thread_id
        if events is None or not ident:
            return
        threads = tuple(t._replace(main=True) for t in current_threads(only=ident))
        collectives, note = recent_collectives()
        report = StackReport("asked", threads, collectives, (), None, "", (note,) if note else ())
        events.stacks(0, message.query, report)

    def _abort(self, reason: Literal["stopped", "timeout"]) -> None:
        """Cooperatively first (the next log/progress step raises), by force after a grace."""
        with self._lock:
            if self._reason is not None or self._phase == "returned":
                return
            self._reason = reason
            if self._buffer is not None:
                self._buffer.abort = _Abort
        timer = threading.Timer(ABORT_GRACE, self._force)
        timer.daemon = True
        timer.start()

    def _force(self) -> None:
        with self._lock:
            if self._phase == "calling":  # only while fn runs, never in our own code
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread_id), ctypes.py_object(_Abort)
                )

    def _run(self, events: RunEvents, finish: Finish) -> None:
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        plan = self.plan
        self._thread_id = threading.get_ident()
        fn, args, kwargs = self._call
        timer: threading.Timer | None = None
        buffer: live.LiveBuffer | None = None
        previous_buffer: live.LiveBuffer | None = None
        try:
            with interrupts.deferred():  # what is set up here is undone in the finally
                if plan.timeout:
                    timer = threading.Timer(plan.timeout, self._abort, ("timeout",))
                    timer.daemon = True
                    timer.start()
                buffer = self._buffer = live.LiveBuffer(_EventsSink(events))
                if self._reason is not None:
                    buffer.abort = _Abort
                previous_buffer = live.install(buffer)
            # A blocking call owns the cell: its prints go to the panel, like a rank's would.
            panel = events.output if plan.block else None
            redirect = _redirected(panel) if panel is not None else contextlib.nullcontext()
            interrupts.reached("joining the process group")
            asks = debugger.in_the_kernel(sys.stdout) if plan.block else contextlib.nullcontext()
            with single_rank_world(plan, fn), asks, redirect:
                with self._lock:
                    if self._reason is not None:
                        raise _Abort
                    self._phase = "calling"
                events.started()
                try:
                    interrupts.reached("running fn")
                    value = fn(*args, **kwargs)
                finally:
                    with self._lock:
                        self._phase = "returned"
            outcome = Outcome("succeeded", payload.to_cpu(value))
        except _Abort:
            if self._reason == "timeout":
                assert plan.timeout is not None
                outcome = Outcome("failed", error=LaunchTimeout(plan.timeout))
            else:
                outcome = Outcome("stopped")
        except KeyboardInterrupt:
            finish(Outcome("stopped"))
            raise
        except BaseException as exc:
            if plan.debug and plan.block:  # the caller's thread: pdb asks the input box
                debugger.post_mortem_here(exc)
            error = rank_raised(
                0,
                type(exc).__name__,
                message_of(exc),
                format_user_traceback(exc),
                exc,
                hint=hint_for(exc),
            )
            outcome = Outcome("failed", error=error)
        finally:
            with interrupts.deferred():
                interrupts.reached("tearing down")
                if buffer is not None:
                    buffer.close()  # every row reaches the state before the outcome
                    live.install(previous_buffer)
                if timer is not None:
                    timer.cancel()
        finish(outcome)


@contextlib.contextmanager
def _redirected(stream: Any) -> Iterator[None]:
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        yield


def device_name(plan: LaunchPlan) -> str:
    if plan.device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(plan.gpus[0])
