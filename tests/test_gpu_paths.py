"""The GPU paths' defects a CPU shows too, as a user hits them (#44), with 2 gloo ranks:
a function with the usual TF32 and cuDNN lines launches; the collective timeout the code asks
for fails the run in about that time; a person in pdb on one rank longer than it does not fail
the other; the kernel's torch settings come back from every rank."""

from __future__ import annotations

import builtins
import sys
import time
from datetime import timedelta

import cloudpickle
import pytest
import torch
import torch.backends.cudnn as cudnn
from conftest import TWO_CPU_QUIET

import nbddp
from nbddp.diagnosis import input_box

pytestmark = pytest.mark.ranks


@pytest.fixture
def like_notebook_code():
    """This module's functions by value, as a notebook cell's are."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def kernel_settings():
    """The notebook's cell: TF32, cuDNN, a default dtype, deterministic algorithms; undone."""
    from nbddp.wire import torch_settings

    saved = torch_settings.snapshot(random=False)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.set_float32_matmul_precision("highest")
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    torch_settings.apply(saved)


def with_gpu_setup_lines():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    return cudnn.is_acceptable(torch.ones(1)), nbddp.rank()


def test_a_function_with_the_tf32_and_cudnn_lines_launches(like_notebook_code):
    """It failed with ``SerializationError: ... cannot pickle 'CudnnModule' object``."""
    assert nbddp.notebook_launch(with_gpu_setup_lines, **TWO_CPU_QUIET, return_all=True) == [
        (False, 0),
        (False, 1),
    ]


def settings_now():
    return (
        torch.get_float32_matmul_precision(),
        str(torch.get_default_dtype()),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.rand(1).item(),
    )


def test_f7_the_kernels_torch_settings_come_back_from_every_rank(kernel_settings):
    """F7 (as a fork launcher's children inherit them); the random state too, until fn
    seeds: every rank draws what the kernel would draw next."""
    torch.manual_seed(11)
    expected = settings_now()
    torch.manual_seed(11)
    assert nbddp.notebook_launch(settings_now, **TWO_CPU_QUIET, return_all=True) == [expected] * 2
    with nbddp.Session(num_workers=2, device="cpu") as session:
        first = session.run(settings_now, return_all=True, display="none")
        later = session.run(settings_now, return_all=True, display="none")
    assert first == [expected] * 2
    assert later[0][:-1] == expected[:-1]  # settings again; the ranks' own random stream
    assert later[0][-1] != expected[-1]


def asks_3_s_and_rank_1_is_late(mark):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(20)  # ended with the run long before
    t = torch.ones(1)
    with open(mark, "w") as f:
        f.write(repr(time.time()))
    dist.all_reduce(t)


def test_f3_the_asked_3_s_timeout_fails_the_run_in_about_3_s(tmp_path):
    """F3: the run waited the 20 s (the group existed: the asked timeout was dropped)."""
    mark = tmp_path / "in-all-reduce"
    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.notebook_launch(asks_3_s_and_rank_1_is_late, (str(mark),), **TWO_CPU_QUIET)
    waited = time.time() - float(mark.read_text())
    assert info.value.rank == 0, info.value
    assert "collective timed out after 3 s: all_reduce #1 on the default group, waiting " in str(
        info.value
    )
    assert "waiting for rank 1" in str(info.value)
    assert "dist.all_reduce(t)" in str(info.value)  # where fn waits
    assert 2.9 < waited < 15, waited  # timing is the feature: about 3 s, generously


def accelerate_asks_3_s(mark):
    import torch.distributed as dist
    from accelerate import Accelerator, InitProcessGroupKwargs

    handler = InitProcessGroupKwargs(timeout=timedelta(seconds=3))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    if accelerator.process_index == 1:
        time.sleep(20)
    with open(mark, "w") as f:
        f.write(repr(time.time()))
    dist.all_reduce(torch.ones(1))


def test_f3_accelerates_init_process_group_kwargs_timeout_takes_effect(tmp_path):
    """F3: Accelerate skips init_process_group in a rank whose group exists, and with it the
    timeout (the HF Trainer's ddp_timeout goes the same way)."""
    pytest.importorskip("accelerate")
    mark = tmp_path / "in-all-reduce"
    with pytest.raises(nbddp.WorkerError, match="collective timed out after 3 s"):
        nbddp.notebook_launch(accelerate_asks_3_s, (str(mark),), **TWO_CPU_QUIET)
    assert time.time() - float(mark.read_text()) < 15


def rank_1_in_pdb(mark):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    if dist.get_rank() == 1:
        breakpoint()  # the person answers after three timeouts
    else:
        with open(mark, "w") as f:
            f.write(repr(time.time()))
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t[0])


def test_f3_pdb_on_one_rank_longer_than_the_timeout_does_not_fail_the_other(tmp_path, monkeypatch):
    """F3: rank 0 waits in all_reduce while a person keeps rank 1 in pdb for three times
    the asked timeout; then ``c``: both ranks finish the all_reduce."""
    mark = tmp_path / "rank-0-waits"
    prompts: list[str] = []
    held: list[float] = []

    def person(prompt: object = "") -> str:
        prompts.append(str(prompt))
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(6)  # the person reads the code: three times the asked timeout
        held.append(time.time() - float(mark.read_text()))
        return "c"

    monkeypatch.setattr(input_box, "missing", lambda: "")  # as in a kernel with an input box
    monkeypatch.setattr(builtins, "input", person)
    values = nbddp.notebook_launch(rank_1_in_pdb, (str(mark),), **TWO_CPU_QUIET, return_all=True)
    assert values == [2.0, 2.0]
    assert prompts == ["(Pdb rank 1) "]
    assert held[0] > 6  # rank 0 sat in all_reduce longer than three timeouts
