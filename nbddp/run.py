"""The handle of one launch: its status, its outcome, and the way to stop it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal

from .display import LiveDisplay
from .display.state import RunState
from .errors import NbddpError
from .plan import LaunchPlan

Status = Literal["running", "succeeded", "failed", "stopped"]

_last: Run | None = None


def last_run() -> Run | None:
    """The most recent :class:`Run` of this kernel, blocking launches included."""
    return _last


class Run:
    """One launch, running or ended. Thread-safe; returned by ``notebook_launch(block=False)``.

    ``status`` is "running", then one of "succeeded", "failed" or "stopped".
    """

    def __init__(self, plan: LaunchPlan, device_name: str | None = None) -> None:
        global _last
        self.world_size = plan.world_size
        self.device = plan.device
        self.backend = plan.backend
        self.state = RunState(plan.world_size, plan.device, plan.backend,
                              device_name or plan.device)
        self._display: LiveDisplay | None = None
        self._stopper: Callable[[], None] | None = None
        self._status: Status = "running"
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        _last = self

    def _show(self, mode: str, blocking: bool) -> None:
        """Start the live view (``display=`` of the launch); "none" shows nothing."""
        if mode != "none":
            self._display = LiveDisplay(self.state, mode, self.stop, blocking)

    @property
    def _shows_panel(self) -> bool:
        """The live widget is up: worker output goes into the panel, not below it."""
        return self._display is not None and self._display.mode == "widget"

    @property
    def status(self) -> Status:
        return self._status

    @property
    def history(self) -> list[dict[str, Any]]:
        """The metrics of ``nbddp.log``, averaged across ranks: one dict per row, in order,
        with ``step`` and, where known, ``epoch``. See ``display.state.History`` for the
        memory policy of very long runs."""
        with self.state.changed:
            return list(self.state.history.rows())

    @property
    def duration(self) -> float:
        """Seconds since the launch, or its whole length once it ended."""
        return self.state.elapsed

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended or ``timeout`` seconds passed; True if it ended."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (every rank's with ``return_all``), or raise the run's error."""
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"the run is still going after waiting {timeout:g} s; call result() again "
                "to keep waiting, or stop() to end it."
            )
        if self._error is not None:
            raise self._error.with_traceback(None)  # fresh each time: no frames pile up
        if self._status == "stopped":
            raise NbddpError("the run was stopped before it finished, so it has no result.")
        return self._value

    def stop(self, timeout: float | None = 30.0) -> None:
        """Terminate every worker; the status becomes "stopped". Returns once they are gone."""
        if self._done.is_set():
            return
        if self._stopper is not None:
            self._stopper()
        self._done.wait(timeout)

    def _finish(
        self, status: Status, value: Any = None, error: BaseException | None = None
    ) -> None:
        if self._done.is_set():
            return
        self.state.finish(status, error)
        if self._display is not None:  # the final panel is drawn before anyone is told
            self._display.close()
        self._value, self._error = value, error
        self._status = status
        self._done.set()

    def __repr__(self) -> str:
        return (f"<nbddp.Run {self._status}: {self.world_size} × {self.device} "
                f"({self.backend}), {self.duration:.1f} s>")
