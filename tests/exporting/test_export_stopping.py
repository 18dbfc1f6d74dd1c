"""An exported script keeps stopping well under torchrun: the checkpoint directory of the
notebook's launch, every rank stopping at the same step on the batch file's stop file (Slurm's
signal before the time limit) or on SIGTERM, the marker that makes the batch file requeue, and
a next run that resumes to the uninterrupted run's parameters."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nbddp


@pytest.fixture(autouse=True, scope="module")
def by_value():
    """This module's functions travel by value, as a notebook's do."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def train(steps: int, pace: float) -> dict:
    """Deterministic DDP training that checks at every step and saves when it stops."""
    import time

    import torch

    import nbddp

    torch.manual_seed(0)
    model = nbddp.prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"model": model, "optimizer": optimizer}
    start = done = nbddp.restore(state) or 0
    for step in nbddp.progress(range(start, steps)):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 2 + nbddp.rank()))
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        done = step + 1
        if done == 3:
            nbddp.checkpoint(state, step=3)  # the test waits for this one: training is on
        time.sleep(pace)
    if nbddp.stopping():
        nbddp.checkpoint(state, step=done)
    weight = nbddp.unwrap(model).weight.detach().clone()
    return {"start": start, "end": done, "stopped": nbddp.stopping(), "weight": weight}


def torchrun(script: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script)]
    return subprocess.Popen(
        command,
        cwd=script.parent,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(path: Path, process: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def result(script: Path) -> dict:
    return pickle.loads(script.with_name(script.stem + ".result.pkl").read_bytes())


@pytest.mark.e2e
def test_the_stop_file_stops_every_rank_at_one_step_and_the_next_run_resumes(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    whole = nbddp.export(
        train,
        tmp_path / "whole.py",
        (60, 0.0),
        num_workers=2,
        device="cpu",
        checkpoint_dir=tmp_path / "other",
    )
    script = Path(
        nbddp.export(
            train,
            tmp_path / "train.py",
            (60, 0.1),
            num_workers=2,
            device="cpu",
            checkpoint_dir=checkpoints,
        )[0]
    )
    assert f"'checkpoint_dir': '{checkpoints}'" in script.read_text()
    stop = checkpoints / ".stop-1"
    ranks = torchrun(script, {"NBDDP_STOP_FILE": str(stop)})
    wait_for(checkpoints / "step-3", ranks)
    stop.touch()  # what the batch file's trap does on Slurm's signal
    output = ranks.communicate(timeout=120)[0]
    assert ranks.returncode == 0, output
    first = result(script)
    assert first["stopped"] and 3 <= first["end"] < 60, first
    assert (checkpoints / f"step-{first['end']}").is_dir()
    assert stop.with_name(".stop-1.stopped").exists()  # the batch file requeues on this

    again = torchrun(script, {})  # the requeued job: resumes, runs to the end
    output = again.communicate(timeout=180)[0]
    assert again.returncode == 0, output
    second = result(script)
    assert second["start"] == first["end"] and second["end"] == 60 and not second["stopped"]
    uninterrupted = torchrun(Path(whole[0]), {})
    output = uninterrupted.communicate(timeout=180)[0]
    assert uninterrupted.returncode == 0, output
    assert result(Path(whole[0]))["weight"].equal(second["weight"])


@pytest.mark.e2e
def test_sigterm_stops_every_rank_at_one_step_and_saves(tmp_path):
    script = Path(
        nbddp.export(
            train,
            tmp_path / "train.py",
            (10_000, 0.05),
            num_workers=2,
            device="cpu",
            checkpoint_dir=tmp_path,
        )[0]
    )
    ranks = torchrun(script, {})
    wait_for(tmp_path / "step-3", ranks)
    os.killpg(ranks.pid, signal.SIGTERM)  # as Slurm's scancel or a preemption does
    output = ranks.communicate(timeout=60)[0]
    assert "SignalException" in output  # torchrun itself says it was signalled
    stopped = result(script)  # every rank returned: the stop landed on all at one step
    assert stopped["stopped"] and stopped["end"] >= 3, output
    assert (tmp_path / f"step-{stopped['end']}" / "nbddp.json").exists()


@pytest.mark.unit
def test_the_batch_file_asks_for_the_signal_requeues_and_restarts(tmp_path):
    paths = nbddp.export(
        train, tmp_path / "train.py", (5, 0.0), num_workers=2, device="cpu", max_restarts=3
    )
    batch = Path(paths[2]).read_text()
    assert "#SBATCH --signal=B:USR1@" in batch and "#SBATCH --requeue" in batch
    assert "--max-restarts=3" in batch and 'scontrol requeue "$SLURM_JOB_ID"' in batch
    assert "--max-restarts 3" in Path(paths[0]).read_text()  # the docstring's torchrun line
    assert "/nbddp-checkpoints/train" in batch  # notebook_launch(train)'s directory
