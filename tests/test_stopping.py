"""Stopping well with real ranks: a graceful stop lands at the same step on every rank and
returns fn's value; a resumed run ends with the parameters of an uninterrupted one; timeout=
stops gracefully; a run that never checks, or checks too late, is ended at once;
stop_grace bounds a slow stop; max_restarts restarts the world after a rank exits once at
step 7 and ends with the uninterrupted run's parameters; the one-rank run in the kernel stops
the same way."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TWO_CPU_QUIET, wait_until
from sharing import within

import nbddp
from nbddp import NbddpWarning, RunStopped, WorkerError


def counts_steps(pace: float) -> tuple[int, int, bool]:
    """A loop that checks through nbddp.progress; every rank says where it stopped."""
    done = 0
    for step in nbddp.progress(range(1_000_000)):
        nbddp.log(step=float(step))
        time.sleep(pace)
        done += 1
    return nbddp.rank(), done, nbddp.stopping()


def rows_logged(run: nbddp.Run, rows: int, timeout: float = 60) -> None:
    """Wait until the ranks logged ``rows`` steps: training is under way."""
    deadline = time.monotonic() + timeout
    while len(run.history) < rows:
        assert not run.wait(0.02) and time.monotonic() < deadline, run.status


def stopped_value(run: nbddp.Run) -> tuple[object, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = run.result()
    messages = [str(w.message) for w in caught if issubclass(w.category, NbddpWarning)]
    assert len(messages) == 1, messages
    return value, messages[0]


@pytest.mark.ranks
@pytest.mark.parametrize("world", [2, 3])
def test_a_graceful_stop_lands_at_the_same_step_on_every_rank_and_returns_the_value(world):
    run = nbddp.notebook_launch(
        counts_steps,
        (0.002 * world,),
        block=False,
        return_all=True,
        **{**TWO_CPU_QUIET, "num_workers": world},
    )
    rows_logged(run, 30)
    assert run.stop(graceful=True)
    assert run.status == "stopped"
    value, warning = stopped_value(run)
    assert [rank for rank, _, _ in value] == list(range(world))
    steps = {done for _, done, _ in value}
    assert len(steps) == 1 and min(steps) >= 30, value  # one step, on every rank
    assert all(stopping for _, _, stopping in value)
    assert f"at step {steps.pop()} (nbddp.progress)" in warning
    assert "asked by run.stop(graceful=True)" in warning


def train(until: int, pace: float, failing_once: str = "") -> dict[str, torch.Tensor]:
    """Deterministic DDP training on the CPU that checks every step, saves when it stops,
    and resumes; with ``failing_once``, rank 1 exits at step 7 the first time."""
    torch.manual_seed(0)
    model = nbddp.prepare_model(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    state = {"model": model, "optimizer": optimizer}
    done = start = nbddp.restore(state) or 0
    for step in range(start, until):
        if nbddp.stopping():
            break
        if failing_once and step == 7 and nbddp.rank() == 1 and not os.path.exists(failing_once):
            open(failing_once, "w").close()
            os._exit(3)  # a rank that dies, once
        x = torch.randn(16, 5, generator=torch.Generator().manual_seed(step * 4 + nbddp.rank()))
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        done = step + 1
        nbddp.log(step=float(done))
        if failing_once:
            nbddp.checkpoint(state, step=done)
        time.sleep(pace)
    if nbddp.stopping():
        nbddp.checkpoint(state, step=done)
    return {**nbddp.unwrap(model).state_dict(), "steps": torch.tensor([start, done])}


@pytest.mark.ranks
def test_a_run_resumed_after_a_graceful_stop_ends_with_the_uninterrupted_parameters(tmp_path):
    whole = nbddp.notebook_launch(train, (60, 0.0), checkpoint_dir=tmp_path / "w", **TWO_CPU_QUIET)
    options = {**TWO_CPU_QUIET, "checkpoint_dir": tmp_path / "cut"}
    run = nbddp.notebook_launch(train, (60, 0.05), block=False, **options)
    rows_logged(run, 10)
    run.stop(graceful=True)
    first, warning = stopped_value(run)
    stopped_at = int(first["steps"][1])
    assert 10 <= stopped_at < 60, first["steps"]
    assert f"Its checkpoint of step {stopped_at} is in" in warning
    resumed = nbddp.notebook_launch(train, (60, 0.0), **options)
    assert resumed["steps"].tolist() == [stopped_at, 60]
    for name in whole.keys() - {"steps"}:
        assert torch.equal(resumed[name], whole[name]), name


@pytest.mark.ranks
def test_timeout_stops_a_run_that_checks_gracefully_with_its_value():
    started = time.monotonic()
    with pytest.warns(NbddpWarning, match=r"stopped gracefully at step \d+.*timeout of 3 s"):
        value = nbddp.notebook_launch(counts_steps, (0.005,), timeout=3, **TWO_CPU_QUIET)
    assert time.monotonic() - started < 20
    assert value[1] > 0 and value[2] is True
    assert nbddp.last_run().status == "stopped"


def entered(folder: str | None) -> None:
    """Says that this rank runs fn: a file per rank in ``folder``."""
    if folder is not None:
        with open(os.path.join(folder, str(nbddp.rank())), "w"):
            pass


def every_rank_entered(folder: Path, world: int = 2) -> None:
    assert wait_until(lambda: len(os.listdir(folder)) == world, timeout=60), os.listdir(folder)


def never_checks(folder: str | None = None) -> None:
    entered(folder)
    time.sleep(120)


def checks_late(folder: str | None = None) -> None:
    entered(folder)
    time.sleep(120)
    nbddp.stopping()


@pytest.mark.ranks
@pytest.mark.parametrize("fn", [never_checks, checks_late])
def test_a_run_that_has_not_checked_is_stopped_at_once(fn, tmp_path):
    run = nbddp.notebook_launch(fn, (str(tmp_path),), block=False, **TWO_CPU_QUIET)
    every_rank_entered(tmp_path)  # the ranks run fn: it has not checked (and never will)
    started = time.monotonic()
    assert run.stop(graceful=True, timeout=20)
    assert time.monotonic() - started < within(10)  # at once, not after stop_grace (60 s)
    assert run.status == "stopped"
    with pytest.raises(RunStopped):
        run.result()


@pytest.mark.ranks
def test_a_timeout_of_a_run_that_never_checks_is_a_launch_timeout_at_once():
    started = time.monotonic()
    with pytest.raises(nbddp.LaunchTimeout, match="had not checked"):
        nbddp.notebook_launch(never_checks, timeout=2, **TWO_CPU_QUIET)
    assert time.monotonic() - started < within(15)


def saves_forever_after_the_stop(folder: str) -> None:
    for step in nbddp.progress(range(1_000_000)):
        if step == 1:
            entered(folder)  # it has passed a check: the stop lands at the next one
        time.sleep(0.01)
    time.sleep(120)  # "saving" for longer than stop_grace


@pytest.mark.ranks
def test_stop_grace_ends_a_graceful_stop_that_takes_too_long(tmp_path):
    run = nbddp.notebook_launch(
        saves_forever_after_the_stop, (str(tmp_path),), block=False, stop_grace=2, **TWO_CPU_QUIET
    )
    every_rank_entered(tmp_path)
    started = time.monotonic()
    assert run.stop(graceful=True, timeout=30)
    assert 1.5 < time.monotonic() - started < within(15)  # it had stop_grace, and no more
    assert run.status == "stopped" and "stop_grace" in run._state.snapshot().warning
    with pytest.raises(RunStopped):
        run.result()


@pytest.mark.ranks
def test_max_restarts_restarts_the_world_after_a_rank_exits_at_step_7(tmp_path):
    whole = nbddp.notebook_launch(train, (15, 0.0), checkpoint_dir=tmp_path / "w", **TWO_CPU_QUIET)
    marker = str(tmp_path / "failed-once")
    value = nbddp.notebook_launch(
        train, (15, 0.0, marker), checkpoint_dir=tmp_path / "r", max_restarts=1, **TWO_CPU_QUIET
    )
    run = nbddp.last_run()
    assert run.status == "succeeded" and os.path.exists(marker)
    assert value["steps"].tolist() == [7, 15]  # the restarted world resumed at step 7
    for name in whole.keys() - {"steps"}:
        assert torch.equal(value[name], whole[name]), name
    [(when, cause)] = run.restarts
    assert isinstance(cause, WorkerError) and cause.rank == 1 and cause.exitcode == 3
    assert when <= time.time()
    assert any("restart 1 of 1" in line for line in run._state.snapshot().recovery)


@pytest.mark.ranks
def test_without_restarts_left_the_failure_is_raised(tmp_path):
    marker = str(tmp_path / "failed-once")
    with pytest.raises(WorkerError, match="rank 1"):
        nbddp.notebook_launch(train, (15, 0.0, marker), checkpoint_dir=tmp_path, **TWO_CPU_QUIET)
    assert nbddp.last_run().restarts == []


@pytest.mark.ranks
def test_the_one_rank_run_in_the_kernel_stops_gracefully_on_its_timeout():
    with pytest.warns(NbddpWarning, match="stopped gracefully"):
        value = nbddp.notebook_launch(
            counts_steps, (0.001,), timeout=1, num_workers=1, device="cpu", display="none"
        )
    assert value[1] > 0 and value[2] is True
    assert nbddp.last_run().status == "stopped"


def raises_twice(counter: list[int]) -> int:
    counter.append(1)
    if len(counter) < 3:
        raise ValueError(f"attempt {len(counter)} fails")
    return len(counter)


@pytest.mark.ranks
def test_the_one_rank_run_in_the_kernel_restarts_too():
    attempts: list[int] = []
    value = nbddp.notebook_launch(
        raises_twice, (attempts,), num_workers=1, device="cpu", display="none", max_restarts=2
    )
    assert value == 3
    causes = [cause for _, cause in nbddp.last_run().restarts]
    assert [str(c.__cause__) for c in causes] == ["attempt 1 fails", "attempt 2 fails"]
    with pytest.raises(ValueError, match="attempt 2 fails"):
        nbddp.notebook_launch(
            raises_twice, ([],), num_workers=1, device="cpu", display="none", max_restarts=1
        )
