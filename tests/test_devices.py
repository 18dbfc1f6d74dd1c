"""Which GPU each rank gets, checked with a fake device inventory (``devices.py``,
``planning.py``, ``environment.py``, ``local/kernel_world.py``): ``gpus=`` by index or
UUID/MIG UUID, ``LOCAL_RANK`` the index of the rank's own device, two ranks on one GPU with
NCCL only where NCCL allows it, nothing that creates a CUDA context."""

from __future__ import annotations

import os
import sys
import types
import warnings

import pytest
import torch

import nbddp
from nbddp import devices
from nbddp.environment import device_indices, single_node, worker_env
from nbddp.errors import NbddpWarning
from nbddp.local.kernel_world import single_rank_world
from nbddp.local.ranks import local_ranks
from nbddp.plan import LaunchPlan
from nbddp.planning import make_plan
from nbddp.wire.call import Call

pytestmark = pytest.mark.unit

SMI = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0aaa0000-1111-2222-3333-444455556666)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-1bbb0000-1111-2222-3333-444455556666)
  MIG 3g.20gb     Device  0: (UUID: MIG-7c1a0000-1111-2222-3333-444455556666)
  MIG 3g.20gb     Device  1: (UUID: MIG-8d2b0000-1111-2222-3333-444455556666)
"""
H100, A100 = "GPU-0aaa0000-1111-2222-3333-444455556666", "GPU-1bbb0000-1111-2222-3333-444455556666"
MIG_A, MIG_B = (
    "MIG-7c1a0000-1111-2222-3333-444455556666",
    "MIG-8d2b0000-1111-2222-3333-444455556666",
)


@pytest.fixture
def machine(monkeypatch):
    """The kernel's view: no CUDA_VISIBLE_DEVICES, CUDA not initialised, nvidia-smi as above."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "inventory", lambda: devices.parse_smi(SMI))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


def envs(plan: LaunchPlan) -> list[tuple[str, str]]:
    """(CUDA_VISIBLE_DEVICES, LOCAL_RANK) of each rank of ``plan``."""
    out = []
    for rank in range(plan.world_size):
        env = worker_env(
            single_node(rank, plan.world_size), 1, "r", device="cuda", gpus=plan.gpus, user_env={}
        )
        out.append((env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"]))
    return out


def test_nvidia_smi_is_read_as_gpus_and_their_mig_slices():
    found = devices.parse_smi(SMI)
    assert [(g.number, g.uuid, g.mig) for g in found] == [(0, H100, ()), (1, A100, (MIG_A, MIG_B))]


def test_gpus_by_uuid_reach_the_ranks_as_uuids_and_local_rank_is_the_device_index(machine):
    plan = make_plan(gpus=[A100, H100], gpu_count=2)
    assert plan.gpus == (A100, H100)
    assert envs(plan) == [(f"{A100},{H100}", "0"), (f"{A100},{H100}", "1")]
    with pytest.raises(ValueError, match="not among the GPUs nvidia-smi -L lists"):
        make_plan(gpus=["GPU-ffff"], gpu_count=2)


def test_a_uuid_the_kernels_visible_devices_list_is_its_index(machine):
    machine.setenv("CUDA_VISIBLE_DEVICES", f"{H100},{A100}")
    assert make_plan(gpus=[A100], num_workers=1, gpu_count=2).gpus == (1,)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        make_plan(gpus=[MIG_A], gpu_count=2)


def test_f9_two_mig_slices_are_two_ranks_each_seeing_its_own_slice(machine):
    """F9: the kernel's CUDA enumerates one MIG slice, so num_workers=2 was refused ("only
    1 GPU(s) are selected"), and every rank would have seen the whole list."""
    machine.setenv("CUDA_VISIBLE_DEVICES", f"{MIG_A},{MIG_B}")
    plan = make_plan(num_workers=2, device="cuda", backend="gloo", gpu_count=1)
    assert plan.gpus == (MIG_A, MIG_B)
    assert envs(plan) == [(MIG_A, "0"), (MIG_B, "0")]
    assert device_indices(plan.gpus) == (0, 0)
    assert make_plan(device="cuda", backend="gloo", gpu_count=1).world_size == 2  # "auto"


def test_mig_slices_by_uuid_without_visible_devices(machine):
    plan = make_plan(gpus=[MIG_B, MIG_A], backend="gloo", gpu_count=2)
    assert envs(plan) == [(MIG_B, "0"), (MIG_A, "0")]


def test_one_rank_in_the_kernel_can_use_only_the_slice_the_kernel_sees(machine):
    machine.setenv("CUDA_VISIBLE_DEVICES", f"{MIG_A},{MIG_B}")
    assert make_plan(gpus=[MIG_A], num_workers=1, gpu_count=1).gpus == (MIG_A,)
    with pytest.raises(ValueError, match="the kernel's CUDA sees one MIG slice"):
        make_plan(gpus=[MIG_B], num_workers=1, gpu_count=1)


def test_f10_ranks_sharing_a_gpu_have_its_index_as_local_rank(machine):
    """F10: ``LOCAL_RANK`` was 0 and 1 while each rank's only device was cuda:0, so
    ``.to(rank)`` and Lightning's ``devices=2`` asked for a GPU that is not there."""
    plan = make_plan(num_workers=3, gpus=[0, 1, 0], backend="gloo", gpu_count=2)
    assert envs(plan) == [("0,1", "0"), ("0,1", "1"), ("0,1", "0")]


def test_f10_two_nccl_ranks_on_one_gpu_name_the_nccl_that_refuses_it(machine):
    """F10: the refusal said "which NCCL refuses", false for NCCL 2.30 and later."""
    machine.setattr("nbddp.planning.nccl_version", lambda: (2, 28, 9))
    with pytest.raises(ValueError, match=r"NCCL 2\.28\.9 \(the library torch loads\) refuses"):
        make_plan(gpus=[0, 0], gpu_count=1)
    machine.setattr("nbddp.planning.nccl_version", lambda: None)
    with pytest.raises(ValueError, match="no NCCL"):
        make_plan(gpus=[0, 0], gpu_count=1)


def test_two_nccl_ranks_on_one_gpu_run_time_sliced_with_nccl_2_30(machine):
    machine.setattr("nbddp.planning.nccl_version", lambda: (2, 30, 7))
    plan = make_plan(gpus=[0, 0], gpu_count=1)
    assert (plan.backend, plan.env["NCCL_MULTI_RANK_GPU_ENABLE"]) == ("nccl", "1")
    with pytest.warns(NbddpWarning, match="time-sliced, for correctness, not speed"):
        local_ranks(plan, Call(b""))


def test_f11_visible_devices_changed_after_cuda_started_is_said_not_an_index_error(machine):
    """F11: ``os.environ["CUDA_VISIBLE_DEVICES"] = "1"`` in a cell after CUDA was used: torch
    still counts 4 GPUs; ``gpus=[0, 1]`` raised IndexError deep in the launch."""
    machine.setattr(torch.cuda, "is_initialized", lambda: True)
    machine.setattr(torch.cuda, "device_count", lambda: 4)
    machine.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(ValueError, match="changed after CUDA was initialised"):
        make_plan(gpus=[0, 1], gpu_count=4)
    with pytest.raises(ValueError, match="changed after CUDA was initialised"):
        make_plan(gpus=[0], num_workers=1, gpu_count=4)


def test_f5_a_ray_node_helper_sees_no_gpu_and_its_ranks_get_the_ones_ray_gave(machine):
    """F5: Ray hides every GPU from the node helper (``CUDA_VISIBLE_DEVICES=""``); the empty
    value read as "unset" gave the ranks GPUs 0..k-1, whatever Ray had reserved."""
    machine.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=''"):
        worker_env(single_node(0, 2), 1, "r", device="cuda", gpus=(0, 1), user_env={})
    env = worker_env(single_node(1, 2), 1, "r", device="cuda", gpus=("2", "3"), user_env={})
    assert (env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"]) == ("2,3", "1")


def test_f5_the_ray_engine_leases_each_bundles_gpus_and_names_them(monkeypatch):
    """F5: an actor in each reservation bundle holds its GPUs; its ids are the ranks'."""
    from nbddp.clusters.ray import cluster as ray_cluster

    asked = []

    class Actor:
        def __init__(self, index):
            self.ids = types.SimpleNamespace(
                remote=lambda: [f"{2 * index + 4}", f"{2 * index + 5}"]
            )

    class Remote:
        def options(self, **options):
            asked.append(options)
            return types.SimpleNamespace(remote=lambda: Actor(len(asked) - 1))

    fake = types.ModuleType("ray")
    fake.remote = lambda cls: Remote()  # type: ignore[attr-defined]
    fake.get = lambda refs: list(refs)  # type: ignore[attr-defined]
    fake.kill = lambda actor: None  # type: ignore[attr-defined]
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.PlacementGroupSchedulingStrategy = lambda pg, placement_group_bundle_index: (  # type: ignore[attr-defined]
        pg,
        placement_group_bundle_index,
    )
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.util", types.ModuleType("ray.util"))
    monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", strategies)
    placement = types.SimpleNamespace(id=types.SimpleNamespace(hex=lambda: "pg1"))
    assert ray_cluster.lease_gpus(placement, 2, 2) == [("4", "5"), ("6", "7")]
    assert [o["num_gpus"] for o in asked] == [2, 2]
    assert [o["scheduling_strategy"][1] for o in asked] == [0, 1]
    assert ray_cluster.lease_gpus(placement, 2, 2) == [("4", "5"), ("6", "7")]  # kept
    assert len(asked) == 2
    ray_cluster._leases.clear()


class FakeCuda:
    """``torch.cuda`` of a 2-GPU machine, recording what would touch a GPU."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, int]] = []
        self.current = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "current_device", self.record("current_device"))
        monkeypatch.setattr(torch.cuda, "set_device", self.record("set_device"))
        monkeypatch.setattr(torch.cuda, "_exchange_device", self.exchange)
        monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", self.maybe_exchange)

    def record(self, name):
        def call(device=None):
            index = getattr(device, "index", device)
            self.calls.append((name, index))
            return self.current

        return call

    def exchange(self, index: int) -> int:
        self.calls.append(("exchange", index))
        previous, self.current = self.current, index
        return previous

    def maybe_exchange(self, index: int) -> int:  # no context is made on the GPU it goes to
        self.calls.append(("maybe_exchange", index))
        previous, self.current = self.current, index
        return previous


def test_f4_one_rank_on_gpu_1_in_the_kernel_has_local_rank_1_and_leaves_no_context_on_gpu_0(
    monkeypatch,
):
    """F4: ``gpus=[1]`` with one worker ran in the kernel with LOCAL_RANK=0 (Accelerate, the
    HF Trainer, Lightning then trained on GPU 0) and put the kernel back with
    ``set_device(0)``, which makes a CUDA context on GPU 0."""
    cuda = FakeCuda(monkeypatch)
    plan = LaunchPlan(world_size=1, device="cuda", backend="gloo", gpus=(1,))
    with single_rank_world(plan):
        inside = (os.environ["LOCAL_RANK"], nbddp.local_rank(), nbddp.device())
    assert inside == ("1", 1, torch.device("cuda", 1))
    assert ("set_device", 0) not in cuda.calls
    assert cuda.calls[-1] == ("maybe_exchange", 0)


def test_f15_the_kernels_context_warning_names_only_the_gpus_it_uses_and_sessions_get_it(
    monkeypatch,
):
    """F15: every selected GPU was named, with memory a context-less GPU does not hold;
    sessions never warned."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i == 1, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 2 * 2**30)
    plan = LaunchPlan(world_size=2, device="cuda", backend="gloo", gpus=(0, 1))
    for session in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            local_ranks(plan, Call(b""), session=session)
        said = [str(w.message) for w in caught if issubclass(w.category, NbddpWarning)]
        assert len(said) == 1 and "GPU 1 (2.00 GiB" in said[0] and "GPU 0" not in said[0]


def test_ncclgetversion_is_read_from_the_library_torch_loaded_without_cuda():
    """torch.cuda.nccl.version() is the header torch was built with; the library may differ."""
    version = devices.nccl_version()
    if version is None:
        pytest.skip("this torch loads no libnccl (a CPU build)")
    assert version >= (2, 0, 0) and len(version) == 3
    assert not torch.cuda.is_initialized()
