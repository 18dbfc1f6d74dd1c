"""The ``Run`` handle's life on a fake backend (the seam's test double, as httpx ships a
MockTransport): it is told its outcome once, whatever races to tell it, a stop reaches the
backend, a start that fails leaves a finished run, and ``result`` says what happened. No
process starts here."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from conftest import blocks

from nbddp import RunStopped
from nbddp.backend import Finish, Outcome, RunEvents
from nbddp.planning import make_plan
from nbddp.run import Run

pytestmark = pytest.mark.unit


class FakeBackend:
    """Does what a test says, when it says: ``finish`` is handed to the test."""

    nodes = ("localhost",)

    def __init__(self, fail_start: BaseException | None = None) -> None:
        self.finish: Finish | None = None
        self.events: RunEvents | None = None
        self.stops = 0
        self.told: list[Any] = []  # replies to the ranks' prompts
        self._fail_start = fail_start

    def start(self, events: RunEvents, finish: Finish) -> None:
        if self._fail_start is not None:
            raise self._fail_start
        self.events, self.finish = events, finish

    def stop(self) -> None:
        self.stops += 1
        assert self.finish is not None
        self.finish(Outcome("stopped"))

    def tell(self, message: Any) -> None:
        self.told.append(message)


def started(backend: FakeBackend) -> Run:
    plan = make_plan(num_workers=2, device="cpu", display="none", gpu_count=0)
    run = Run(plan, backend, "cpu")
    run.start()
    return run


def test_a_run_is_running_until_its_backend_finishes_it_and_then_returns_the_value():
    backend = FakeBackend()
    run = started(backend)
    assert run.status == "running" and not run.wait(timeout=0.01)
    assert backend.finish is not None
    backend.finish(Outcome("succeeded", value=42))
    assert run.wait(timeout=1) and run.status == "succeeded" and run.result() == 42


def test_only_the_first_outcome_counts_however_many_threads_report_one():
    backend = FakeBackend()
    run = started(backend)
    assert backend.finish is not None
    finish = backend.finish
    outcomes = [Outcome("succeeded", value=i) for i in range(8)]
    threads = [threading.Thread(target=finish, args=(o,)) for o in outcomes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    finish(Outcome("failed", error=ValueError("late")))
    first = run.result()
    assert first in range(8) and run.result() == first  # the same answer every time


def test_stop_reaches_the_backend_and_the_result_says_stopped():
    backend = FakeBackend()
    run = started(backend)
    assert run.stop(timeout=1)
    assert backend.stops == 1 and run.status == "stopped"
    with pytest.raises(RunStopped):
        run.result()
    assert run.stop() and backend.stops == 1  # an ended run is not stopped again


@pytest.mark.parametrize("error", [RuntimeError("cannot start"), KeyboardInterrupt()])
def test_a_start_that_raises_leaves_a_finished_run(error: BaseException):
    run = Run(
        make_plan(num_workers=2, device="cpu", display="none", gpu_count=0),
        FakeBackend(fail_start=error),
        "cpu",
    )
    with pytest.raises(type(error)):
        run.start()
    assert run.wait(timeout=0)  # nobody waits forever on a run that never started
    assert run.status == ("stopped" if isinstance(error, KeyboardInterrupt) else "failed")


def test_a_failed_run_raises_its_error_each_time_without_piling_up_frames():
    backend = FakeBackend()
    run = started(backend)
    assert backend.finish is not None
    backend.finish(Outcome("failed", error=ValueError("on rank 1")))
    depths = []
    for _ in range(3):
        with pytest.raises(ValueError, match="on rank 1") as info:
            run.result()
        depths.append(len(info.traceback))
    assert depths[0] == depths[-1]


def test_result_with_a_timeout_says_how_to_keep_waiting():
    run = started(FakeBackend())
    with pytest.raises(TimeoutError, match="call result\\(\\) again"):
        run.result(timeout=0.01)
    run.stop()


def test_a_run_reports_the_metrics_its_backend_saw():
    backend = FakeBackend()
    run = started(backend)
    events: Any = backend.events
    events.rows(0, 0, blocks((None, {"loss": 2.0})))
    events.rows(1, 0, blocks((None, {"loss": 4.0})))
    assert backend.finish is not None
    backend.finish(Outcome("succeeded"))
    assert [row["loss"] for row in run.history] == [3.0]  # averaged across the ranks
