"""One rank runs in the kernel itself: same API, a world-size-1 group, state restored after."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import nbddp
from nbddp import LaunchTimeout, WorkerError


def describe_world() -> dict:
    return {
        "pid": os.getpid(),
        "group": (dist.is_initialized(), dist.get_world_size(), dist.get_backend()),
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]),
        "api": (nbddp.rank(), nbddp.world_size(), str(nbddp.device())),
        "reduced": _all_reduce_two(),
    }


def _all_reduce_two() -> float:
    t = torch.tensor([2.0])
    dist.all_reduce(t)  # direct torch.distributed calls work in a world of one
    return t.item()


@pytest.mark.ranks
def test_one_worker_runs_in_the_kernel_with_a_world_of_one():
    assert not dist.is_initialized() and "RANK" not in os.environ
    facts = nbddp.notebook_launch(describe_world, num_workers=1, device="cpu")
    assert facts == {
        "pid": os.getpid(),
        "group": (True, 1, "gloo"),
        "env": ("0", "1", "127.0.0.1"),
        "api": (0, 1, "cpu"),
        "reduced": 2.0,
    }
    assert not dist.is_initialized() and "RANK" not in os.environ  # state as before
    assert nbddp.last_run().status == "succeeded" and nbddp.last_run().world_size == 1


@pytest.mark.ranks
def test_the_kernels_excepthook_is_left_as_it_was():
    # torch's init_process_group wraps sys.excepthook ("[rank0]: " on every line) for good
    hook = sys.excepthook
    for _ in range(3):
        nbddp.notebook_launch(describe_world, num_workers=1, device="cpu", display="none")
    assert sys.excepthook is hook


@pytest.mark.ranks
def test_auto_without_gpu_is_the_fallback():
    assert nbddp.notebook_launch(os.getpid) == os.getpid()


@pytest.mark.ranks
def test_fallback_unwraps_and_moves_results():
    model = nbddp.notebook_launch(lambda: nbddp.prepare_model(torch.nn.Linear(2, 2)))
    assert type(model) is torch.nn.Linear


def raises_type_error() -> None:
    raise TypeError("wrong shape")


@pytest.mark.ranks
def test_fallback_failure_is_a_worker_error_of_rank_zero():
    with pytest.raises(WorkerError) as info:
        nbddp.notebook_launch(raises_type_error, num_workers=1)
    assert (info.value.rank, info.value.exc_type) == (0, "TypeError")
    assert isinstance(info.value.__cause__, TypeError)
    assert "raises_type_error" in info.value.remote_traceback
    assert not dist.is_initialized()


def spins(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


@pytest.mark.ranks
def test_fallback_timeout_and_stop():
    started = time.monotonic()
    with pytest.raises(LaunchTimeout):
        nbddp.notebook_launch(spins, (60,), num_workers=1, timeout=0.5)
    assert time.monotonic() - started < 30  # the timeout, not fn's end (60 s)
    assert not dist.is_initialized()

    run = nbddp.notebook_launch(spins, (60,), num_workers=1, block=False)
    assert run.status == "running"
    run.stop()
    assert run.status == "stopped"
    assert not dist.is_initialized() and "RANK" not in os.environ


@pytest.mark.unit
def test_runtime_api_outside_any_launch():
    identity = (nbddp.rank(), nbddp.local_rank(), nbddp.world_size(), nbddp.is_main())
    assert identity == (0, 0, 1, True)
    assert nbddp.device() == torch.device("cpu")
    nbddp.barrier()  # a no-op
    model = torch.nn.Linear(1, 1)
    assert nbddp.prepare_model(model) is model
    assert nbddp.unwrap(model) is model
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    assert nbddp.prepare_loader(loader) is loader  # nothing to shard or move


@pytest.mark.unit
def test_print_is_rank_zero_only(capsys):
    nbddp.print("visible")
    assert capsys.readouterr().out == "visible\n"
