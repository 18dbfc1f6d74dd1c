"""A session task stops well, as a launch does (real rank processes, 2 CPU ranks): a graceful
stop (``run.stop(graceful=True)``, the first interrupt, ``timeout=``) lands at one step on
every rank and returns the task's value; the ranks, their processes and their state stay for
the next task; what the task saved is named; a task that never checks is interrupted at once,
as before."""

from __future__ import annotations

import os
import time

import pytest
import torch
from conftest import wait_until
from sharing import within
from test_session import interrupt_when, notebook, task_after
from test_stopping import rows_logged, stopped_value

import nbddp
from nbddp import NbddpWarning, RunStopped

pytestmark = pytest.mark.ranks

OPTIONS = {"display": "none"}

NB = notebook(
    """
    def steps(pace):
        global reached  # stays on the rank: the next task reads it
        reached = 0
        for step in nbddp.progress(range(100_000)):
            nbddp.log(step=float(step))
            time.sleep(pace)
            reached = step + 1
        return nbddp.rank(), reached, nbddp.stopping()

    def read_reached():
        return reached

    def trains_and_saves():
        model = torch.nn.Linear(3, 1)
        done = 0
        while not nbddp.stopping():
            done += 1
            nbddp.log(step=float(done))
            time.sleep(0.01)
        nbddp.checkpoint({"model": model}, step=done)
        return done

    def never_checks(folder):
        global slept
        slept = "before"
        with open(os.path.join(folder, str(nbddp.rank())), "w"):
            pass  # this rank runs the task
        time.sleep(60)

    def read_slept():
        return slept
    """
)


@pytest.fixture
def session():
    with nbddp.Session(num_workers=2, device="cpu") as s:
        yield s


def test_a_graceful_stop_lands_at_one_step_and_the_ranks_keep_their_state(session):
    pids = {row["pid"] for row in session.status()}
    run = session.run(NB["steps"], (0.005,), block=False, return_all=True, **OPTIONS)
    rows_logged(run, 20)
    assert run.stop(graceful=True)
    assert run.status == "stopped"
    value, warning = stopped_value(run)
    [reached] = {done for _, done, _ in value}  # one step, on every rank
    assert reached >= 20 and all(stopped for _, _, stopped in value), value
    assert f"at step {reached} (nbddp.progress)" in warning
    assert "asked by run.stop(graceful=True)" in warning
    # the same processes, and what the task left in their namespace
    assert {row["pid"] for row in session.status()} == pids
    assert session.run(NB["read_reached"], return_all=True, **OPTIONS) == [reached, reached]


def test_the_first_interrupt_stops_a_task_that_checks_gracefully(session):
    before = nbddp.last_run()
    under_way = interrupt_when(lambda: (run := task_after(before)) and len(run.history) >= 5)
    try:
        with pytest.warns(NbddpWarning, match=r"stopped gracefully at step \d+.*the interrupt"):
            rank, reached, stopped = session.run(NB["steps"], (0.005,), **OPTIONS)
    except KeyboardInterrupt:  # not graceful: fail here, not the whole test session
        pytest.fail("the first interrupt was not a graceful stop")
    assert under_way.is_set() and rank == 0 and reached > 0 and stopped
    assert nbddp.last_run().status == "stopped"
    assert session.run(NB["read_reached"], **OPTIONS) == reached


def test_the_timeout_stops_a_task_that_checks_gracefully_and_names_its_checkpoint(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a session's tasks save under ./nbddp-checkpoints/session
    with nbddp.Session(num_workers=2, device="cpu") as session:
        started = time.monotonic()
        with pytest.warns(NbddpWarning, match="asked by the timeout of 2 s") as caught:
            done = session.run(NB["trains_and_saves"], timeout=2, **OPTIONS)
    assert time.monotonic() - started < 20 and done > 0
    [warning] = [str(w.message) for w in caught]
    saved = tmp_path / "nbddp-checkpoints" / "session"
    assert f"Its checkpoint of step {done} is in {saved}" in warning
    assert any(saved.iterdir())


def test_a_task_that_never_checks_is_interrupted_at_once_and_the_session_goes_on(session, tmp_path):
    run = session.run(NB["never_checks"], (str(tmp_path),), block=False, **OPTIONS)
    # the ranks are in time.sleep(60)
    assert wait_until(lambda: len(os.listdir(tmp_path)) == 2, timeout=60)
    started = time.monotonic()
    assert run.stop(graceful=True, timeout=20)
    assert time.monotonic() - started < within(10)  # at once, not after a grace
    with pytest.raises(RunStopped):
        run.result()
    assert session.run(NB["read_slept"], **OPTIONS) == "before"
    assert torch.equal(session.run(torch.ones, (2,), **OPTIONS), torch.ones(2))
