"""Tutorial code runs unchanged: the PyTorch DDP tutorial's ``setup()`` (its own
``init_process_group`` on a fixed ``MASTER_PORT``) and ``cleanup()``, through ``nbddp.spawn``
(``mp.spawn``'s shape), ``notebook_launch`` and ``%%ddp``, in a real kernel; the world a
rank's own ``init_process_group`` may ask for, and ``spawn``'s options, in this process."""

from __future__ import annotations

import os
import re
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import TWO_CPU_QUIET, starts_nothing

import nbddp

# The tutorials' fixed MASTER_PORT, which one test holds on purpose: one worker (sharing.py)
pytestmark = pytest.mark.xdist_group("port-12355")

# https://pytorch.org/tutorials/intermediate/ddp_tutorial.html, as it runs on a CPU: the
# tutorial's ``.to(rank)`` and ``device_ids=[rank]`` are GPU lines (the gpu test keeps them);
# its checkpoint goes to CHECKPOINT_DIR (a test's own) instead of the shared temp directory,
# and each demo returns its model's parameters so that a test can compare the ranks'.
TUTORIAL = textwrap.dedent(
    """
    import os
    import sys
    import tempfile
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.optim as optim
    import torch.multiprocessing as mp

    from torch.nn.parallel import DistributedDataParallel as DDP

    def setup(rank, world_size):
        os.environ['MASTER_ADDR'] = 'localhost'
        os.environ['MASTER_PORT'] = '12355'

        # initialize the process group
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    def cleanup():
        dist.destroy_process_group()

    class ToyModel(nn.Module):
        def __init__(self):
            super(ToyModel, self).__init__()
            self.net1 = nn.Linear(10, 10)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(10, 5)

        def forward(self, x):
            return self.net2(self.relu(self.net1(x)))

    def demo_basic(rank, world_size):
        print(f"Running basic DDP example on rank {rank}.")
        setup(rank, world_size)

        model = ToyModel()
        ddp_model = DDP(model)

        loss_fn = nn.MSELoss()
        optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()

        cleanup()
        print(f"Finished running basic DDP example on rank {rank}.")
        return [p.detach() for p in model.parameters()]

    def demo_checkpoint(rank, world_size):
        print(f"Running DDP checkpoint example on rank {rank}.")
        setup(rank, world_size)

        model = ToyModel()
        ddp_model = DDP(model)

        CHECKPOINT_PATH = CHECKPOINT_DIR + "/model.checkpoint"
        if rank == 0:
            # All processes should see same parameters as they all start from same
            # random parameters and gradients are synchronized in backward passes.
            # Therefore, saving it in one process is sufficient.
            torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

        # Use a barrier() to make sure that process 1 loads the model after process
        # 0 saves it.
        dist.barrier()
        # configure map_location properly
        map_location = {'cuda:%d' % 0: 'cuda:%d' % rank}
        ddp_model.load_state_dict(
            torch.load(CHECKPOINT_PATH, map_location=map_location, weights_only=True))

        loss_fn = nn.MSELoss()
        optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)

        loss_fn(outputs, labels).backward()
        optimizer.step()

        # Not necessary to use a dist.barrier() to guard the file deletion below
        # as the AllReduce ops in the backward pass of DDP already served as
        # a synchronization.

        if rank == 0:
            os.remove(CHECKPOINT_PATH)

        cleanup()
        print(f"Finished running DDP checkpoint example on rank {rank}.")
        return [p.detach() for p in model.parameters()]

    def same_on_every_rank(per_rank):
        return all(
            all(torch.equal(a, b) for a, b in zip(per_rank[0], other)) for other in per_rank
        )
    """
)


@pytest.fixture(scope="module")
def tutorial(kernel, tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    out, reply = kernel.run(
        f"%load_ext nbddp\nCHECKPOINT_DIR = {str(checkpoints)!r}\n{TUTORIAL}\n"
        "port_before = os.environ.get('MASTER_PORT')"
    )
    assert reply["status"] == "ok", out
    yield kernel
    assert os.listdir(checkpoints) == [], "rank 0 removes its checkpoint"


@pytest.mark.e2e
def test_the_tutorial_runs_unchanged_through_spawn(tutorial):
    out, reply = tutorial.run(
        "weights = nbddp.spawn(demo_basic, args=(2,), nprocs=2, join=True, device='cpu', "
        "output='all', return_all=True)\n"
        "print('in step:', same_on_every_rank(weights), len(weights))"
    )
    assert reply["status"] == "ok", out
    for rank in (0, 1):
        assert f"Finished running basic DDP example on rank {rank}." in out
    assert "in step: True 2" in out


@pytest.mark.e2e
def test_the_checkpoint_demo_runs_unchanged_through_notebook_launch(tutorial):
    out, reply = tutorial.run(
        "weights = nbddp.notebook_launch(lambda ws: demo_checkpoint(nbddp.rank(), ws), (2,), "
        "num_workers=2, device='cpu', output='all', return_all=True)\n"
        "print('in step:', same_on_every_rank(weights))"
    )
    assert reply["status"] == "ok", out
    assert "Finished running DDP checkpoint example on rank 1." in out
    assert "in step: True" in out


@pytest.mark.e2e
def test_two_runs_at_once_both_asking_for_port_12355_both_succeed(tutorial):
    """Port 12355 is held by another program (this kernel, or anyone else on the machine):
    neither run may bind it or talk to it."""
    out, reply = tutorial.run(
        "import socket\n"
        "holder = socket.socket()\n"
        "try:\n"
        "    holder.bind(('127.0.0.1', 12355)); holder.listen()\n"
        "except OSError:\n"
        "    pass  # someone else holds it: as good\n"
        "runs = [nbddp.spawn(demo, args=(2,), nprocs=2, join=False, device='cpu', "
        "display='none', return_all=True) for demo in (demo_checkpoint, demo_basic)]\n"
        "both = [run.result(timeout=120) for run in runs]\n"
        "holder.close()\n"
        "print('in step:', [same_on_every_rank(w) for w in both], [r.status for r in runs])"
    )
    assert reply["status"] == "ok", out
    assert "in step: [True, True] ['succeeded', 'succeeded']" in out


@pytest.mark.e2e
def test_a_tutorial_asking_for_another_world_fails_before_training(tutorial):
    out, reply = tutorial.run(
        "try:\n"
        "    nbddp.spawn(demo_basic, args=(3,), nprocs=2, device='cpu', output='all')\n"
        "except ValueError as exc:\n"
        "    print('caught:', exc)\n"
    )
    assert reply["status"] == "ok", out
    failed = re.search(
        r"init_process_group\(rank=([01]), world_size=3\) asks for a world of 3", out
    )
    assert failed, out
    assert "nbddp started this launch with 2 ranks" in out
    assert "num_workers=3 (nbddp.spawn(..., nprocs=3)" in out
    # output="all": the failing rank's own print is shown (the other rank may not have printed
    # yet when the first failure ends the run, on a loaded machine)
    assert f"Running basic DDP example on rank {failed.group(1)}." in out
    assert "Finished running" not in out  # no training happened


@pytest.mark.e2e
def test_one_rank_in_the_kernel_runs_the_tutorial_and_leaves_the_kernel_as_it_was(tutorial):
    out, reply = tutorial.run(
        "weights = nbddp.spawn(demo_basic, args=(1,), nprocs=1, device='cpu')\n"
        "import torch.distributed as dist\n"
        "print('after:', dist.is_initialized(), os.environ.get('MASTER_PORT') == port_before,\n"
        "      'nbddp' in dist.init_process_group.__code__.co_filename)"
    )
    assert reply["status"] == "ok", out
    assert "Finished running basic DDP example on rank 0." in out
    assert "after: False True False" in out


@pytest.mark.e2e
def test_one_rank_in_the_kernel_answers_an_init_process_group_imported_by_name(tutorial):
    """The tutorial's ``from torch.distributed import init_process_group``, run before the
    launch, holds torch's own function: in the kernel's one-rank world it is answered too
    (the same world; its MASTER_PORT, held by another program here, never bound; destroy and
    init again), and is torch's own again afterwards."""
    none_is_one = torch.cuda.device_count() <= 1  # nprocs=None: one rank per GPU
    out, reply = tutorial.run(
        "from torch.distributed import init_process_group, destroy_process_group\n"
        "import socket\n"
        "held = socket.socket()\n"
        "held.bind(('127.0.0.1', 0))\n"
        "held.listen()\n"
        "def setup_by_name(rank, world_size):\n"
        "    os.environ['MASTER_ADDR'] = 'localhost'\n"
        "    os.environ['MASTER_PORT'] = str(held.getsockname()[1])\n"
        "    init_process_group('gloo', rank=rank, world_size=world_size)\n"
        "def demo_by_name(rank, world_size):\n"
        "    setup_by_name(rank, world_size)\n"
        "    first = dist.get_world_size()\n"
        "    destroy_process_group()\n"
        "    setup_by_name(rank, world_size)\n"
        "    total = torch.ones(1)\n"
        "    dist.all_reduce(total)\n"
        "    destroy_process_group()\n"
        "    return first, total.item()\n"
        "print('world:', nbddp.spawn(demo_by_name, args=(1,), nprocs=1, device='cpu'))\n"
        f"if {none_is_one}:\n"
        "    print('default:', nbddp.spawn(demo_by_name, args=(1,), display='none'))\n"
        "try:\n"
        "    nbddp.spawn(demo_by_name, args=(2,), nprocs=1, device='cpu', display='none')\n"
        "except ValueError as exc:\n"
        "    print('another world:', exc)\n"
        "held.close()\n"
        "print('after:', init_process_group is dist.distributed_c10d.init_process_group,\n"
        "      'nbddp' in init_process_group.__code__.co_filename, dist.is_initialized())\n"
    )
    assert reply["status"] == "ok", out
    assert "world: (1, 1.0)" in out, out
    if none_is_one:
        assert "default: (1, 1.0)" in out, out
    assert (
        "another world: rank 0 raised ValueError: init_process_group(rank=0, world_size=2)" in out
    )
    assert "started this launch with 1 rank (this is rank 0)" in out
    assert "nbddp.spawn(..., nprocs=2)" in out
    assert "after: True False False" in out


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU lines work on this machine")
@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("torch.cuda.set_device(rank)", "leave torch.cuda.set_device(...) out"),
        ("ToyModel().to(rank)", "move models and tensors to nbddp.device()"),
        ("DDP(ToyModel(), device_ids=[rank])", "Wrap it as DDP(model), without device_ids"),
    ],
)
@pytest.mark.parametrize("nprocs", [2, 1])
def test_the_tutorials_gpu_lines_on_cpu_ranks_get_nbddps_hint(tutorial, line, says, nprocs):
    """torch's own error ("Found no NVIDIA driver", DDP's device_ids ValueError) stays, and
    nbddp says what to change, in a rank and in the kernel's one-rank world alike."""
    out, reply = tutorial.run(
        "def gpu_line(rank, world_size):\n"
        "    setup(rank, world_size)\n"
        f"    {line}\n"
        f"nbddp.spawn(gpu_line, args=({nprocs},), nprocs={nprocs}, device='cpu', display='none')"
    )
    assert reply["status"] == "error" and reply["ename"] == "WorkerError", out
    assert "This rank runs on the CPU (this launch's gloo ranks have no GPU)" in out, out
    assert says in out and "launch with device='cuda' on a machine with GPUs" in out
    assert out.count("This rank runs on the CPU") == 1


@pytest.mark.e2e
def test_a_ddp_cell_calling_init_process_group_itself(tutorial):
    out, reply = tutorial.run(
        "%%ddp -n 2 --device cpu --display none\n"
        "os.environ['MASTER_ADDR'] = 'localhost'\n"
        "os.environ['MASTER_PORT'] = '12355'\n"
        "dist.init_process_group('gloo', rank=int(os.environ['RANK']), world_size=2)\n"
        "total = torch.ones(1)\n"
        "dist.all_reduce(total)\n"
        "dist.destroy_process_group()\n"
    )
    assert reply["status"] == "ok", out
    out, reply = tutorial.run("print('total:', total.item())")
    assert "total: 2.0" in out, out


@pytest.mark.e2e
def test_a_one_worker_ddp_cell_calling_init_process_group_itself(tutorial):
    out, reply = tutorial.run(
        "%%ddp -n 1 --device cpu --display none\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "alone = torch.ones(1)\n"
        "dist.all_reduce(alone)\n"
        "dist.destroy_process_group()\n"
    )
    assert reply["status"] == "ok", out
    out, reply = tutorial.run("print('alone:', alone.item(), dist.is_initialized())")
    assert "alone: 1.0 False" in out, out


@pytest.mark.e2e
def test_a_ddp_cell_asking_for_another_world_is_told_how_to_ask(tutorial):
    out, reply = tutorial.run(
        "%%ddp -n 2 --device cpu --display none\n"
        "dist.init_process_group('gloo', rank=int(os.environ['RANK']), world_size=4)\n"
    )
    assert reply["status"] == "error"
    assert "asks for a world of 4 ranks" in out and "%%ddp -n 4" in out
    # the rank's traceback ends at the user's call: nbddp's answer to it is not shown
    assert "_answer_impl" not in out and "/nbddp/" not in out, out


# -- in this process: what a rank's own init_process_group may ask for ------------------------


def init_twice_and_reduce(init_method: str | None) -> tuple[float, str, list[int]]:
    """The tutorial's shape with another rendezvous each time: init, destroy, init again.
    Also returns each init's TCP ports of this rank that were 12355: had the rank's own
    rendezvous been used, rank 0 would listen there and rank 1 connect to it."""
    import psutil

    rank = nbddp.rank()
    on_12355 = []
    for _ in range(2):
        os.environ["MASTER_PORT"] = "12355"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
        sockets = psutil.Process().net_connections("tcp")
        ports = {c.laddr.port for c in sockets} | {c.raddr.port for c in sockets if c.raddr}
        on_12355 += [12355] if 12355 in ports else []
        total = torch.ones(1)
        dist.all_reduce(total)
        dist.destroy_process_group()
    return total.item(), os.environ["MASTER_PORT"], on_12355


def init_from_the_environment_alone() -> str:
    dist.init_process_group()  # env://: RANK and WORLD_SIZE as nbddp set them
    return dist.get_backend()


def init_as_rank_zero() -> None:
    dist.init_process_group("gloo", rank=0, world_size=2)


def init_by_url_query() -> None:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:12355?world_size=3&rank=0")


@pytest.mark.ranks
def test_an_own_init_with_nothing_named_is_the_existing_world():
    assert nbddp.notebook_launch(init_from_the_environment_alone, **TWO_CPU_QUIET) == "gloo"


@pytest.mark.ranks
def test_another_rank_is_a_clear_error():
    with pytest.raises(nbddp.WorkerError, match="asks to be rank 0") as caught:
        nbddp.notebook_launch(init_as_rank_zero, **TWO_CPU_QUIET)
    assert caught.value.rank == 1 and isinstance(caught.value, ValueError)
    assert "Pass rank=nbddp.rank()" in str(caught.value)


@pytest.mark.ranks
def test_a_url_asking_for_another_world_is_a_clear_error():
    with pytest.raises(ValueError, match=r"world_size=3\) asks for a world of 3 ranks"):
        nbddp.notebook_launch(init_by_url_query, **TWO_CPU_QUIET)


def init_nccl_on_cpu() -> tuple[str, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dist.init_process_group("nccl", rank=nbddp.rank(), world_size=nbddp.world_size())
    return dist.get_backend(), [str(w.message) for w in seen]


@pytest.mark.ranks
@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL would work on this machine")
def test_nccl_asked_on_a_cpu_launch_keeps_gloo_and_says_so():
    backend, said = nbddp.notebook_launch(init_nccl_on_cpu, **TWO_CPU_QUIET)
    assert backend == "gloo"
    assert any("NCCL needs a GPU" in s and "device='cuda'" in s for s in said), said


def destroy_then_return() -> int:
    dist.destroy_process_group()
    return nbddp.rank()


@pytest.mark.ranks
def test_the_users_destroy_at_once_breaks_no_peer_and_no_work_after_fn():
    """A rank that destroys the group as soon as it has it: its peer may still be connecting
    (gloo), which broke ~1 launch in 20 before every build waited for all ranks."""
    for _ in range(15):
        assert nbddp.notebook_launch(destroy_then_return, return_all=True, **TWO_CPU_QUIET) == [
            0,
            1,
        ]


@pytest.mark.ranks
def test_the_users_destroy_in_a_session_task_and_the_next_task_has_a_group():
    with nbddp.Session(num_workers=2, device="cpu") as session:
        assert session.run(init_twice_and_reduce, ("env://",), display="none")[0] == 2.0
        assert session.run(reduce_ones, display="none") == 2.0


def reduce_ones() -> float:
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


@pytest.mark.ranks
def test_a_notebook_import_of_init_process_group_by_name_is_answered_too():
    namespace: dict = {"__name__": "__main__", "nbddp": nbddp, "torch": torch}
    exec(
        "from torch.distributed import init_process_group, destroy_process_group, all_reduce\n"
        "def train():\n"
        "    init_process_group('gloo', rank=nbddp.rank(), world_size=2)\n"
        "    t = torch.ones(1)\n"
        "    all_reduce(t)\n"
        "    destroy_process_group()\n"
        "    return t.item()\n",
        namespace,
    )
    assert nbddp.notebook_launch(namespace["train"], **TWO_CPU_QUIET) == 2.0


# -- nbddp.spawn's options ----------------------------------------------------------------------


def local_rank_and(index: int, value: str) -> tuple[int, int, str]:
    return index, nbddp.local_rank(), value


@pytest.mark.ranks
def test_spawn_passes_the_local_rank_first_and_join_false_gives_the_run():
    run = nbddp.spawn(
        local_rank_and, ("x",), nprocs=2, join=False, device="cpu", display="none", daemon=False
    )
    assert isinstance(run, nbddp.Run)
    assert run.result(timeout=60) == (0, 0, "x")
    assert nbddp.spawn(local_rank_and, ["y"], 2, True, device="cpu", return_all=True) == [
        (0, 0, "y"),
        (1, 1, "y"),
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"nprocs": 0}, "nprocs=0: how many ranks"),
        ({"nprocs": "2"}, "nprocs='2'"),
        ({"join": "yes"}, "join='yes' must be True"),
        ({"num_workers": 2}, "takes nprocs= instead of num_workers="),
        ({"block": False}, "takes join= instead of block="),
        ({"kwargs": {}}, "takes args="),
        ({"start_method": "threads"}, "start_method='threads' is none of mp.spawn's"),
        ({"devices": "cpu"}, "unknown option devices=. It takes mp.spawn's"),
        ({"device": "tpu"}, "device"),
        ({"args": 3}, "args=3 must be a tuple or list"),
    ],
)
def test_spawn_refuses_bad_options_before_any_process_starts(options, says):
    with starts_nothing(), pytest.raises(ValueError, match=re.escape(says)):
        nbddp.spawn(local_rank_and, **{"args": ("x",), "device": "cpu", **options})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kernel_visible", "gpus"), [(None, (0, 1)), (None, (3, 1)), ("5,6,7", (2, 0))]
)
def test_a_ranks_local_rank_is_its_cuda_index_so_the_tutorials_gpu_lines_land_right(
    monkeypatch, kernel_visible, gpus
):
    """What makes ``.to(rank)`` / ``device_ids=[rank]`` / ``set_device(rank)`` (with the local
    rank ``nbddp.spawn`` passes) land on the rank's GPU, checkable without one: every rank sees
    the launch's GPUs in rank order, and its own is at its local rank."""
    from nbddp.environment import device_indices, single_node, worker_env

    if kernel_visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", kernel_visible)
    kernel_names = kernel_visible.split(",") if kernel_visible else [str(i) for i in range(8)]
    assert device_indices(gpus) == (0, 1)  # rank i's device inside its process: cuda:i
    for rank in (0, 1):
        env = worker_env(single_node(rank, 2), 1, "r", device="cuda", gpus=gpus, user_env={})
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(env["LOCAL_RANK"])] == kernel_names[gpus[rank]]


@pytest.mark.ranks
@pytest.mark.gpu
def test_the_tutorial_with_its_gpu_lines_lands_each_rank_on_its_gpu():
    """Unchanged GPU lines: ``.to(rank)``, ``device_ids=[rank]``, ``torch.cuda.set_device``."""
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip("needs two GPUs")
    namespace: dict = {"__name__": "__main__", "nbddp": nbddp}
    exec(
        "import torch, torch.distributed as dist, torch.nn as nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def demo(rank, world_size):\n"
        "    dist.init_process_group('nccl', rank=rank, world_size=world_size)\n"
        "    torch.cuda.set_device(rank)\n"
        "    model = nn.Linear(10, 5).to(rank)\n"
        "    ddp = DDP(model, device_ids=[rank])\n"
        "    ddp(torch.randn(20, 10).to(rank)).sum().backward()\n"
        "    dist.destroy_process_group()\n"
        "    return str(next(model.parameters()).device), str(nbddp.device())\n",
        namespace,
    )
    got = nbddp.spawn(namespace["demo"], (2,), nprocs=2, return_all=True, display="none")
    assert got == [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")]
