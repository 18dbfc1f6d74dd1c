"""Detached runs in one process, with real ranks and a real supervisor: the result, the
history and the output come back to the launching handle and to any later one; stop works
from any handle; a failing rank's error is rebuilt as its own class; the supervisor lives
outside this process's tree, and when it ends (or is killed) nothing of the run is left."""

from __future__ import annotations

import os
import signal
import sys

import psutil
import pytest
from conftest import TWO_CPU_QUIET, starts_nothing
from detached.support import (
    family,
    lock_holders,
    no_standby,
    runs_dir,
    supervisor_of,
    wait_gone,
)

import nbddp
from nbddp.detached import store
from nbddp.errors import NbddpError, NbddpWarning, RunStopped, WorkerError

__all__ = ["no_standby", "runs_dir"]  # autouse fixtures (support.py)


@pytest.fixture(autouse=True, scope="module")
def by_value():
    """This module's functions travel by value, as a notebook's do."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(autouse=True, scope="module")
def warm_helper():
    """The pre-warmed helper is ready, as in a kernel: supervisors are forked from it."""
    from nbddp.local import forkserver

    forkserver.prestart()
    assert forkserver.wait_until_ready(120)


def forked_from_the_helper(supervisor: psutil.Process) -> bool:
    return "nbddp.worker.helper.server" in " ".join(supervisor.cmdline())


def train(go: str, rows: int) -> dict:
    """Logs ``rows`` rows, then waits for the file ``go`` (so the test decides when it
    ends), prints, and returns a tensor."""
    import os
    import time

    import torch

    import nbddp

    for i in range(rows):
        nbddp.log(loss=float(i), rank_seen=float(nbddp.rank()))
    while not os.path.exists(go):
        time.sleep(0.01)
    nbddp.print("rank 0 is done")
    return {"sum": torch.arange(4.0) * (nbddp.world_size())}


@pytest.mark.ranks
def test_a_detached_run_gives_its_result_history_and_output_to_every_handle(tmp_path, capsys):
    go = str(tmp_path / "go")
    run = nbddp.notebook_launch(train, (go, 30), detach=True, **TWO_CPU_QUIET)
    assert run.detached and len(run.id) == 8
    assert nbddp.last_run() is run
    supervisor = supervisor_of(run.id)
    assert forked_from_the_helper(supervisor)
    assert supervisor.name() == "nbddp-detached"
    everything = family(supervisor)
    me = psutil.Process()
    # outside this process's tree, session and process group
    assert supervisor.pid not in [p.pid for p in me.children(recursive=True)]
    assert os.getsid(supervisor.pid) not in (os.getsid(0), os.getpgid(0))
    assert supervisor.ppid() != os.getpid()
    later = nbddp.attach(run.id, display="none")
    assert later.status == "running"
    assert [r.id for r in nbddp.runs()] == [run.id]
    open(go, "w").close()
    for handle in (run, later):
        value = handle.result(timeout=60)
        assert value["sum"].tolist() == [0.0, 2.0, 4.0, 6.0]
        assert [row["loss"] for row in handle.history] == [float(i) for i in range(30)]
        assert handle.history[0]["rank_seen"] == 0.5  # averaged across the ranks
    assert capsys.readouterr().out.count("rank 0 is done") == 2  # each handle showed it
    assert wait_gone(everything) == []
    assert nbddp.runs()[0].status == "succeeded"
    after = nbddp.attach(run.id, display="none")  # a finished run: replayed from its record
    assert after.status == "succeeded" and after.result()["sum"].tolist() == [0, 2, 4, 6]
    assert len(after.history) == 30
    assert after.duration == pytest.approx(run.duration, abs=1.0)
    run.forget()
    assert nbddp.runs() == []
    with pytest.raises(ValueError, match=f"no detached run {run.id} of yours"):
        nbddp.attach(run.id)


@pytest.mark.ranks
def test_a_stop_or_a_roll_call_from_another_handle_reaches_every_rank(tmp_path):
    run = nbddp.notebook_launch(train, (str(tmp_path / "never"), 5), detach=True, **TWO_CPU_QUIET)
    everything = family(supervisor_of(run.id))
    other = nbddp.attach(run.id, display="none")
    with pytest.raises(ValueError, match="still running"):
        other.forget()
    while len(other.history) < 5:  # the ranks wait for the file
        other.wait(0.05)
    for handle in (run, other):  # a roll-call through the supervisor, from either handle
        stacks = handle.stacks(timeout=10)
        assert stacks.missing == [], str(stacks)
        assert "train" in str(stacks)
    assert other.stop(timeout=30)
    assert run.wait(30)
    for handle in (run, other):
        assert handle.status == "stopped"
        with pytest.raises(RunStopped):
            handle.result()
    assert wait_gone(everything) == []
    assert nbddp.runs()[0].status == "stopped"


def counts_until_stopped() -> int:
    import time

    import nbddp

    for step in nbddp.progress(range(10**6), desc="steps"):
        nbddp.log(step=float(step))
        time.sleep(0.01)
    return step


@pytest.mark.ranks
def test_a_graceful_stop_from_another_handle_gives_every_handle_the_functions_value():
    run = nbddp.notebook_launch(counts_until_stopped, detach=True, **TWO_CPU_QUIET)
    other = nbddp.attach(run.id, display="none")
    while len(other.history) < 5:
        other.wait(0.05)
    assert other.stop(timeout=60, graceful=True)
    assert run.wait(30)
    for handle in (run, other):
        assert handle.status == "stopped"
        with pytest.warns(NbddpWarning, match=r"stopped gracefully at step \d+") as caught:
            value = handle.result()
        assert value >= 4 and "asked by run.stop(graceful=True)" in str(caught[0].message)
    assert nbddp.runs()[0].status == "stopped"
    later = nbddp.attach(run.id, display="none")  # from the record alone
    with pytest.warns(NbddpWarning, match="stopped gracefully"):
        assert later.result() == run.result()


def fails_on_rank_1() -> None:
    import nbddp

    if nbddp.rank() == 1:
        raise KeyError("rank 1 has no such key")
    nbddp.barrier()


@pytest.mark.ranks
def test_a_failing_rank_is_raised_as_its_own_class_in_every_handle():
    run = nbddp.notebook_launch(fails_on_rank_1, detach=True, **TWO_CPU_QUIET)
    for handle in (run, nbddp.attach(run.id, display="none")):
        with pytest.raises(KeyError) as raised:
            handle.result(timeout=60)
        assert isinstance(raised.value, WorkerError) and raised.value.rank == 1
        assert "rank 1 has no such key" in str(raised.value)
    assert nbddp.runs()[0].status == "failed"


@pytest.mark.ranks
@pytest.mark.parametrize("prewarm", ["1", "0"], ids=["warm", "cold"])
def test_a_killed_supervisor_takes_its_ranks_with_it_and_says_so(tmp_path, monkeypatch, prewarm):
    """Warm: its helper dies with it, and the ranks with the helper; cold: each rank dies
    with it."""
    from nbddp.local import rundir

    monkeypatch.setenv("NBDDP_PREWARM", prewarm)
    run = nbddp.notebook_launch(train, (str(tmp_path / "never"), 3), detach=True, **TWO_CPU_QUIET)
    supervisor = supervisor_of(run.id)
    while len(run.history) < 3:  # the ranks are running
        run.wait(0.05)
    everything = family(supervisor)
    assert len(everything) >= (4 if prewarm == "1" else 3)  # itself, (its helper), two ranks
    os.kill(supervisor.pid, signal.SIGKILL)
    with pytest.raises(NbddpError, match="ended without recording the run's end"):
        run.result(timeout=30)
    assert wait_gone(everything) == []
    # a killed process's other threads may still be exiting (holding its lock) a moment after
    # its main thread shows as a zombie
    assert store.find(run.id).wait_unsupervised(10.0), lock_holders(run.id)
    assert nbddp.runs()[0].status == "failed"
    again = nbddp.attach(run.id, display="none")
    assert again.status == "failed" and len(again.history) == 3
    rundir.sweep_stale_dirs()  # the killed supervisor could not remove the ranks' socket dir


@pytest.mark.ranks
def test_a_cold_start_works_the_same(tmp_path, monkeypatch):
    """Without the pre-warmed helper the supervisor is a fresh interpreter that leaves the
    tree itself, and its ranks start cold."""
    monkeypatch.setenv("NBDDP_PREWARM", "0")
    go = tmp_path / "go"
    go.touch()
    run = nbddp.notebook_launch(train, (str(go), 4), detach=True, **TWO_CPU_QUIET)
    supervisor = supervisor_of(run.id)
    assert not forked_from_the_helper(supervisor)
    assert supervisor.pid not in [p.pid for p in psutil.Process().children(recursive=True)]
    assert run.result(timeout=120)["sum"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert len(run.history) == 4


@pytest.mark.ranks
def test_a_bad_detach_is_refused_before_anything_starts(runs_dir):
    with starts_nothing(), pytest.raises(ValueError, match="detach='yes' must be True or False"):
        nbddp.notebook_launch(train, ("x", 1), detach="yes", **TWO_CPU_QUIET)
    assert not runs_dir.exists() or os.listdir(runs_dir) == []


def asks() -> str:
    breakpoint()
    try:
        return input("name? ")
    except EOFError as exc:
        return f"EOF: {exc}"


@pytest.mark.ranks
def test_a_rank_that_asks_for_a_line_is_refused_and_goes_on(runs_dir):
    """Nobody can answer a detached run: its breakpoints are skipped, input() raises, and the
    output says so; debug=True is refused before anything starts."""
    run = nbddp.notebook_launch(asks, detach=True, **TWO_CPU_QUIET)
    assert run.result(timeout=60).startswith("EOF: nbddp: a detached run has no input box")
    with open(store.find(run.id).join(store.OUTPUT)) as f:
        said = f.read()
    assert "a breakpoint on rank 0 at " in said and "was skipped" in said
    with pytest.raises(ValueError, match="debug=True opens pdb"):
        nbddp.notebook_launch(asks, detach=True, debug=True, **TWO_CPU_QUIET)
    assert [r.id for r in nbddp.runs()] == [run.id]


@pytest.mark.ranks
def test_one_rank_detached_runs_in_a_process_of_its_own(tmp_path):
    go = tmp_path / "go"
    go.touch()
    run = nbddp.notebook_launch(
        train, (str(go), 2), num_workers=1, device="cpu", display="none", detach=True
    )
    assert run.result(timeout=60)["sum"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert store.find(run.id).info["world_size"] == 1


@pytest.mark.ranks
def test_something_that_cannot_travel_is_named_before_anything_starts(runs_dir):
    import threading

    lock = threading.Lock()
    with starts_nothing(), pytest.raises(nbddp.SerializationError, match="lock"):
        nbddp.notebook_launch(lambda: lock, detach=True, **TWO_CPU_QUIET)
    assert not runs_dir.exists() or os.listdir(runs_dir) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
