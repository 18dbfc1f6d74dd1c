"""One rank: run ``fn`` in the kernel itself, with the same API as a multi-rank launch.

:class:`InKernel` is the :class:`~nbddp.backend.Backend` of a one-rank launch. No subprocess:
for the length of the call the kernel looks like rank 0 of a world of 1 (the torchrun
variables are set, a world-size-1 process group exists unless the user already made one, the
runtime functions answer for the plan's device), and all of it is undone afterwards.

A graceful stop (``stop_gracefully``, the timeout, the first interrupt of a blocking call)
of a function that checks ``nbddp.stopping()`` lands at its next check (one rank: nothing to
agree on); one that does not check, or not within ``stop_grace``, is aborted as by ``stop``.
``Run.stop()`` (and that abort) ends the call at a clean point first: the next ``nbddp.log``
or ``nbddp.progress`` step raises. If the function calls neither within ``ABORT_GRACE``
seconds, the abort is raised inside its thread between two Python bytecodes; code blocked in
one long native call is interrupted when it returns to Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

from nbddp import interrupts
from nbddp.backend import Finish, Outcome, RunEvents
from nbddp.errors import LaunchTimeout
from nbddp.errors.remote import rank_raised
from nbddp.local.kernel_world import kernel_device, single_rank_world
from nbddp.plan import LaunchPlan
from nbddp.recovery import Saved, stopped_gracefully
from nbddp.wire import payload
from nbddp.wire.stacks import AskStacks, StackReport
from nbddp.worker import live
from nbddp.worker.debugging import debugger
from nbddp.worker.diagnosis.stacks import current_threads, recent_collectives
from nbddp.worker.rank.report import format_user_traceback, hint_for, message_of
from nbddp.worker.rank.runtime import Checkpoints, RankRuntime
from nbddp.worker.recovery import stopping

ABORT_GRACE = 0.5


class _Abort(BaseException):
    """Raised inside the call by a timeout or ``Run.stop()``."""


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
        self._agreement: stopping.Agreement | None = None
        self._why: str | None = None  # by what a graceful stop was asked
        self._landed: tuple[int, str] | None = None  # (step, what checked) where it landed
        self._saved: list[Saved] = []  # the checkpoints after the ask, whoever saved them

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

    def stop_gracefully(self, why: str, reason: Literal["stopped", "timeout"] = "stopped") -> None:
        """At the function's next check; at once (``reason``) when it never checked."""
        with self._lock:
            agreement = self._agreement
            if self._why is not None or self._reason is not None or self._phase != "calling":
                graceful = False
            else:
                graceful = agreement is not None and agreement.ask_here()
            if graceful:
                self._why = why
        if not graceful:
            self._abort(reason)
            return
        if self._events is not None:
            self._events.stopping(why)
        timer = threading.Timer(self.plan.stop_grace, self._abort, (reason,))
        timer.daemon = True
        timer.start()

    def _interrupted(self, signum: int, frame: Any) -> None:
        """The first interrupt of a blocking call that checks: a graceful stop; any other
        interrupt raises as usual."""
        with self._lock:
            agreement, asked = self._agreement, self._why is not None
        if asked or agreement is None or agreement.checks == 0:
            raise KeyboardInterrupt
        self.stop_gracefully("the interrupt (■)")

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
        agreement = self._agreement = stopping.Agreement(self._stopped_at)
        services = contextlib.ExitStack()  # the rank runtime's, undone in the finally
        try:
            with interrupts.deferred():  # what is set up here is undone in the finally
                call = services.enter_context(
                    RankRuntime(0, _EventsSink(events)).call(
                        agreement,
                        Checkpoints(plan.checkpoint_dir or None, plan.keep, self._checkpointed),
                        # a blocking run owns the cell: pdb asks its input box
                        asks=debugger.in_the_kernel(sys.stdout) if plan.block else None,
                    )
                )
                self._buffer = call.buffer
                if self._reason is not None:
                    call.buffer.abort = _Abort
                if plan.timeout:
                    timer = threading.Timer(
                        plan.timeout, self.stop_gracefully, (f"the timeout of {plan.timeout:g} s",)
                    )
                    timer.kwargs = {"reason": "timeout"}
                    timer.daemon = True
                    timer.start()
            # A blocking call owns the cell: its prints go to the panel, like a rank's would.
            panel = events.output if plan.block else None
            redirect = _redirected(panel) if panel is not None else contextlib.nullcontext()
            interrupts.reached("joining the process group")
            with single_rank_world(plan, fn), redirect:
                with self._lock:
                    if self._reason is not None:
                        raise _Abort
                    self._phase = "calling"
                events.started()
                try:
                    interrupts.reached("running fn")
                    with self._first_interrupt_graceful():
                        value = self._call_restarting(fn, args, kwargs, events)
                finally:
                    with self._lock:
                        self._phase = "returned"
            outcome = Outcome("succeeded", payload.to_cpu(value))
            if self._landed is not None and self._why is not None:
                step, where = self._landed
                graceful = stopped_gracefully(step, where, self._why, self._saved)
                outcome = outcome._replace(status="stopped", graceful=graceful)
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
                services.close()  # every row reaches the state before the outcome
                if timer is not None:
                    timer.cancel()
        finish(outcome)

    def _call_restarting(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        events: RunEvents,
    ) -> Any:
        """``fn``, called again after it raised while ``max_restarts`` allows (the one-rank
        world stays; ``nbddp.restore`` in ``fn`` resumes). A stop is never restarted."""
        restarts = 0
        while True:
            try:
                return fn(*args, **kwargs)
            except (_Abort, KeyboardInterrupt, SystemExit):
                raise
            except Exception as exc:
                if restarts >= self.plan.max_restarts or self._reason or self._why:
                    raise
                restarts += 1
                error = rank_raised(
                    0, type(exc).__name__, message_of(exc), format_user_traceback(exc), exc
                )
                events.restarted(restarts, self.plan.max_restarts, error)

    def _stopped_at(self, step: int, where: str) -> None:
        self._landed = (step, where)

    def _checkpointed(
        self, step: int, path: str, seconds: float, restored: bool, by: str = ""
    ) -> None:
        if self._events is not None and not by:
            self._events.checkpointed(step, path, seconds, restored)
        if self._why is not None and not restored:
            self._saved.append((step, path, by))

    @contextlib.contextmanager
    def _first_interrupt_graceful(self) -> Iterator[None]:
        """While a blocking call runs in the kernel's main thread: its first interrupt asks
        for a graceful stop (``_interrupted``)."""
        if not self.plan.block or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._interrupted)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _redirected(stream: Any) -> Iterator[None]:
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        yield


def device_name(plan: LaunchPlan) -> str:
    if plan.device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(kernel_device(plan))
