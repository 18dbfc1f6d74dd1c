"""GPU paths; skipped without CUDA (see conftest), run on a GPU machine when one is lent."""

from __future__ import annotations

import os

import pytest
import torch

import nbddp

pytestmark = [pytest.mark.ranks, pytest.mark.gpu]


def where_am_i() -> dict:
    import torch.distributed as dist

    t = torch.ones(1, device=nbddp.device()) * (nbddp.rank() + 1)
    dist.all_reduce(t)
    return {
        "device": str(nbddp.device()),
        "backend": dist.get_backend(),
        "sum": t,  # on the GPU here; must arrive on the CPU
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
    }


def test_fallback_on_cuda_runs_in_the_kernel():
    facts = nbddp.notebook_launch(where_am_i, num_workers=1, device="cuda")
    assert facts["pid"] == os.getpid() and facts["device"] == "cuda:0"
    assert facts["sum"].device.type == "cpu" and facts["sum"].item() == 1.0


def test_two_worker_subprocesses_share_one_gpu_with_gloo():
    both = nbddp.notebook_launch(where_am_i, gpus=[0, 0], backend="gloo", return_all=True)
    assert [f["device"] for f in both] == ["cuda:0", "cuda:0"]
    assert all(f["pid"] != os.getpid() for f in both)
    assert both[0]["sum"].device.type == "cpu" and both[0]["sum"].item() == 3.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_on_every_gpu():
    facts = nbddp.notebook_launch(where_am_i, return_all=True)
    assert [f["backend"] for f in facts] == ["nccl"] * torch.cuda.device_count()
    assert facts[1]["device"] == "cuda:1"


def test_kernel_holding_gpu_memory_is_warned_about_once():
    held = torch.ones(1024, 1024, device="cuda:0")  # the kernel now holds a context + memory
    with pytest.warns(nbddp.NbddpWarning, match=r"GPU 0 \(.*GiB reserved") as caught:
        nbddp.notebook_launch(where_am_i, gpus=[0, 0], backend="gloo", display="none")
    assert len(caught) == 1
    assert issubclass(caught[0].category, UserWarning)  # shown by Python's default filters
    del held


HELD: torch.Tensor | None = None


def where_is_the_capture() -> tuple[str, str, float]:
    assert HELD is not None
    return str(HELD.device), str(nbddp.device()), float(HELD.sum())


def test_a_captured_cuda_tensor_arrives_on_each_ranks_own_device():
    import sys

    import cloudpickle

    global HELD
    HELD = torch.ones(1000, device="cuda:0")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as a notebook cell's code
    try:
        gpus = list(range(torch.cuda.device_count())) if torch.cuda.device_count() > 1 else [0, 0]
        backend = "nccl" if len(set(gpus)) == len(gpus) else "gloo"
        ranks = nbddp.notebook_launch(
            where_is_the_capture, gpus=gpus, backend=backend, return_all=True, display="none"
        )
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        HELD = None
    for held_on, own, total in ranks:
        assert held_on == own and own.startswith("cuda") and total == 1000.0


def logs_cuda_losses() -> None:
    for i in range(300):
        nbddp.log(loss=torch.tensor(float(i), device=nbddp.device()), step_size=0.5)


def test_cuda_tensors_logged_every_step_arrive_as_floats():
    run = nbddp.notebook_launch(
        logs_cuda_losses, num_workers=1, device="cuda", display="none", block=False
    )
    run.wait()
    losses = [row["loss"] for row in run.history]
    # a tensor compares equal to its float, so the type is checked on its own
    assert all(type(loss) is float for loss in losses), {type(loss) for loss in losses}
    assert losses == [float(i) for i in range(300)]
    both = nbddp.notebook_launch(
        logs_cuda_losses, gpus=[0, 0], backend="gloo", display="none", block=False
    )
    both.wait()
    assert len(both.history) == 300 and both.history[-1]["loss"] == 299.0
    assert all(type(row["loss"]) is float for row in both.history)


def logs_a_running_total() -> None:
    total = torch.zeros((), device=nbddp.device())
    for _ in range(300):
        total += 1  # in place, after the previous step logged it
        nbddp.log(total=total)


def test_a_cuda_tensor_changed_in_place_after_log_keeps_the_logged_value():
    run = nbddp.notebook_launch(
        logs_a_running_total, num_workers=1, device="cuda", display="none", block=False
    )
    run.wait()
    totals = [row["total"] for row in run.history]
    assert all(type(total) is float for total in totals), {type(total) for total in totals}
    assert totals == [float(i) for i in range(1, 301)]


def saves_on_the_gpu(steps: int) -> torch.Tensor:
    model = nbddp.prepare_model(torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    state = {"model": model, "optimizer": optimizer}
    start = nbddp.restore(state) or 0
    for _ in range(start, steps):
        x = torch.randn(8, 4, device=nbddp.device())
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    nbddp.checkpoint(state, step=steps)
    return nbddp.unwrap(model).weight.detach()


def test_checkpoints_of_cuda_ranks_restore_onto_their_devices(tmp_path):
    """DCP over the ranks' GPUs (NCCL where there are two, gloo sharing one otherwise)."""
    two = {"gpus": [0, 1]} if torch.cuda.device_count() > 1 else {"gpus": [0, 0], "backend": "gloo"}
    options = {**two, "display": "none", "checkpoint_dir": tmp_path}
    saved = nbddp.notebook_launch(saves_on_the_gpu, (3,), **options)
    again = nbddp.notebook_launch(saves_on_the_gpu, (3,), **options)  # restored, nothing to train
    assert torch.equal(saved, again) and saved.device.type == "cpu"
