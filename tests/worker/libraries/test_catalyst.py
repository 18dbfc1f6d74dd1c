"""Catalyst in nbddp's ranks trains one DDP job over them, whatever ``ddp=`` says: equal
parameters on every rank, each rank half the batches, nbddp's process group and port, the log
directory safe from a rank that empties it first (as Sapsan does), Catalyst's epoch metrics in
run.history. Catalyst 22.4 is in the dev extra; the 21.x line (the one Sapsan pins, which
cannot share an environment with 22.x) is CI's second run of this file, in a venv with
catalyst 21.12 (``.ci/run``), where the test marked ``catalyst21`` runs too;
``benchmarks/catalyst_sapsan.py`` runs Sapsan's example on it."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import os

import pytest
from conftest import TWO_CPU_QUIET

import nbddp

# Catalyst is imported by the ranks, not here: every worker collects this file
if importlib.util.find_spec("catalyst") is None:
    pytest.skip("Catalyst is not installed (pip install .[dev])", allow_module_level=True)
LEGACY = importlib.metadata.version("catalyst").startswith("21.")


def train(ddp: bool, logdir: str, explicit: bool = False, rank1_empties_logdir: bool = False):
    """Catalyst's minimal SupervisedRunner example on data every rank sees whole."""
    import shutil

    import torch
    from catalyst import dl
    from torch.utils.data import DataLoader, TensorDataset

    if rank1_empties_logdir:  # Sapsan's check_logdir(), on rank 1 once rank 0 went ahead
        rank_0_ahead = logdir + ".rank-0-waits"
        if nbddp.rank() == 0:
            _mark_the_first_barrier(rank_0_ahead)
        else:
            _wait_for_rank_0_to_go_ahead(logdir, rank_0_ahead)
            shutil.rmtree(logdir, ignore_errors=True)
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    loaders = {
        "train": DataLoader(TensorDataset(x, y), batch_size=8),
        "valid": DataLoader(TensorDataset(x, y), batch_size=8),
    }
    model = torch.nn.Linear(4, 1)
    runner = dl.SupervisedRunner()
    choice = {"engine": dl.DistributedDataParallelEngine()} if explicit else {"ddp": ddp}
    runner.train(
        model=model,
        criterion=torch.nn.MSELoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loaders=loaders,
        num_epochs=2,
        logdir=logdir,
        verbose=False,
        **choice,
    )
    inner = getattr(runner.model, "module", runner.model)
    return {
        "parameters": [p.detach().clone() for p in inner.parameters()],
        "batches": len(runner.loaders["train"]),
        "port": os.environ["MASTER_PORT"],
        "engine": type(runner.engine).__name__,
    }


def _mark_the_first_barrier(marker: str) -> None:
    """Rank 0 makes ``marker`` as it first waits for the other ranks (nbddp's meeting before
    Catalyst's run)."""
    import torch.distributed as dist

    barrier = dist.barrier

    def marked(*args, **kwargs):
        dist.barrier = barrier
        open(marker, "w").close()
        return barrier(*args, **kwargs)

    dist.barrier = marked


def _wait_for_rank_0_to_go_ahead(logdir: str, marker: str) -> None:
    """Until rank 0 waits for this rank (nbddp's meeting) or, without one, has written its logs
    (the first of its files beside the stale one): then emptying the directory is "late"."""
    import time

    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and set(os.listdir(logdir)) <= {"stale"}:
        assert time.monotonic() < deadline, "rank 0 neither waited nor wrote"
        time.sleep(0.01)


def launch(*args, **kwargs):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        ranks = nbddp.notebook_launch(train, args, kwargs, return_all=True, **TWO_CPU_QUIET)
    return ranks, nbddp.last_run(), out.getvalue()


def assert_one_ddp_job(ranks) -> None:
    first, second = ranks
    pairs = zip(first["parameters"], second["parameters"], strict=True)
    assert all((a == b).all() for a, b in pairs)
    assert first["batches"] == second["batches"] == 4  # 64 samples / 8 per batch / 2 ranks
    assert first["port"] == second["port"] != "2112"  # nbddp's rendezvous, untouched


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("ddp", "explicit"),
    [(True, False), (False, False), (True, True)],
    ids=["ddp", "no-ddp", "engine"],
)
def test_catalyst_trains_one_ddp_job_over_the_ranks(tmp_path, ddp, explicit):
    ranks, run, _ = launch(ddp, str(tmp_path / "logs"), explicit=explicit)
    assert_one_ddp_job(ranks)
    assert run.warning is None
    assert {"train/loss", "valid/loss"} <= set(run.history[-1]) and run.history[-1]["step"] == 2
    assert "checkpoints" in os.listdir(tmp_path / "logs")  # written by rank 0


@pytest.mark.ranks
def test_a_rank_that_empties_the_log_directory_first_leaves_rank_0s_logs_whole(tmp_path):
    logdir = tmp_path / "logs"
    logdir.mkdir()
    (logdir / "stale").write_text("from an earlier run")
    ranks, _, _ = launch(True, str(logdir), rank1_empties_logdir=True)
    assert_one_ddp_job(ranks)
    kept = set(os.listdir(logdir))
    csv = "logs" if LEGACY else "csv_logger"  # where each version's CSVLogger writes
    assert "stale" not in kept and {"checkpoints", "tensorboard", csv} <= kept, kept


@pytest.mark.e2e
def test_catalyst_ddp_true_in_a_real_kernel(kernel, tmp_path):
    """A notebook's cell, as a user types it: Catalyst's example with ddp=True."""
    kernel.run("%load_ext nbddp")
    out, reply = kernel.run(
        "%%ddp -n 2 --device cpu --display none\n"
        "import torch\n"
        "from catalyst import dl\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(64, 4); y = x.sum(1, keepdim=True)\n"
        "loaders = {'train': DataLoader(TensorDataset(x, y), batch_size=8)}\n"
        "model = torch.nn.Linear(4, 1)\n"
        "runner = dl.SupervisedRunner()\n"
        "runner.train(model=model, criterion=torch.nn.MSELoss(),\n"
        "             optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loaders=loaders,\n"
        f"             num_epochs=2, logdir={str(tmp_path / 'logs')!r}, verbose=False, ddp=True)\n"
        "import torch.distributed as dist\n"
        "flat = torch.cat([p.detach().flatten() for p in model.parameters()])\n"
        "gathered = [torch.zeros_like(flat) for _ in range(2)]\n"
        "dist.all_gather(gathered, flat)\n"
        "equal = bool((gathered[0] == gathered[1]).all())\n"
        "batches = len(runner.loaders['train'])\n"
        "del runner, loaders, x, y, gathered, flat\n",
        timeout=300,
    )
    assert reply["status"] == "ok", out
    out, reply = kernel.run("print(equal, batches, nbddp.last_run().warning)")
    assert "True 4 None" in out, out


@pytest.mark.ranks
@pytest.mark.catalyst21
@pytest.mark.skipif(
    not LEGACY, reason="Catalyst 21.x only (this venv has 22.x; .ci/run runs it in one with 21.12)"
)
def test_a_ddp_engine_of_21_gets_no_second_init_process_group(tmp_path):
    ranks, _, _ = launch(True, str(tmp_path / "logs"))
    assert_one_ddp_job(ranks)
    assert {r["engine"] for r in ranks} == {"DistributedDataParallelEngine"}
