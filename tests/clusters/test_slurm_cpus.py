"""F12: on Slurm, the GPU ranks of a node get CPUs of their own (command text only, no Slurm):
the node helper's step, an allocation nbddp asks for, a detached run's batch job, an exported
batch file."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbddp.clusters.placement import NodeInfo
from nbddp.clusters.slurm.allocation import SlurmCluster, _sbatch_options
from nbddp.clusters.slurm.batch_shape import batch_shape
from nbddp.clusters.slurm.link import HelperStep
from nbddp.exporting.script import Layout, sbatch_text

pytestmark = pytest.mark.unit


def test_f12_the_helper_step_holds_every_cpu_the_job_has_on_its_node():
    """F12: the helpers' step asked ``--cpus-per-task=1``; the ranks they fork stay in its
    CPU set, so with ``ConstrainCores`` every GPU rank of a node shared one core."""
    step = object.__new__(HelperStep)
    step.job_id, step.nodes = (
        "42",
        [NodeInfo("a", "10.0.0.1", 16, 4), NodeInfo("b", "10.0.0.2", 8, 4)],
    )
    command = step._command()
    assert "--cpus-per-task=8" in command and "--gpus-per-node=4" in command


def test_f12_an_allocation_for_gpus_asks_a_cpu_per_gpu_rank():
    """F12: ``--gpus-per-node`` alone gets one CPU per node where the site sets no default."""
    options = _sbatch_options(None, 2, 4, None, None, [])
    assert "--gpus-per-node=4" in options and "--cpus-per-task=4" in options
    more = _sbatch_options(None, 2, 4, None, None, ["--cpus-per-task=32"])
    assert more[-1] == "--cpus-per-task=32"  # the user's, last, is sbatch's


def test_f12_a_detached_gpu_batch_job_asks_a_cpu_per_rank():
    cluster = SlurmCluster(nodes=2, gpus_per_node=4)
    _, _, per_node, options = batch_shape(cluster, "auto", "cuda", "auto", "auto")
    assert per_node == 4 and "--cpus-per-task=4" in options


def test_f12_an_exported_gpu_batch_file_asks_a_cpu_per_rank():
    text = sbatch_text(
        script=Path("/tmp/train.py"),
        layout=Layout("cuda", "nccl", 2, 4),
        origin="train",
        job="train",
        checkpoint_dir="/tmp/ck",
    )
    assert "#SBATCH --gpus-per-node=4" in text and "#SBATCH --cpus-per-task=4" in text
