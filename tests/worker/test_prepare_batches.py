"""F13: ``prepare_loader``'s batches on the rank's device (``worker/prepare.py``), with
``meta`` standing in for a GPU: what must stay on the CPU stays, objects move themselves."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence
from torch.utils.data import DataLoader, TensorDataset

from nbddp.worker.prepare import _PreparedLoader, _to_device

pytestmark = pytest.mark.unit
META = torch.device("meta")


def test_f13_a_packed_sequence_keeps_its_batch_sizes_on_the_cpu():
    """F13: it was rebuilt field by field as a namedtuple: ``batch_sizes`` went to the GPU,
    where RNNs refuse it."""
    packed = pack_sequence([torch.ones(3), torch.ones(2)])
    moved = _to_device(packed, META)
    assert moved.data.device == META and moved.batch_sizes.device.type == "cpu"


def test_f13_an_object_with_its_own_to_moves_itself_and_a_defaultdict_stays_one():
    """F13: a PyG ``Batch`` or a custom batch class stayed on the CPU; a ``defaultdict``
    raised (its class takes a factory first)."""

    class Batch:
        def __init__(self, x):
            self.x = x

        def to(self, device, non_blocking=False):
            return Batch(self.x.to(device, non_blocking=non_blocking))

    assert _to_device(Batch(torch.ones(1)), META).x.device == META
    batch = collections.defaultdict(list, {"x": torch.ones(2)})
    moved = _to_device(batch, META)
    assert type(moved) is collections.defaultdict and moved["x"].device == META
    assert moved["missing"] == []


def test_f13_batches_headed_for_a_gpu_are_pinned():
    """F13: ``pin_memory`` was copied, never set: ``non_blocking=True`` copies never
    overlapped with the work."""
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4)
    prepared = _PreparedLoader(loader, sampler=loader.sampler, target=torch.device("cuda", 0))
    assert prepared.pin_memory is True
    on_cpu = _PreparedLoader(loader, sampler=loader.sampler, target=None)
    assert on_cpu.pin_memory is False
