"""F6: a one-rank run in the kernel that fails lets go of ``fn``'s memory, although the
kernel keeps the error (IPython's ``sys.last_value``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import nbddp

pytestmark = pytest.mark.unit

held: list[weakref.ref] = []


def allocates_then_raises() -> None:
    activations = torch.ones(1 << 20)  # on a GPU: the memory an OOM retry needs back
    held.append(weakref.ref(activations))
    raise RuntimeError("CUDA out of memory (as a GPU would say)")


def test_f6_a_failed_one_rank_run_keeps_no_local_of_fn_alive_through_the_error():
    """F6: the error's ``__cause__`` carried ``fn``'s frames, so its tensors stayed until the
    next error or a restart: a retry with a smaller batch ran out of memory again."""
    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.notebook_launch(allocates_then_raises, num_workers=1, device="cpu", display="none")
    kept = info.value  # as IPython keeps sys.last_value
    gc.collect()
    assert held[-1]() is None
    assert "allocates_then_raises" in str(kept)  # its traceback, as text, is all there
    assert "activations = torch.ones" in str(kept) or "raise RuntimeError" in str(kept)
    assert isinstance(kept.__cause__, RuntimeError)
