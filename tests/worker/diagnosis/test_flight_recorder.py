"""F1: the roll-call reads the flight recorder of the backend in use (``stacks.py``): NCCL
records into its own (``_dump_nccl_trace``), not gloo's CPU one (``_dump_fr_trace``)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from nbddp.wire.spec import JobSpec
from nbddp.worker.diagnosis import stacks
from nbddp.worker.rank import job

pytestmark = pytest.mark.unit

ACTIVE = {
    "profiling_name": "nccl:all_reduce",
    "collective_seq_id": 41,
    "input_sizes": [[1024]],
    "input_dtypes": ["Float"],
    "process_group": ("0", "default_pg"),
    "state": "scheduled",
    "time_created_ns": 2,
}
GLOO = {**ACTIVE, "profiling_name": "gloo:broadcast", "collective_seq_id": 3, "time_created_ns": 1}


@pytest.fixture
def recorders(monkeypatch):
    c10d = torch._C._distributed_c10d

    def dump(entries):
        return lambda **options: pickle.dumps({"entries": entries})

    monkeypatch.setattr(c10d, "_dump_fr_trace", dump([GLOO]), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", dump([ACTIVE]), raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    backend = {"name": "nccl"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])
    return backend


def test_f1_an_nccl_rank_names_the_collective_it_waits_in(recorders):
    """F1: on NCCL the roll-call read gloo's recorder: always empty."""
    collectives, note = stacks.recent_collectives()
    assert note == ""
    assert [(c.seq, c.op, c.completed) for c in collectives] == [(41, "all_reduce", False)]


def test_gloo_reads_its_own_and_a_mixed_group_both_in_time_order(recorders):
    recorders["name"] = "gloo"
    assert [c.op for c in stacks.recent_collectives()[0]] == ["broadcast"]
    recorders["name"] = "cpu:gloo,cuda:nccl"
    assert [c.op for c in stacks.recent_collectives()[0]] == ["broadcast", "all_reduce"]


def test_f1_an_nccl_rank_has_its_flight_recorder_on(monkeypatch):
    """F1: the recorder's buffer was set for gloo ranks only."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(job, "_rendezvous_store", lambda *args: None)
    joined = []
    monkeypatch.setattr("nbddp.worker.rank.world.join", lambda *args: joined.append(args))
    spec = JobSpec("", "", "r", (), "", "cuda", (0,), "nccl", return_all=False)
    job.join_process_group(spec, 0, 1)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000" and joined
