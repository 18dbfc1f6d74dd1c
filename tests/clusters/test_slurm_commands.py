"""What nbddp reads from Slurm's tools, on canned output of a GPU cluster (no Slurm needed):
the nodes a job holds in Slurm's order, each one's address, CPUs and GPUs (from its GRES),
and where ranks go on them. The real Slurm runs in ``test_slurm_cluster.py`` (no GPUs)."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from nbddp.clusters.placement import place_on_cluster
from nbddp.clusters.slurm import commands

JOB = (
    "JobId=42 JobName=nb JobState=RUNNING NodeList=gpu[07-08] NumNodes=2 "
    "TRES=cpu=16,node=2,billing=16,gres/gpu=8   "
    "Nodes=gpu[07-08] CPU_IDs=0-7 Mem=0 GRES=gpu:a100:4(IDX:0-3) MinCPUsNode=8"
)
NODES = (
    "NodeName=gpu07 Arch=x86_64 NodeAddr=10.9.0.7 NodeHostName=gpu07 Gres=gpu:a100:4\n"
    "NodeName=gpu08 Arch=x86_64 NodeAddr=10.9.0.8 NodeHostName=gpu08 Gres=gpu:a100:4\n"
)


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """An ``scontrol`` that answers as a two-node GPU cluster would."""
    (tmp_path / "job.txt").write_text(JOB)
    (tmp_path / "nodes.txt").write_text(NODES)
    script = tmp_path / "scontrol"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "args = sys.argv[1:]\n"
        "if args[:2] == ['show', 'hostnames']:\n"
        "    print('gpu07'); print('gpu08')\n"
        "elif args[:2] == ['show', 'job']:\n"
        f"    print(open({str(tmp_path / 'job.txt')!r}).read())\n"
        "elif args[:2] == ['show', 'node']:\n"
        f"    print(open({str(tmp_path / 'nodes.txt')!r}).read())\n"
        "else:\n"
        "    sys.exit('unexpected ' + ' '.join(args))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("gres", "gpus"),
    [("gpu:2(IDX:0-1)", 2), ("gpu:a100:4(IDX:0-3),nic:1", 4), ("", 0), ("(null)", 0)],
)
def test_gpus_are_read_from_a_gres_field(gres, gpus):
    assert commands._gpus(gres) == gpus


@pytest.mark.unit
def test_cpu_ids_are_counted():
    assert commands._count("0-3,8") == 5
    assert commands._count("0") == 1


@pytest.mark.ranks
def test_a_jobs_nodes_come_with_their_addresses_cpus_and_gpus(fake_scontrol):
    nodes = commands.job_nodes("42")
    assert [(n.id, n.address, n.cpus, n.gpus) for n in nodes] == [
        ("gpu07", "10.9.0.7", 8.0, 4.0),
        ("gpu08", "10.9.0.8", 8.0, 4.0),
    ]


class _Allocation:
    def __init__(self, nodes):
        self._nodes = nodes

    def alive_nodes(self):
        return self._nodes


@pytest.mark.ranks
def test_ranks_go_one_per_gpu_of_each_node(fake_scontrol):
    allocation = _Allocation(commands.job_nodes("42"))
    assert place_on_cluster(allocation, "auto", "auto", "auto", "auto") == ("cuda", 2, 4)
    assert place_on_cluster(allocation, "auto", "cpu", 1, "auto") == ("cpu", 1, 1)
    with pytest.raises(ValueError, match=r"2 alive node\(s\) can hold 4 rank\(s\)"):
        place_on_cluster(allocation, "auto", "cuda", 3, "auto")
    with pytest.raises(ValueError, match="can hold 5 rank"):
        place_on_cluster(allocation, "auto", "cuda", "auto", 5)


@pytest.mark.unit
def test_a_node_name_that_resolves_nowhere_is_kept_as_slurm_gave_it(monkeypatch):
    assert commands.ipv4("10.1.2.3") == "10.1.2.3"
    assert commands.ipv4("localhost") == "localhost"  # loopback is no node's address

    def nowhere(name: str) -> str:  # no resolver asked: no packet leaves this machine
        raise OSError(f"{name}: unknown host")

    monkeypatch.setattr(commands.socket, "gethostbyname", nowhere)
    assert commands.ipv4("gpu07") == "gpu07"
