"""Real launches of 2 gloo workers on the CPU: what each rank sees and what comes back."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
import torch
from conftest import TWO_CPU
from torch.utils.data import DataLoader, TensorDataset

import nbddp

TORCHRUN_VARS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "GROUP_RANK",
    "OMP_NUM_THREADS",
    "NBDDP_X",
]


def gather_facts() -> dict:
    import torch.distributed as dist

    rank = nbddp.rank()
    facts = {
        "env": {name: os.environ.get(name) for name in TORCHRUN_VARS},
        "api": (
            nbddp.rank(),
            nbddp.local_rank(),
            nbddp.world_size(),
            nbddp.is_main(),
            str(nbddp.device()),
        ),
        "group": (
            dist.is_initialized(),
            dist.get_rank(),
            dist.get_world_size(),
            dist.get_backend(),
        ),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    loader = nbddp.prepare_loader(
        DataLoader(TensorDataset(torch.arange(20)), batch_size=4, shuffle=True, drop_last=False)
    )
    facts["loader"] = (type(loader.sampler).__name__, loader.batch_size, len(loader))
    facts["epochs"] = [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]

    torch.manual_seed(100 + rank)  # different initial weights: DDP must broadcast rank 0's
    model = nbddp.prepare_model(torch.nn.Linear(3, 1))
    facts["wrapped"] = type(model).__name__
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(8, 3) + rank  # different data per rank: gradients are averaged
    for _ in range(3):
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()
    facts["weights"] = nbddp.unwrap(model).weight.detach().clone()
    facts["model"] = model  # comes back unwrapped
    nbddp.print(f"printed by rank {rank}")
    print(f"plain print from rank {rank}", flush=True)
    return facts


@pytest.fixture(scope="module", params=["warm", "cold"])
def facts(request):
    """One launch that gathers what each rank sees: forked by the pre-warmed helper, and
    started cold (``NBDDP_PREWARM=0``)."""
    out, err = io.StringIO(), io.StringIO()
    prewarm = os.environ.pop("NBDDP_PREWARM", None)
    if request.param == "cold":
        os.environ["NBDDP_PREWARM"] = "0"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            values = nbddp.notebook_launch(
                gather_facts, **TWO_CPU, return_all=True, output="all", env={"NBDDP_X": "from-env"}
            )
    finally:
        os.environ.pop("NBDDP_PREWARM", None)
        if prewarm is not None:
            os.environ["NBDDP_PREWARM"] = prewarm
    return values, out.getvalue()


@pytest.mark.ranks
def test_every_rank_sees_the_torchrun_environment(facts):
    values, _ = facts
    ports = set()
    for rank, value in enumerate(values):
        env = value["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_RUN_ID"]
        assert env["GROUP_RANK"] == "0" and env["NBDDP_X"] == "from-env"
        ports.add(env["MASTER_PORT"])
        assert value["api"] == (rank, rank, 2, rank == 0, "cpu")
        assert value["group"] == (True, rank, 2, "gloo")
        assert value["pid"] != os.getpid()
    assert len(ports) == 1


@pytest.mark.ranks
def test_cpu_threads_are_split_between_ranks(facts):
    values, _ = facts
    cores = len(os.sched_getaffinity(0))
    for value in values:
        assert value["env"]["OMP_NUM_THREADS"] == str(max(1, cores // 2))
        assert value["threads"] == max(1, cores // 2)


@pytest.mark.ranks
def test_prepare_loader_gives_disjoint_shards_reshuffled_each_epoch(facts):
    values, _ = facts
    for value in values:
        assert value["loader"] == ("DistributedSampler", 4, 3)  # 10 items per rank
    for epoch in range(2):
        shards = [set(v["epochs"][epoch]) for v in values]
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == set(range(20))
    assert values[0]["epochs"][0] != values[0]["epochs"][1]


@pytest.mark.ranks
def test_ddp_keeps_weights_identical_and_returns_the_plain_module(facts):
    values, _ = facts
    assert values[0]["wrapped"] == "DistributedDataParallel"
    assert torch.equal(values[0]["weights"], values[1]["weights"])
    model = values[0]["model"]
    assert type(model) is torch.nn.Linear
    assert torch.equal(model.weight.detach(), values[0]["weights"])


@pytest.mark.ranks
def test_output_all_prefixes_every_rank(facts):
    _, printed = facts
    assert "[rank 0] printed by rank 0" in printed
    assert "printed by rank 1" not in printed  # nbddp.print is rank 0 only
    assert "[rank 1] plain print from rank 1" in printed


@pytest.mark.ranks
def test_rank0_value_comes_back_with_args_kwargs_and_closures(capfd):
    offset = 100
    value = nbddp.notebook_launch(
        lambda a, b=0: (nbddp.rank(), a + b + offset), (1,), {"b": 2}, **TWO_CPU
    )
    assert value == (0, 103)
    run = nbddp.last_run()
    assert run.status == "succeeded" and run.world_size == 2 and run.backend == "gloo"
    assert run.device == "cpu" and run.duration > 0


def say_hello_then_wait(marker: str) -> str:
    import sys

    print(f"hello from rank {nbddp.rank()}", flush=True)
    print(f"complaint from rank {nbddp.rank()}", file=sys.stderr, flush=True)
    while not os.path.exists(marker):
        time.sleep(0.02)
    return "done"


@pytest.mark.ranks
def test_rank0_output_arrives_while_the_run_is_going(tmp_path, capsys):
    marker = str(tmp_path / "go")
    run = nbddp.notebook_launch(say_hello_then_wait, (marker,), **TWO_CPU, block=False)
    seen = ""
    deadline = time.monotonic() + 60
    while "hello from rank 0" not in seen and time.monotonic() < deadline:
        seen += capsys.readouterr().out
        time.sleep(0.05)
    assert run.status == "running"  # the line came before the end
    open(marker, "w").close()
    assert run.result(timeout=60) == "done"
    captured = capsys.readouterr()
    everything = seen + captured.out + captured.err
    assert "hello from rank 0" in seen
    assert "hello from rank 1" not in everything and "complaint from rank 1" not in everything


@pytest.mark.ranks
def test_output_none_hides_everything(capfd):
    assert nbddp.notebook_launch(lambda: print("noise") or 5, **TWO_CPU, output="none") == 5
    assert "noise" not in capfd.readouterr().out


@pytest.mark.ranks
def test_a_bug_in_the_supervisor_ends_the_run_with_its_traceback(monkeypatch):
    """Our own bug must not hang or hide: the run fails with an NbddpError whose cause is the
    original exception, traceback included, and the ranks are torn down."""
    from nbddp.rules.referee import Referee

    def broken(self, rank, message, buffers):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(Referee, "_message", broken)
    with pytest.raises(nbddp.NbddpError, match="supervisor failed") as info:
        nbddp.notebook_launch(abs, (-1,), **TWO_CPU)
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError) and cause.__traceback__ is not None
