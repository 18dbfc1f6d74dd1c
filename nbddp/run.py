"""The handle of one launch: its status, its outcome, and the way to stop it.

A :class:`Run` is built with its :class:`~nbddp.backend.Backend` and drives it: it owns the
state model and the live view, starts the backend, and is told the outcome once.
"""

from __future__ import annotations

import threading
from typing import Any

from nbddp import interrupts
from nbddp.backend import Backend, Outcome, Status
from nbddp.display import LiveDisplay
from nbddp.display.rich import RichOutputs
from nbddp.display.state import RunState
from nbddp.errors import RunStopped, warn_always
from nbddp.plan import LaunchPlan

_last: Run | None = None


def last_run() -> Run | None:
    """The most recent :class:`Run` of this kernel, blocking launches included."""
    return _last


def remember(run: Run) -> None:
    """Make ``run`` what :func:`last_run` returns (the launch path calls this)."""
    global _last
    _last = run


class Run:
    """One launch, running or ended. Thread-safe; returned by ``notebook_launch(block=False)``.

    ``status`` is "running", then one of "succeeded", "failed" or "stopped".
    """

    def __init__(self, plan: LaunchPlan, backend: Backend, device_name: str) -> None:
        self.world_size = plan.world_size
        self.device = plan.device
        self.backend = plan.backend
        self._plan = plan
        self._runner = backend
        self._state = RunState(
            plan.world_size, plan.device, plan.backend, device_name, nodes=plan.nodes
        )
        if plan.output != "none":  # the ranks' display() and figures, in this cell
            self._state.rich = RichOutputs(plan.output)
        self._display: LiveDisplay | None = None
        self._outcome: Outcome | None = None
        self._unwarned: tuple[str, ...] = ()  # the outcome's warnings, until result() warns
        self._done = threading.Event()
        self._finish_lock = threading.Lock()
        self._warned = False

    def start(self) -> None:
        """Show the live view and start the backend; raises if the ranks cannot start."""
        plan = self._plan
        try:
            if plan.display != "none":
                with interrupts.deferred():  # a display thread is closed by _finish, never lost
                    self._display = LiveDisplay(self._state, plan.display, self.stop, plan.block)
                # The live widget shows the ranks' output in its panel, not below it.
                self._state.panel_output = self._display.mode == "widget"
            self._runner.start(self._state, self._finish)
        except KeyboardInterrupt:
            self._finish(Outcome("stopped"))
            raise
        except BaseException as exc:
            self._finish(Outcome("failed", error=exc))
            raise

    @property
    def status(self) -> Status:
        return self._outcome.status if self._outcome is not None else "running"

    @property
    def history(self) -> list[dict[str, Any]]:
        """The metrics of ``nbddp.log``, averaged across ranks: one dict per row, in order,
        with ``step`` and, where known, ``epoch``. See ``display.metrics.History`` for the
        memory policy of very long runs."""
        return self._state.history_rows()

    @property
    def nodes(self) -> tuple[str, ...]:
        """The machines' addresses, in node-rank order (``("localhost",)`` on this one)."""
        return self._runner.nodes

    @property
    def duration(self) -> float:
        """Seconds since the launch, or its whole length once it ended."""
        return self._state.elapsed

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended or ``timeout`` seconds passed; True if it ended."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (every rank's with ``return_all``), or raise the run's error
        (:class:`nbddp.RunStopped` for a stopped run)."""
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        if not self._done.wait(timeout):
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
        if self._outcome.status == "stopped":
            raise RunStopped()
        if self._outcome.warning is not None and not self._warned:
            self._warned = True  # once per run, wherever its result is asked for
            warn_always(self._outcome.warning)
        return self._outcome.value

    @property
    def warning(self) -> str | None:
        """Why a run that succeeded was not one DDP job (its ranks' models differ, or they
        never communicated), or None; also shown by the panel and as an ``NbddpWarning``."""
        return self._outcome.warning if self._outcome is not None else None

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Terminate every rank; the status becomes "stopped". Returns True once they are
        gone, False if ``timeout`` seconds passed first."""
        if self._done.is_set():
            return True
        self._runner.stop()
        return self._done.wait(timeout)

    def _finish(self, outcome: Outcome) -> None:
        with interrupts.deferred(), self._finish_lock:  # whole, or a later wait() would hang
            if self._outcome is not None:
                return
            try:
                self._state.finish(outcome.status, outcome.error, outcome.warning)
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
