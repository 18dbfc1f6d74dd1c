"""Every bad argument is a ValueError raised before any process starts, saying what to do."""

import re

import pytest
from conftest import starts_nothing

import nbddp
from nbddp.planning import make_plan

pytestmark = pytest.mark.unit


def _noop() -> None:
    pass


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"num_workers": 0}, "at least 1"),
        ({"num_workers": -2}, "at least 1"),
        ({"num_workers": 2.0}, "int >= 1"),
        ({"num_workers": True}, "int >= 1"),
        ({"device": "tpu"}, "'auto', 'cuda', 'cpu'"),
        ({"device": "cuda"}, "device='cpu'"),
        ({"device": "cpu", "backend": "nccl"}, "backend='gloo'"),
        ({"device": "cpu", "backend": "mpi"}, "'nccl', 'gloo'"),
        ({"device": "cpu", "gpus": [0]}, "Drop gpus="),
        ({"timeout": 0}, "positive"),
        ({"timeout": "10"}, "number of seconds"),
        ({"display": "html"}, "'widget'"),
        ({"output": "rank1"}, "'rank0'"),
        ({"env": {"SEED": 1}}, "str(value)"),
        ({"env": ["A=1"]}, "mapping"),
        ({"env": {"WORLD_SIZE": "3"}}, "set by num_workers="),
        ({"env": {"RANK": "5"}}, "set by num_workers="),
        ({"env": {"LOCAL_WORLD_SIZE": "1"}}, "set by num_workers="),
        ({"env": {"MASTER_PORT": "29500"}}, "a free port"),
        ({"env": {"MASTER_ADDR": "10.0.0.1"}}, "drop it from env="),
        ({"env": {"GROUP_RANK": "1"}}, "set by num_workers="),
        ({"env": {"ROLE_NAME": "trainer"}}, "drop it from env="),
        ({"env": {"TORCHELASTIC_RUN_ID": "x"}}, "Lightning and Accelerate read it"),
        ({"block": "no"}, "must be True or False"),
        ({"return_all": "yes"}, "must be True or False"),
        ({"block": 0}, "must be True or False"),
    ],
)
def test_bad_option_is_a_value_error_with_the_fix(options, fix):
    with pytest.raises(ValueError) as info:
        make_plan(gpu_count=0, **options)
    assert fix in str(info.value)


def test_notebook_launch_rejects_before_starting_anything():
    with starts_nothing():
        with pytest.raises(ValueError, match="at least 1"):
            nbddp.notebook_launch(_noop, num_workers=0)
        with pytest.raises(ValueError, match="callable"):
            nbddp.notebook_launch(42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="tuple or list"):
            nbddp.notebook_launch(_noop, args="abc")
        with pytest.raises(ValueError, match="dict"):
            nbddp.notebook_launch(_noop, kwargs=[1])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="key 1 is not a string"):
            nbddp.notebook_launch(_noop, kwargs={1: "a"}, num_workers=2, device="cpu")
        with pytest.raises(ValueError, match="generator function: calling it runs none"):
            nbddp.notebook_launch(_generator, num_workers=2, device="cpu")
        with pytest.raises(ValueError, match=r"async function.*asyncio\.run"):
            nbddp.notebook_launch(_coroutine, num_workers=2, device="cpu")


def _generator():
    yield 1


async def _coroutine():
    return 1


def test_cuda_visible_devices_is_refused_on_cuda_only():
    with pytest.raises(ValueError, match="gpus="):
        make_plan(env={"CUDA_VISIBLE_DEVICES": "1"}, gpu_count=2)
    plan = make_plan(num_workers=2, device="cpu", env={"CUDA_VISIBLE_DEVICES": ""}, gpu_count=2)
    assert plan.env == {"CUDA_VISIBLE_DEVICES": ""}  # hiding GPUs from CPU ranks is fine


def test_auto_resolves_to_one_in_kernel_rank_without_gpus():
    plan = make_plan(gpu_count=0)
    assert (plan.world_size, plan.device, plan.backend, plan.in_kernel) == (1, "cpu", "gloo", True)
    plan = make_plan(num_workers=2, gpu_count=0)
    assert (plan.world_size, plan.device, plan.backend) == (2, "cpu", "gloo")


def test_auto_uses_every_gpu_with_nccl():
    plan = make_plan(gpu_count=4)
    resolved = (plan.world_size, plan.device, plan.backend, plan.gpus)
    assert resolved == (4, "cuda", "nccl", (0, 1, 2, 3))


def test_gpu_selection_and_sharing(monkeypatch):
    monkeypatch.setattr("nbddp.planning.nccl_version", lambda: (2, 28, 9))  # the GPU machine's
    assert make_plan(gpus=[2, 3], gpu_count=4).gpus == (2, 3)
    assert make_plan(num_workers=1, gpus=[3], gpu_count=4).gpus == (3,)
    shared = make_plan(num_workers=2, gpus=[0, 0], backend="gloo", gpu_count=1)
    assert (shared.world_size, shared.gpus, shared.backend) == (2, (0, 0), "gloo")
    with pytest.raises(ValueError, match="backend='gloo' to share"):
        make_plan(gpus=[0, 0], gpu_count=1)
    with pytest.raises(ValueError, match="only 2 GPU"):
        make_plan(num_workers=3, gpus=[0, 1], gpu_count=4)
    with pytest.raises(ValueError, match="does not exist"):
        make_plan(gpus=[5], gpu_count=2)
    with pytest.raises(ValueError, match="non-empty list"):
        make_plan(gpus=[], gpu_count=2)
    with pytest.raises(ValueError, match=re.escape("gpus=[0, 0] (gloo, or NCCL 2.30 and later)")):
        make_plan(num_workers=2, gpu_count=1)
