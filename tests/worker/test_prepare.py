"""prepare_loader keeps every setting of the user's DataLoader; prepare_model wraps in DDP."""

from __future__ import annotations

import inspect
import multiprocessing

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nbddp
from nbddp.worker.context import Context, installed

pytestmark = pytest.mark.unit


def _collate(batch):
    return batch


def _init_worker(worker_id):
    return None


# A value other than the default for each DataLoader parameter prepare_loader copies.
NON_DEFAULT = {
    "batch_size": 3,
    "num_workers": 2,
    "collate_fn": _collate,
    "pin_memory": True,
    "drop_last": True,
    "timeout": 7.0,
    "worker_init_fn": _init_worker,
    "multiprocessing_context": multiprocessing.get_context("spawn"),
    "generator": torch.Generator().manual_seed(5),
    "prefetch_factor": 3,
    "persistent_workers": True,
    "pin_memory_device": "cpu",
    "in_order": False,
}


def test_every_dataloader_setting_survives_prepare_loader():
    parameters = set(inspect.signature(DataLoader.__init__).parameters)
    kept = parameters - {"self", "dataset", "shuffle", "sampler", "batch_sampler"}
    settings = {name: value for name, value in NON_DEFAULT.items() if name in parameters}
    assert set(settings) == kept, "a DataLoader parameter this test does not know yet"
    original = DataLoader(TensorDataset(torch.arange(30)), shuffle=True, **settings)
    with installed(Context(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"))):
        prepared = nbddp.prepare_loader(original)
    assert isinstance(prepared.sampler, DistributedSampler) and prepared.sampler.shuffle
    assert (prepared.sampler.rank, prepared.sampler.num_replicas) == (1, 2)
    for name in kept:
        assert getattr(prepared, name) is getattr(original, name) or getattr(
            prepared, name
        ) == getattr(original, name), name
