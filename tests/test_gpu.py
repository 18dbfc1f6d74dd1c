"""GPU paths; skipped without CUDA (see conftest), run on a GPU machine when one is lent."""

from __future__ import annotations

import os

import pytest
import torch

import nbddp

# The skip conditions are strings, evaluated when a test is set up: the ranks import this module
# by name, and nbddp's warm helper imports it again, so its import must not touch the GPU: on
# the first GPU check the helper refused it ("it started a native thread"), and these conditions
# were its only GPU calls at import.
pytestmark = [
    pytest.mark.ranks,
    pytest.mark.gpu,
    # after a test that ran on the GPU in this process (a one-rank run in the kernel), every
    # launch says the kernel holds a context there; two NCCL ranks on one GPU say time-sliced
    pytest.mark.filterwarnings("ignore:this kernel holds a CUDA context"),
    pytest.mark.filterwarnings("ignore:.*time-sliced, for correctness"),
]


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


@pytest.mark.skipif("torch.cuda.device_count() < 2", reason="needs 2 GPUs")
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


# -- #44: the GPU paths a CPU cannot show (each named for its finding) --------------------------

ONE_GPU_SHARED = {"gpus": [0, 0], "backend": "gloo", "display": "none"}


def nccl_ranks_possible() -> bool:
    """Two NCCL ranks: on two GPUs, or on one where the NCCL torch loads runs them (2.30+)."""
    from nbddp.devices import MULTI_RANK_NCCL, nccl_version

    version = nccl_version()
    return torch.cuda.device_count() > 1 or (version is not None and version >= MULTI_RANK_NCCL)


def two_nccl_ranks() -> dict:
    gpus = [0, 1] if torch.cuda.device_count() > 1 else [0, 0]
    return {"gpus": gpus, "backend": "nccl", "display": "none"}


def in_a_rank_of_a_session() -> dict:
    import warnings

    import torch.distributed as dist

    from nbddp.worker.diagnosis.stacks import recent_collectives

    t = torch.ones(8, device=nbddp.device())
    dist.all_reduce(t)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.barrier()
    return {
        "backend": dist.get_backend(),
        "ops": [c.op for c in recent_collectives()[0]],
        "device_warnings": [str(w.message) for w in caught if "device" in str(w.message)],
    }


def test_f1_f16_an_nccl_ranks_rollcall_names_its_collective_and_barrier_does_not_warn():
    """F1: the NCCL flight recorder is read (gloo's was, empty on NCCL); F16: the group is
    bound to the rank's GPU, so ``barrier()`` does not warn on rank 0."""
    with nbddp.Session(num_workers=1, device="cuda") as session:
        facts = session.run(in_a_rank_of_a_session, display="none")
    assert facts["backend"] == "nccl"
    assert "all_reduce" in facts["ops"] and facts["device_warnings"] == []


def waits_in_item(marks: str) -> None:
    import time
    from pathlib import Path

    import torch.distributed as dist

    if nbddp.rank() == 1:
        time.sleep(60)
    t = torch.ones(1024, device=nbddp.device())
    dist.all_reduce(t)
    Path(marks, "0").touch()
    t.item()  # the CUDA runtime spins here while NCCL waits for rank 1


@pytest.mark.skipif("not nccl_ranks_possible()", reason="needs two NCCL ranks (2 GPUs, NCCL 2.30+)")
def test_f2_the_stall_banner_shows_while_an_nccl_rank_spins_in_a_cuda_wait(tmp_path):
    """F2: the waiting rank burns a core in the CUDA wait: its CPU time read as work."""
    import time

    from conftest import wait_until

    run = nbddp.notebook_launch(
        waits_in_item, (str(tmp_path),), **two_nccl_ranks(), stall_after=4, block=False
    )
    try:
        assert wait_until(lambda: (tmp_path / "0").exists(), 60)
        started = time.monotonic()
        assert wait_until(lambda: run._rollcalls.watch.stalled is not None, 30)
        assert time.monotonic() - started < 30
        assert "all_reduce" in str(run._rollcalls.watch.stalled)
    finally:
        run.stop()


def asks_3_s_on_nccl() -> None:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("nccl", timeout=timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(40)
    t = torch.ones(1, device=nbddp.device())
    dist.all_reduce(t)
    t.item()


@pytest.mark.skipif("not nccl_ranks_possible()", reason="needs two NCCL ranks (2 GPUs, NCCL 2.30+)")
def test_f3_the_asked_timeout_takes_effect_on_nccl():
    """F3: NCCL's 10-minute default applied whatever the code asked."""
    import time

    started = time.monotonic()
    with pytest.raises(nbddp.WorkerError, match="collective timed out after 3 s"):
        nbddp.notebook_launch(asks_3_s_on_nccl, **two_nccl_ranks(), timeout=60)
    assert time.monotonic() - started < 30


def returns_right_after_its_all_reduce() -> float:
    import time

    import torch.distributed as dist

    if nbddp.rank() == 1:
        time.sleep(3)
    t = torch.ones(1, device=nbddp.device())
    dist.all_reduce(t)
    return 2.0 if nbddp.rank() == 0 else float(t.item())


@pytest.mark.skipif("not nccl_ranks_possible()", reason="needs two NCCL ranks (2 GPUs, NCCL 2.30+)")
def test_f8_a_rank_returning_right_after_an_nccl_collective_does_not_hang_its_peer():
    """F8: rank 0's queued all_reduce died with its process; rank 1 waited for NCCL's
    watchdog (10 minutes)."""
    values = nbddp.notebook_launch(
        returns_right_after_its_all_reduce, **two_nccl_ranks(), return_all=True, timeout=60
    )
    assert values == [2.0, 2.0]


def own_device_and_local_rank() -> tuple[str, str]:
    return str(nbddp.device()), os.environ["LOCAL_RANK"]


@pytest.mark.skipif("torch.cuda.device_count() < 2", reason="needs 2 GPUs")
def test_f4_one_rank_on_gpu_1_in_the_kernel_trains_on_gpu_1_and_leaves_gpu_0_alone():
    """F4: LOCAL_RANK was 0 (libraries trained on GPU 0) and the kernel was put back with
    ``set_device(0)``, which made a context there."""
    had_context = torch._C._cuda_hasPrimaryContext(0)
    assert nbddp.notebook_launch(own_device_and_local_rank, num_workers=1, gpus=[1]) == (
        "cuda:1",
        "1",
    )
    assert torch._C._cuda_hasPrimaryContext(0) == had_context


def allocates_a_gib_then_raises() -> None:
    held = torch.ones(2**28, device=nbddp.device())  # 1 GiB, referenced by this frame
    raise RuntimeError(f"CUDA out of memory (as the first try's) {held.numel()}")


def test_f6_a_failed_one_rank_run_gives_fns_gpu_memory_back():
    """F6: the kept error held fn's frames and their GPU tensors."""
    import gc

    before = torch.cuda.memory_allocated()
    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.notebook_launch(allocates_a_gib_then_raises, num_workers=1, device="cuda")
    kept = info.value  # noqa: F841  as IPython keeps sys.last_value
    gc.collect()
    assert torch.cuda.memory_allocated() <= before + 2**20


def precision_on_the_rank() -> str:
    return torch.get_float32_matmul_precision()


def test_f7_tf32_set_in_the_kernel_is_the_gpu_ranks():
    """F7: a 2-rank run without the kernel's TF32 ran fp32 matmuls several times slower."""
    torch.set_float32_matmul_precision("high")
    try:
        got = nbddp.notebook_launch(precision_on_the_rank, **ONE_GPU_SHARED, return_all=True)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert got == ["high", "high"]


def f10_two_nccl_ranks_on_gpu_0() -> float:
    import torch.distributed as dist

    t = torch.ones(1, device=nbddp.device())
    dist.all_reduce(t)
    return float(t.item())


def test_f10_two_nccl_ranks_on_one_gpu_run_or_are_refused_naming_the_nccl():
    """F10: "which NCCL refuses" was said whatever the NCCL; NCCL 2.30+ runs them."""
    from nbddp.devices import MULTI_RANK_NCCL, nccl_version, version_text

    version = nccl_version()
    if version is None or version < MULTI_RANK_NCCL:
        with pytest.raises(ValueError, match=version_text(version).replace(".", r"\.")):
            nbddp.notebook_launch(f10_two_nccl_ranks_on_gpu_0, gpus=[0, 0])
        return
    with pytest.warns(nbddp.NbddpWarning, match="time-sliced"):
        sums = nbddp.notebook_launch(
            f10_two_nccl_ranks_on_gpu_0, gpus=[0, 0], return_all=True, display="none"
        )
    assert sums == [2.0, 2.0]


def gpus_by_uuid() -> str:
    return os.environ["CUDA_VISIBLE_DEVICES"]


def test_gpus_by_uuid_as_nvidia_smi_lists_them():
    from nbddp.devices import inventory

    found = inventory()
    if not found:
        pytest.skip("no nvidia-smi")
    uuid = found[0].mig[0] if found[0].mig else found[0].uuid
    seen = nbddp.notebook_launch(gpus_by_uuid, gpus=[uuid, uuid], backend="gloo", display="none")
    assert seen == uuid


def returns_a_state_dict() -> dict:
    return torch.nn.Linear(4, 2).to(nbddp.device()).state_dict()


def test_f14_a_state_dict_from_the_kernels_gpu_comes_back_on_the_cpu():
    """F14: an OrderedDict was not walked: its tensors stayed on the GPU."""
    state = nbddp.notebook_launch(returns_a_state_dict, num_workers=1, device="cuda")
    assert {t.device.type for t in state.values()} == {"cpu"}


PACKED: object = None


def where_the_packed_batch_is() -> tuple[str, str]:
    from torch.utils.data import DataLoader

    loader = nbddp.prepare_loader(DataLoader([0], collate_fn=lambda _: PACKED))
    (batch,) = list(loader)
    return str(batch.data.device), str(batch.batch_sizes.device)


def test_f13_a_packed_sequence_reaches_the_gpu_with_its_batch_sizes_on_the_cpu():
    """F13: ``batch_sizes`` went to the GPU, where RNNs refuse it."""
    global PACKED
    from torch.nn.utils.rnn import pack_sequence

    PACKED = pack_sequence([torch.ones(3), torch.ones(2)])
    try:
        got = nbddp.notebook_launch(where_the_packed_batch_is, num_workers=1, device="cuda")
    finally:
        PACKED = None
    assert got == ("cuda:0", "cpu")


PINNED: torch.Tensor | None = None
SPARSE: torch.Tensor | None = None


def reads_the_captures() -> tuple[float, str, str]:
    assert PINNED is not None and SPARSE is not None
    return float(PINNED.sum()), str(SPARSE.device), str(SPARSE.layout)


def test_f17_f18_a_pinned_capture_stays_pinned_and_a_sparse_gpu_one_arrives_on_the_gpu():
    """F17: moved in place to /dev/shm, a pinned tensor became pageable; F18: a sparse CUDA
    tensor was rebuilt on the rank's CPU."""
    import sys

    import cloudpickle

    global PINNED, SPARSE
    PINNED = torch.ones(1 << 20).pin_memory()
    SPARSE = torch.eye(4, device="cuda").to_sparse()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        got = nbddp.notebook_launch(reads_the_captures, **ONE_GPU_SHARED, return_all=True)
        assert PINNED.is_pinned()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        PINNED = SPARSE = None
    assert got == [(float(1 << 20), "cuda:0", "torch.sparse_coo")] * 2


def test_f15_the_warning_names_only_the_gpu_the_kernel_uses():
    """F15: every selected GPU was named, with memory a context-less GPU does not hold."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    held = torch.ones(1024, device="cuda:0")
    if torch._C._cuda_hasPrimaryContext(1):
        pytest.skip("this kernel used GPU 1 already")
    with pytest.warns(nbddp.NbddpWarning) as caught:
        nbddp.notebook_launch(where_am_i, gpus=[0, 1], backend="gloo", display="none")
    said = " ".join(str(w.message) for w in caught)
    assert "GPU 0" in said and "GPU 1" not in said
    del held
