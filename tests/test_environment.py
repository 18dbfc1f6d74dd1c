"""A kernel that runs inside a Slurm job (or was started by torchrun or mpirun) carries that
launcher's variables; its ranks must not inherit them, and see exactly the torchrun contract:
Lightning then takes its world from nbddp, not from Slurm."""

from __future__ import annotations

import os

import pytest

import nbddp
from nbddp.environment import single_node, without_launchers, worker_env

# What a kernel started by JupyterHub's batchspawner inside `salloc -N 2 --ntasks-per-node 4`
# (task 3 of 8), under an Open MPI / PMI launcher, or itself by torchrun, would carry.
INHERITED = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_STEP_GPUS": "0,1,2,3",
    "SLURMD_NODENAME": "node01",
    "SRUN_DEBUG": "3",
    "PMI_RANK": "3",
    "PMI_SIZE": "8",
    "PMIX_RANK": "3",
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "8",
    "MPI_LOCALRANKID": "3",
    "RANK": "3",
    "LOCAL_RANK": "3",
    "WORLD_SIZE": "8",
    "GROUP_RANK": "1",
    "NODE_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.9.9.9",
    "MASTER_PORT": "1",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_ERROR_FILE": "/nonexistent/error.json",
}


@pytest.fixture
def inside_a_slurm_job(monkeypatch, tmp_path):
    for name, value in INHERITED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NBDDP_TEST_KEPT", "kept")
    srun = tmp_path / "bin" / "srun"  # Slurm's client is installed, as on any Slurm node
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.unit
def test_no_launcher_variable_reaches_a_ranks_environment(inside_a_slurm_job):
    env = worker_env(
        single_node(1, 2),
        29500,
        "run-1",
        device="cpu",
        gpus=(),
        user_env={"SLURM_TMPDIR": "/scratch/4242"},  # handed on deliberately: kept
    )
    leaked = {
        name: env[name]
        for name in env
        if name.startswith(("SLURM", "SRUN_", "PMI", "OMPI_", "MPI_"))
        or name in ("NODE_RANK", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
    }
    assert leaked == {"SLURM_TMPDIR": "/scratch/4242"}
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == (
        "1",
        "1",
        "2",
        "0",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")
    assert env["TORCHELASTIC_RUN_ID"] == "run-1"
    assert env["NBDDP_TEST_KEPT"] == "kept"  # anything else is the kernel's, as before


@pytest.mark.unit
def test_the_filter_keeps_what_is_no_launchers():
    kept = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3", "SLURMY": "1", "OMP_NUM_THREADS": "4"}
    assert without_launchers({**kept, **INHERITED}) == kept


def what_lightning_sees() -> dict:
    import warnings

    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.fabric.plugins.environments.slurm import _is_srun_used

    warned = []
    if nbddp.world_size() > 1:  # a rank: Lightning's srun hint is silenced there
        with warnings.catch_warnings(record=True) as caught:
            SLURMEnvironment.detect()
        warned = [str(w.message) for w in caught]

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return {
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "slurm_detected": _is_srun_used(),
        "warned": warned,
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "node_rank": trainer.node_rank,
        "nbddp": (nbddp.rank(), nbddp.world_size()),
        "inherited": sorted(n for n, v in INHERITED.items() if os.environ.get(n) == v),
        "contract": {n: os.environ[n] for n in _CONTRACT},
    }


_CONTRACT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")


@pytest.mark.ranks
@pytest.mark.slow
def test_lightning_in_the_ranks_sees_nbddps_world_not_slurms(inside_a_slurm_job):
    seen = nbddp.notebook_launch(
        what_lightning_sees, num_workers=2, device="cpu", display="none", return_all=True
    )
    for rank, view in enumerate(seen):
        assert view["environment"] == "TorchElasticEnvironment"
        assert view["slurm_detected"] is False
        assert view["warned"] == []  # no "srun is available but not used" advice
        assert (view["global_rank"], view["world_size"], view["node_rank"]) == (rank, 2, 0)
        assert view["nbddp"] == (rank, 2)
        assert view["inherited"] == []
        assert view["contract"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
        }


@pytest.mark.unit
@pytest.mark.slow
def test_one_rank_in_the_kernel_hides_them_for_the_call_and_gives_them_back(
    inside_a_slurm_job,
):
    view = nbddp.notebook_launch(what_lightning_sees, num_workers=1, device="cpu", display="none")
    assert view["environment"] == "TorchElasticEnvironment" and view["slurm_detected"] is False
    assert view["inherited"] == [] and view["contract"]["WORLD_SIZE"] == "1"
    assert {name: os.environ.get(name) for name in INHERITED} == INHERITED


@pytest.mark.e2e
def test_a_kernel_inside_a_slurm_job_launches(kernel_factory, monkeypatch):
    """A real Jupyter kernel started with the job's variables (batchspawner, Open OnDemand)."""
    for name, value in INHERITED.items():
        monkeypatch.setenv(name, value)
    kernel = kernel_factory()
    for name in INHERITED:  # only the kernel carries them, not this test's later launches
        monkeypatch.delenv(name)
    try:
        out, reply = kernel.run(
            "import os, nbddp\n"
            "def job():\n"
            "    import os, torch.distributed as dist\n"
            "    return (dist.get_rank(), dist.get_world_size(),\n"
            "            sorted(n for n in os.environ if n.startswith(('SLURM', 'PMI', 'OMPI'))))\n"
            "print(os.environ['SLURM_JOB_ID'], os.environ['RANK'])\n"
            "print(nbddp.notebook_launch(job, num_workers=2, device='cpu', display='none',\n"
            "                            return_all=True))\n"
        )
        assert reply["status"] == "ok", out
        assert out.splitlines() == ["4242 3", "[(0, 2, []), (1, 2, [])]"]
    finally:
        kernel.shutdown()
