"""On a real Slurm (``tests/slurm_cluster.py``): the batch file ``nbddp.export`` writes turns
Slurm's signal before the time limit into a graceful stop on both nodes (every rank at one
step, then the function's own checkpoint), requeues the job, and the requeued job resumes from
that checkpoint to the parameters of an uninterrupted run.

Two tests: the whole path with the signal sent by ``scancel --signal=USR1 --batch`` (what
Slurm sends the batch shell, without waiting a minute for it), and Slurm's own signal before a
real time limit, which takes minutes of Slurm's clock (mostly waiting: it runs beside other
tests) and stops once the job is requeued."""

from __future__ import annotations

import pickle
import sys
import time

import pytest
from conftest import wait_until

import nbddp

pytestmark = [pytest.mark.e2e, pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(autouse=True, scope="module")
def by_value():
    """This module's functions travel by value, as a notebook's do."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def train(steps: int, pace: float, under_way: str | None = None) -> dict:
    """Deterministic DDP training that checks at every step and saves when it stops; each
    start says where it began in the job's output. ``under_way``: a file made once rank 0
    finished a step."""
    import time

    import torch

    import nbddp

    torch.manual_seed(0)
    model = nbddp.prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"model": model, "optimizer": optimizer}
    start = done = nbddp.restore(state) or 0
    nbddp.print(f"training from step {start}")
    for step in nbddp.progress(range(start, steps)):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 2 + nbddp.rank()))
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        done = step + 1
        if under_way and done == 1 and nbddp.rank() == 0:
            open(under_way, "w").close()
        time.sleep(pace)
    if nbddp.stopping():
        nbddp.checkpoint(state, step=done)
        nbddp.print(f"stopped at step {done} on every rank")
    return {"start": start, "end": done, "weight": nbddp.unwrap(model).weight.detach().clone()}


STEPS = 400


@pytest.mark.timeout(400)
def test_the_stop_signal_checkpoints_and_the_requeued_job_resumes(slurm, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    under_way = tmp_path / "under-way"
    paths = nbddp.export(
        train,
        tmp_path / "train.py",
        (STEPS, 0.02, str(under_way)),
        num_workers=2,
        nodes=2,
        device="cpu",
        checkpoint_dir=checkpoints,
    )
    done = slurm.run(["sbatch", "--parsable", "--time=10", paths[2]], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    assert wait_until(under_way.exists, timeout=180), _output(tmp_path)
    # what Slurm does before the time limit (--signal=B:USR1): the signal to the batch shell
    signalled = slurm.run(["scancel", "--signal=USR1", "--batch", job])
    assert signalled.returncode == 0, signalled.stderr
    requeued = _requeued(slurm, job, tmp_path, deadline=time.monotonic() + 300)
    # Slurm holds a requeued job for its credentials' lifetime (tests/slurm_cluster.py: 10 s):
    # starting it sooner ("StartTime=now") races slurmd, which refuses the job's revoked
    # credential until then ("Job credential revoked": stop 47's CI)
    assert wait_until(lambda: not _queued(slurm, job), timeout=240), slurm.queue()
    output = _output(tmp_path)
    starts = [
        int(line.rsplit(" ", 1)[1]) for line in output.splitlines() if "training from" in line
    ]
    stopped = [int(line.split()[3]) for line in output.splitlines() if "stopped at step" in line]
    said = output + _said(slurm, job)
    assert requeued and len(starts) == 2 and len(stopped) == 1, said
    assert starts == [0, stopped[0]] and 0 < stopped[0] < STEPS, said  # resumed where it stopped
    value = pickle.loads((tmp_path / "train.result.pkl").read_bytes())
    whole = nbddp.notebook_launch(
        train,
        (STEPS, 0.0),
        num_workers=2,
        device="cpu",
        display="none",
        checkpoint_dir=tmp_path / "whole",
    )
    assert value["end"] == STEPS and value["weight"].equal(whole["weight"])
    assert slurm.queue() == []


@pytest.mark.timeout(600)
def test_slurms_own_signal_before_the_time_limit_stops_every_rank_at_one_step(slurm, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    paths = nbddp.export(
        train,
        tmp_path / "train.py",
        (10 * STEPS, 0.1),
        num_workers=2,
        nodes=2,
        device="cpu",
        checkpoint_dir=checkpoints,
    )
    # A two-minute limit and the signal 60 s before it: Slurm itself sends it at the first of
    # its time-limit checks (every 30 s) that finds the limit within 60 + 30 s, so 30 to 60 s
    # in, while the ranks train (they start within seconds); 400 s of training cannot end first.
    done = slurm.run(
        ["sbatch", "--parsable", "--time=2", "--signal=B:USR1@60", paths[2]], cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    assert _requeued(slurm, job, tmp_path, deadline=time.monotonic() + 400)
    # the resumed run is the other test's: this one ends the job here
    slurm.run(["scancel", job])
    assert wait_until(lambda: not _queued(slurm, job), timeout=120), slurm.queue()
    output = _output(tmp_path)
    stopped = [int(line.split()[3]) for line in output.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1 and 0 < stopped[0] < 10 * STEPS, output
    assert "training from step 0" in output and any(checkpoints.iterdir()), output
    assert slurm.queue() == []


def _said(slurm, job: str) -> str:
    """What Slurm says of the job and did lately, for a failure's message."""
    shown = slurm.run(["scontrol", "show", "job", job])
    log = (slurm.root / "slurmctld.log").read_text()[-3000:]
    return f"\n--- scontrol show job\n{shown.stdout}{shown.stderr}\n--- slurmctld.log\n{log}"


def _queued(slurm, job: str) -> bool:
    return any(line.startswith(job) for line in slurm.queue())


def _requeued(slurm, job: str, directory, deadline: float) -> bool:
    """Until the batch file said it requeued the job, and Slurm holds it pending."""
    while "requeued" not in _output(directory):
        assert _queued(slurm, job) and time.monotonic() < deadline, _output(directory)
        time.sleep(0.5)  # a poll of the job's output, not a wait standing for an event
    _wait_for_pending(slurm, job)
    return True


def _output(directory) -> str:
    return "".join(p.read_text() for p in sorted(directory.glob("train-*.out")))


def _wait_for_pending(slurm, job: str) -> None:
    deadline = time.monotonic() + 60
    while f"{job} PENDING" not in slurm.queue():
        assert time.monotonic() < deadline, slurm.queue()
        time.sleep(0.5)
