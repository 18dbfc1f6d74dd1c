"""The handle of one launch: its status, its outcome, and the way to stop it.

A :class:`Run` is built with its :class:`~nbddp.backend.Backend` and drives it: it owns the
state model and the live view, starts the backend, and is told the outcome once.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from nbddp import interrupts
from nbddp.backend import Backend, Kept, Outcome, Status
from nbddp.diagnosis import input_box
from nbddp.diagnosis.rollcalls import RollCalls
from nbddp.diagnosis.stacks import Stacks
from nbddp.display import LiveDisplay
from nbddp.display.rich import RichOutputs
from nbddp.errors import LaunchTimeout, RunStopped
from nbddp.errors.notices import warn_always
from nbddp.plan import LaunchPlan
from nbddp.state.run import RunState

_last: Run | None = None


def last_run() -> Run | None:
    """The most recent [nbddp.Run][] of this kernel, blocking launches included (None before
    the first launch)."""
    return _last


def remember(run: Run) -> None:
    """Make ``run`` what :func:`last_run` returns (the launch path calls this)."""
    global _last
    _last = run


class Run:
    """One launch, running or ended. Thread-safe; returned by ``notebook_launch(block=False)``.

    ``status`` is "running", then one of "succeeded", "failed" or "stopped".
    """

    def __init__(
        self, plan: LaunchPlan, backend: Backend, device_name: str, began: float | None = None
    ) -> None:
        """``began``: the launch's ``time.time()``, for a run launched before this handle."""
        self._id = secrets.token_hex(4)
        self.world_size = plan.world_size
        """How many ranks the run has."""
        self.device = plan.device
        """Where the ranks train: "cuda" or "cpu"."""
        self.backend = plan.backend
        """The process group's backend: "nccl" or "gloo"."""
        self._plan = plan
        self._runner = backend
        self._state = RunState(
            plan.world_size, plan.device, plan.backend, device_name, nodes=plan.nodes
        )
        if began is not None:
            self._state.started_at = time.monotonic() - max(0.0, time.time() - began)
            self._state.last_progress = time.monotonic()
        if plan.output != "none":  # the ranks' display() and figures, in this cell
            self._state.rich = RichOutputs(plan.output)
        self._prompts = self._state.prompts  # the ranks' pdb and input(): the input box
        self._prompts.send = backend.tell
        self._display: LiveDisplay | None = None
        self._outcome: Outcome | None = None
        self._unwarned: tuple[str, ...] = ()  # the outcome's warnings, until result() warns
        self._done = threading.Event()
        self._finish_lock = threading.Lock()
        self._warned = False
        self._rollcalls = RollCalls(
            plan.world_size,
            self._state.answers,
            lambda message: self._runner.ask(message),
            self._state.show_where,
            lambda: self._done.is_set() or self._outcome is not None,
        )
        self._graceful_asked = False
        self._started = False  # the backend's start returned: the ranks run

    def start(self) -> None:
        """Show the live view and start the backend; raises if the ranks cannot start."""
        plan = self._plan
        self._prompts.missing = input_box.missing()  # this cell's: papermill has none
        try:
            if plan.display != "none":
                with interrupts.deferred():  # a display thread is closed by _finish, never lost
                    self._display = LiveDisplay(
                        self._state,
                        plan.display,
                        self._stop_button,
                        plan.block,
                        self._rollcalls.where_button,
                    )
                # The live widget shows the ranks' output in its panel, not below it.
                self._state.panel_output = self._display.mode == "widget"
            self._runner.start(self._state, self._finish)
        except KeyboardInterrupt:  # the backend cleaned up: nothing runs, nothing will finish
            self._finish(Outcome("stopped"))
            raise
        except BaseException as exc:
            self._finish(Outcome("failed", error=exc))
            raise
        self._started = True
        # The ranks run from here on, and only the backend may say they ended: an interrupt
        # below must stop them first (finishing the run here used to leave them running).
        try:
            interrupts.reached("watching")
            self._watch_for_stalls()
        except BaseException:
            self.stop_despite_interrupts()
            raise

    def _watch_for_stalls(self) -> None:
        """The stall banner, and a roll-call just before the timeout ends the ranks."""
        if not self._done.is_set():
            plan = self._plan
            progress = lambda: self._state.progress_mark  # noqa: E731
            self._rollcalls.start(plan.stall_after, plan.timeout, progress)

    def stacks(self, timeout: float = 5.0, native: bool = False) -> Stacks:
        """Where every rank (and each of its threads) is right now: an [nbddp.Stacks][],
        whose ``str()`` is the roll-call (ranks grouped by where they wait, the collective each
        is in, notebook frames as ``Cell In[n], line m``). Ranks that do not answer within
        ``timeout`` seconds are left out and named. ``native=True`` adds py-spy's native
        frames where py-spy is installed and may attach."""
        return self._rollcalls.ask(timeout, native)

    @property
    def stacks_at_stop(self) -> Stacks | None:
        """Where the ranks were when a run that had stalled was stopped (else None)."""
        return self._rollcalls.at_stop

    @property
    def id(self) -> str:
        """This run's id: a detached run's, which ``nbddp.attach`` and ``%ddp_attach`` take,
        or one of this handle's own."""
        runner = self._runner
        return (runner.id if isinstance(runner, Kept) else None) or self._id

    @property
    def detached(self) -> bool:
        """Whether the run belongs to a supervisor of its own (``detach=True``, ``attach``)."""
        return isinstance(self._runner, Kept)

    def forget(self) -> None:
        """Delete a finished detached run's kept output and result (ValueError while it runs:
        stop it first). A run that is not detached keeps nothing: nothing to do."""
        if isinstance(self._runner, Kept):
            self._runner.forget()

    @property
    def status(self) -> Status:
        """The run's state: "running", then "succeeded", "failed" or "stopped"."""
        return self._outcome.status if self._outcome is not None else "running"

    @property
    def history(self) -> list[dict[str, Any]]:
        """The metrics of ``nbddp.log``, averaged across ranks: one dict per row, in order,
        with ``step`` and, where known, ``epoch``. Every row is kept up to 1,000,000 rows,
        then every other row is dropped (and from then on every 2nd, 4th, ... row is kept)."""
        return self._state.history_rows()

    @property
    def nodes(self) -> tuple[str, ...]:
        """The machines' addresses, in node-rank order (``("localhost",)`` on this one)."""
        return self._runner.nodes

    @property
    def duration(self) -> float:
        """Seconds since the launch, or its whole length once it ended."""
        return self._state.elapsed

    def drive(self, block: bool, ended: Callable[[str | None], None] | None = None) -> Any:
        """The one start-and-wait of every launch path (a launch, a session's task): start,
        then return this handle (``block=False``) or wait and return the result. An interrupt
        at any point ends the ranks before it is raised. ``ended(why)`` is told once the ranks
        stopped after an interrupt (``why`` "the interrupt") or once a blocking run ended
        (``None``), before its result is read: a session replaces ranks it lost there."""
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        try:
            self.start()
            if not block:
                return self
            self.wait()
        except KeyboardInterrupt as interrupt:
            self._after_an_interrupt(interrupt, ended)
        if ended is not None:
            ended(None)
        return self.result()

    def _after_an_interrupt(
        self, interrupt: KeyboardInterrupt, ended: Callable[[str | None], None] | None
    ) -> None:
        """The first interrupt of a running launch asks for a graceful stop and waits for it
        (the run's value is then the result); any other interrupt, or a run that cannot stop
        gracefully, ends the ranks at once and raises."""
        __tracebackhide__ = True
        graceful = not self._done.is_set() and not self._graceful_asked and self._started
        if graceful:
            self.stop(timeout=0, graceful=True, why="the interrupt (■)")
            try:
                self.wait()
            except KeyboardInterrupt as second:
                interrupt = second
                graceful = False
        if graceful and self._outcome is not None and self._outcome.graceful is not None:
            return  # the ranks stopped at one step: the result is fn's value
        self.stop_despite_interrupts(interrupt)
        if ended is not None:
            ended("the interrupt")
        raise interrupt

    def stop_despite_interrupts(self, interrupt: KeyboardInterrupt | None = None) -> None:
        """A second Ctrl-C must not leave ranks behind: keep waiting for the teardown. A run
        that had stalled gives ``interrupt`` its roll-call (``interrupt.stacks``)."""
        while True:
            try:
                self.stop()
                break
            except KeyboardInterrupt:
                continue
        if interrupt is not None:
            interrupt.stacks = self.stacks_at_stop  # type: ignore[attr-defined]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended or ``timeout`` seconds passed; True if it ended.
        Meanwhile a rank's pdb prompt (or ``input()``) is asked in this cell's input box."""
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        ended = self._prompts.serve(self._done, timeout)
        self._prompts.take_warnings()
        return ended

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (every rank's with ``return_all``), or raise the run's error
        ([nbddp.RunStopped][] for a stopped run)."""
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        if not self.wait(timeout):
            raise TimeoutError(
                f"the run is still going after waiting {timeout:g} s; call result() again "
                "to keep waiting, or stop() to end it."
            )
        assert self._outcome is not None
        with self._finish_lock:
            unwarned, self._unwarned = self._unwarned, ()
        for message in unwarned:  # once, in the thread that asks (the notebook's cell)
            warn_always(message)
        if self._outcome.error is not None:
            raise self._outcome.error.with_traceback(None)  # fresh each time: no frames pile up
        if self._outcome.graceful is not None and not self._warned:
            self._warned = True  # stopped gracefully: fn's value, with where and why
            warn_always(self._outcome.graceful)
        if self._outcome.status == "stopped" and self._outcome.graceful is None:
            raise RunStopped(self._rollcalls.at_stop)
        if self._outcome.warning is not None and not self._warned:
            self._warned = True  # once per run, wherever its result is asked for
            warn_always(self._outcome.warning)
        return self._outcome.value

    @property
    def warning(self) -> str | None:
        """Why a run that succeeded was not one DDP job (its ranks' models differ, or they
        never communicated), or None; also shown by the panel and as an ``NbddpWarning``."""
        return self._outcome.warning if self._outcome is not None else None

    def stop(
        self,
        timeout: float | None = 30.0,
        *,
        graceful: bool = False,
        why: str = "run.stop(graceful=True)",
    ) -> bool:
        """End the run; the status becomes "stopped".

        Args:
            timeout: Seconds to wait for the end (None: as long as it takes).
            graceful: Ask every rank to stop at the same step boundary, where
                [nbddp.stopping][] turns True and [nbddp.progress][] ends its loop; the
                function then returns (and may save), and its value is the result. A run
                that does not check, or not within ``stop_grace``, is ended at once.
                False: terminate every rank now.
            why: What asked for it, as the panel and the warning say.

        Returns:
            True once the ranks are gone, False if ``timeout`` seconds passed first.
        """
        if self._done.is_set():
            return True
        self._rollcalls.if_stalled()  # what a stalled run was doing, for RunStopped.stacks
        if graceful and not self._graceful_asked:
            self._graceful_asked = True
            self._runner.stop_gracefully(why)
            return self._done.wait(timeout)
        self._runner.stop()
        return self._done.wait(timeout)

    def _stop_button(self) -> None:
        """The panel's Stop: first a graceful stop, a second click ends the ranks at once."""
        graceful = not self._graceful_asked
        threading.Thread(
            target=self.stop,
            kwargs={"timeout": None, "graceful": graceful, "why": "the Stop button"},
            name="nbddp-stop",
            daemon=True,
        ).start()

    @property
    def restarts(self) -> list[tuple[float, BaseException]]:
        """Each restart of the whole world (``max_restarts``): ``(time.time(), cause)``,
        the cause being the [nbddp.WorkerError][] (or a lost node's error) that caused it."""
        return list(self._state.restarts)

    def _finish(self, outcome: Outcome) -> None:
        with interrupts.deferred(), self._finish_lock:  # whole, or a later wait() would hang
            if self._outcome is not None:
                return
            interrupts.reached("finishing")
            self._rollcalls.cancel()
            if isinstance(outcome.error, LaunchTimeout):
                outcome.error.stacks = self._rollcalls.before_timeout
            self._prompts.close()  # a question still in the input box has no one to go to
            try:
                warning = outcome.warning or outcome.graceful
                self._state.finish(outcome.status, outcome.error, warning)
                if outcome.duration is not None:  # a replayed run's own length
                    self._state.ended = self._state.started_at + outcome.duration
                if self._display is not None:  # the final panel is drawn before anyone is told
                    self._display.close()
            finally:
                self._outcome = outcome
                self._unwarned = outcome.exit_warnings
                self._done.set()

    def __repr__(self) -> str:
        return (
            f"<nbddp.Run {self.status}: {self.world_size} × {self.device} "
            f"({self.backend}), {self.duration:.1f} s>"
        )
