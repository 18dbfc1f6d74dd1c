"""On a real Slurm (``tests/slurm_cluster.py``): the batch file ``nbddp.export`` writes turns
Slurm's signal before the time limit into a graceful stop on both nodes (every rank at one
step, then the function's own checkpoint), requeues the job, and the requeued job resumes from
that checkpoint to the parameters of an uninterrupted run."""

from __future__ import annotations

import pickle
import sys
import time

import pytest

import nbddp

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(autouse=True, scope="module")
def by_value():
    """This module's functions travel by value, as a notebook's do."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def train(steps: int, pace: float) -> dict:
    """Deterministic DDP training that checks at every step and saves when it stops; each
    start says where it began in the job's output."""
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
        time.sleep(pace)
    if nbddp.stopping():
        nbddp.checkpoint(state, step=done)
        nbddp.print(f"stopped at step {done} on every rank")
    return {"start": start, "end": done, "weight": nbddp.unwrap(model).weight.detach().clone()}


STEPS = 1500


@pytest.mark.timeout(900)
def test_the_signal_before_the_time_limit_checkpoints_and_the_requeued_job_resumes(slurm, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    paths = nbddp.export(
        train,
        tmp_path / "train.py",
        (STEPS, 0.1),
        num_workers=2,
        nodes=2,
        device="cpu",
        checkpoint_dir=checkpoints,
    )
    # A three-minute limit and the signal 60 s before it: Slurm itself sends it (up to a
    # minute early, its man page says) while the ranks train; 150 s of training cannot end
    # first.
    done = slurm.run(
        ["sbatch", "--parsable", "--time=3", "--signal=B:USR1@60", paths[2]], cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    requeued = False
    deadline = time.monotonic() + 800
    while any(line.startswith(job) for line in slurm.queue()):
        assert time.monotonic() < deadline, _output(tmp_path)
        if not requeued and "requeued" in _output(tmp_path):
            _wait_for_pending(slurm, job)
            # Slurm holds a requeued job for two minutes; the test does not wait them out,
            # and gives the second run time to finish (a real job would stop, and be
            # requeued, again)
            slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=6"])
            requeued = True
        time.sleep(1)
    output = _output(tmp_path)
    starts = [
        int(line.rsplit(" ", 1)[1]) for line in output.splitlines() if "training from" in line
    ]
    stopped = [int(line.split()[3]) for line in output.splitlines() if "stopped at step" in line]
    assert requeued and len(starts) == 2 and len(stopped) == 1, output
    assert starts == [0, stopped[0]] and 0 < stopped[0] < STEPS, output  # resumed where it stopped
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


def _output(directory) -> str:
    return "".join(p.read_text() for p in sorted(directory.glob("train-*.out")))


def _wait_for_pending(slurm, job: str) -> None:
    deadline = time.monotonic() + 60
    while f"{job} PENDING" not in slurm.queue():
        assert time.monotonic() < deadline, slurm.queue()
        time.sleep(0.5)
