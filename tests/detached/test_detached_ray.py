"""Detached runs on a Ray cluster of two simulated nodes (one rank on each, gloo, every address
on the loopback interface): a real kernel starts one and is killed with SIGKILL; the run goes
on, because its supervisor is a Ray driver of its own that owns the ranks' node helpers; this
process attaches, sees every metric row from before and after the kill, and gets the result;
when the run ends, the supervisor, its node helpers and its reservation are gone."""

from __future__ import annotations

import importlib.util
import os
import signal

import psutil
import pytest
from conftest import Kernel, wait_until
from detached.support import family, no_standby, runs_dir, supervisor_of, wait_for_file, wait_gone

import nbddp

# Ray is imported where a test uses it, not here: every worker collects this file, one runs it
# (an import of Ray costs ~3 core-s)
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed: pip install -e '.[ray]'", allow_module_level=True)
pytestmark = [pytest.mark.e2e, pytest.mark.ray]
__all__ = ["no_standby", "runs_dir"]  # autouse fixtures (support.py)
NODE_IP = "127.0.0.2"  # Ray rewrites 127.0.0.1 to the machine's outward address

LAUNCH = """
import nbddp, ray
ray.init(address={address!r}, _node_ip_address={node_ip!r}, log_to_driver=False)

def train(ready, go):
    import os, time
    import psutil, torch
    import torch.distributed as dist
    for step in range(20):
        if step == 10:
            open(ready, "w").close()
            while not os.path.exists(go):
                time.sleep(0.01)
        nbddp.log(step=float(step))
    total = torch.ones(1) * (nbddp.rank() + 1)
    dist.all_reduce(total)
    helper = psutil.Process(os.getppid()).ppid()  # rank -> forkserver -> node helper
    return {{"sum": total.item(), "helper": helper}}

run = nbddp.notebook_launch(train, ({ready!r}, {go!r}), cluster="ray", device="cpu",
                            display="none", detach=True, return_all=True)
print(run.id)
"""


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no reports to the outside world
    simulated = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": NODE_IP, "include_dashboard": False},
    )
    simulated.add_node(num_cpus=1, node_ip_address=NODE_IP)
    try:
        yield simulated
    finally:
        simulated.shutdown()


def node_helpers(cluster) -> list[int]:
    """The pids of this cluster's live nbddp node helpers (Ray workers: children of one of
    its raylets; other clusters on this machine are not ours), whoever owns them."""
    raylets = {
        info.process.pid
        for node in (cluster.head_node, *cluster.worker_nodes)
        for info in node.all_processes["raylet"]
    }
    return [
        p.pid
        for p in psutil.process_iter(["cmdline", "ppid"])
        if "NodeHelper" in " ".join(p.info["cmdline"] or ()) and p.info["ppid"] in raylets
    ]


def test_a_detached_run_on_ray_outlives_its_killed_kernel(cluster, tmp_path):
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    a = Kernel()
    try:
        out, reply = a.run(
            LAUNCH.format(address=cluster.address, node_ip=NODE_IP, ready=ready, go=go)
        )
        assert reply["status"] == "ok", out
        run_id = out.strip().splitlines()[-1]
        wait_for_file(ready)  # rows 0-9 are logged
        supervisor = supervisor_of(run_id)
        assert supervisor.pid not in [p.pid for p in psutil.Process(a.pid).children(True)]
        helpers = node_helpers(cluster)
        assert len(helpers) == 2  # one per node, started by the supervisor's driver
        os.kill(a.pid, signal.SIGKILL)
        a.manager.provisioner.process.wait()
    finally:
        if a.manager.is_alive():
            a.shutdown()
        else:
            a.client.stop_channels()
            a.manager.cleanup_resources()
    # Ray ends what a dead driver owned: the kernel owned none of the run's actors
    assert supervisor.is_running() and all(psutil.pid_exists(pid) for pid in helpers)
    # its status file says "running" within a second of the ranks' start reaching it
    assert wait_until(lambda: nbddp.runs()[0].status == "running", 10), nbddp.runs()
    [listed] = nbddp.runs()
    assert (listed.id, listed.cluster) == (run_id, "ray")

    import ray

    ray.init(address=cluster.address, _node_ip_address=NODE_IP, log_to_driver=False)
    try:
        later = nbddp.attach(run_id, display="none")
        open(go, "w").close()
        ranks = later.result(timeout=120)
        assert [r["sum"] for r in ranks] == [3.0, 3.0]
        assert {r["helper"] for r in ranks} == set(helpers)  # a rank under each node's helper
        assert [row["step"] for row in later.history] == [float(i) for i in range(20)]
        assert wait_gone(family(supervisor)) == []
        assert wait_gone([psutil.Process(pid) for pid in helpers if psutil.pid_exists(pid)]) == []
        from ray.util import placement_group_table

        states = {p["state"] for p in placement_group_table().values()}
        assert states <= {"REMOVED"}, f"placement groups left: {states}"
        assert nbddp.runs()[0].status == "succeeded"
        later.forget()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    pytest.main([__file__])
