"""On a real Slurm (two nodes in two network namespaces, ``tests/slurm_cluster.py``): the batch
file ``nbddp.export`` writes runs the function across both nodes with ``srun torchrun``, gives
rank 0's value, fails as a whole when a rank fails, and leaves the queue empty."""

from __future__ import annotations

import pickle
import sys
import time

import pytest
from slurm_cluster import VETHS

import nbddp

pytestmark = [pytest.mark.e2e, pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(autouse=True, scope="module")
def by_value():
    """This module's functions travel by value, as a notebook's do."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def across_nodes(scale: float) -> list:
    import os

    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(dist.get_rank() + 1)) * scale
    dist.all_reduce(t)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (os.environ["GROUP_RANK"], os.environ.get("GLOO_SOCKET_IFNAME")))
    return [t.tolist(), seen]


def test_the_batch_file_runs_the_function_on_both_nodes(slurm, tmp_path):
    paths = nbddp.export(
        across_nodes,
        tmp_path / "train.py",
        (2.0,),
        num_workers=2,
        nodes=2,
        checkpoint_dir=tmp_path / "checkpoints",
    )
    state = slurm.submit_and_wait(paths[2], cwd=tmp_path)
    output = "".join(p.read_text() for p in tmp_path.glob("train-*.out"))
    assert state == "COMPLETED", state + output
    value = pickle.loads((tmp_path / "train.result.pkl").read_bytes())
    # one rank per node, each on the interface that reaches node 0 (not the hostname's address)
    assert value == [[6.0, 6.0, 6.0], [("0", VETHS[0]), ("1", VETHS[1])]]
    assert slurm.queue() == []


def fails_on_node_b() -> None:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 on node b gives up")
    time.sleep(3600)  # rank 0 would wait this long, were the job not ended as a whole


def test_a_failing_rank_ends_the_whole_job(slurm, tmp_path):
    paths = nbddp.export(
        fails_on_node_b,
        tmp_path / "fails.py",
        num_workers=2,
        nodes=2,
        checkpoint_dir=tmp_path / "checkpoints",
    )
    started = time.monotonic()
    state = slurm.submit_and_wait(paths[2], cwd=tmp_path)
    took = time.monotonic() - started
    output = "".join(p.read_text() for p in tmp_path.glob("fails-*.out"))
    assert state == "FAILED", state + output
    assert "ValueError: rank 1 on node b gives up" in output
    assert took < 240, f"the job ran on for {took:.0f} s after rank 1 failed"
    assert not (tmp_path / "fails.result.pkl").exists()
    assert slurm.queue() == []
