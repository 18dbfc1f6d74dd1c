"""Captured GPU tensors on their way to the ranks (``wire/payload.py``, ``wire/in_place.py``),
checked with tensors that say they are on a GPU and with ``meta`` standing in for the rank's
own device."""

from __future__ import annotations

import pytest
import torch

from nbddp.wire import in_place
from nbddp.wire.call import dumps_call, loads_call

pytestmark = pytest.mark.unit


class SparseOnGpu(torch.Tensor):
    """A tensor that says it is on a GPU and comes to the CPU as a sparse tensor."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)

    def detach(self):  # type: ignore[override]
        return self

    def cpu(self, *args, **kwargs):  # type: ignore[override]
        return self.as_subclass(torch.Tensor).to_sparse()


def keep(tensor):
    return tensor


def test_f18_a_sparse_gpu_tensor_arrives_on_the_ranks_device():
    """F18: only plain dense tensors took the on-device path; a sparse, quantized or subclass
    CUDA tensor was rebuilt on the rank's CPU."""
    captured = torch.tensor([0.0, 2.0, 0.0]).as_subclass(SparseOnGpu)
    call = dumps_call(keep, (captured,), {})
    try:
        fn, args, _ = loads_call(call.stream, call.layout, call.fds, torch.device("meta"))
    finally:
        call.close()
    arrived = fn(*args)
    assert arrived.layout == torch.sparse_coo and arrived.device.type == "meta"


def test_f17_a_pinned_tensor_is_not_moved_to_shared_memory(monkeypatch):
    """F17: sharing a pinned storage in place put it on pageable /dev/shm pages: the kernel's
    later non_blocking copies from it became synchronous."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: True)
    tensor = torch.ones(1 << 16)
    assert in_place.storage_file(tensor) is None
    assert not tensor.is_shared()
