"""The handle of one launch: its status, its outcome, and the way to stop it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Literal

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

    def __init__(self, plan: LaunchPlan, stopper: Callable[[], None] | None = None) -> None:
        global _last
        self.world_size = plan.world_size
        self.device = plan.device
        self.backend = plan.backend
        self.history: list[dict[str, Any]] = []
        self._stopper = stopper
        self._status: Status = "running"
        self._value: Any = None
        self._error: BaseException | None = None
        self._started = time.monotonic()
        self._ended: float | None = None
        self._done = threading.Event()
        _last = self

    @property
    def status(self) -> Status:
        return self._status

    @property
    def duration(self) -> float:
        """Seconds since the launch, or its whole length once it ended."""
        return (self._ended or time.monotonic()) - self._started

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended or ``timeout`` seconds passed; True if it ended."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (every rank's with ``return_all``), or raise the run's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"the run is still going after waiting {timeout:g} s; call result() again "
                "to keep waiting, or stop() to end it."
            )
        if self._error is not None:
            raise self._error
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
        self._value, self._error = value, error
        self._ended = time.monotonic()
        self._status = status
        self._done.set()

    def __repr__(self) -> str:
        return (f"<nbddp.Run {self._status}: {self.world_size} × {self.device} "
                f"({self.backend}), {self.duration:.1f} s>")
