"""Two "hosts" with addresses of their own: two network namespaces (named per process, as
``tests/slurm_cluster.py``'s are: two runs on one machine never touch each other's) joined
by a veth pair on 10.200.0.0/24, a Ray node started in each, the kernel in the first. Unlike
``ray.cluster_utils`` (one address for every node), this exercises the choice of
``MASTER_ADDR`` (node rank 0's address, whichever host that is) and of the interface gloo uses
(``GLOO_SOCKET_IFNAME``): without it gloo advertises the hostname's address and fails.

Each node is waited for until it says "Ray runtime started." (``ray start`` prints it once the
node's raylet is registered in the GCS): a kernel that called ``ray.init`` before its own node
had registered spun in Ray's lookup of the local node (``get_node_to_connect_for_driver``, a
loop without a pause, 60 s) and, on a loaded machine, failed with "Failed to connect to Ray
cluster" (it used to wait only for the head's port).

Needs root (network namespaces); skipped loudly without it. Every packet stays inside the two
namespaces this test makes: their only interfaces are ``lo`` and the veth pair, with no route
anywhere else."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# Ray is imported where a test uses it, not here: every worker collects this file, one runs it
# (an import of Ray costs ~3 core-s)
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed: pip install -e '.[ray]'", allow_module_level=True)
pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.netns, pytest.mark.slow]

HOSTS = {"a": "10.200.0.1", "b": "10.200.0.2"}
# Named per process: another run's namespaces and veth pair (a developer's beside CI's, or
# another xdist worker's) are never deleted or reused. A namespace holds its own addresses and
# ports, so the same 10.200.0.x in two runs' namespaces do not meet. Interface names have at
# most 15 characters.
_RUN = os.getpid() % 100000
NAMESPACE = {host: f"nbddp-ray-{host}{_RUN}" for host in HOSTS}
VETH = {host: f"nbddp-r{host}{_RUN}" for host in HOSTS}  # each host's end of the pair
RAY = str(Path(sys.executable).with_name("ray"))


def _reason_to_skip() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root, as CI does)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command (apt-get install iproute2)"
    if not os.path.exists(RAY):
        return f"Ray's command line is not at {RAY}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _in(host: str, command: list[str], **kwargs) -> list[str]:
    return ["ip", "netns", "exec", NAMESPACE[host], *command]


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[None]:
    reason = _reason_to_skip()
    if reason:
        pytest.skip(f"the two-host test cannot run here: {reason}")
    try:
        for host in HOSTS:
            _ip("netns", "add", NAMESPACE[host])
        _ip("link", "add", VETH["a"], "type", "veth", "peer", "name", VETH["b"])
        for host, address in HOSTS.items():
            _ip("link", "set", VETH[host], "netns", NAMESPACE[host])
            _ip("-n", NAMESPACE[host], "addr", "add", f"{address}/24", "dev", VETH[host])
            _ip("-n", NAMESPACE[host], "link", "set", VETH[host], "up")
            _ip("-n", NAMESPACE[host], "link", "set", "lo", "up")
        yield
    finally:
        for host in HOSTS:  # deleting a namespace deletes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", NAMESPACE[host]], capture_output=True)
        # a pair made before its ends moved into the namespaces is still here: delete it too
        subprocess.run(["ip", "link", "del", VETH["a"]], capture_output=True)


@pytest.fixture(scope="module")
def ray_on_two_hosts(two_hosts, tmp_path_factory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("ray-logs")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=1", "--disable-usage-stats", "--block"]
    head = f"{HOSTS['a']}:6379"
    nodes = {
        "a": [
            f"--node-ip-address={HOSTS['a']}",
            "--head",
            "--port=6379",
            "--include-dashboard=false",
        ],
        "b": [f"--node-ip-address={HOSTS['b']}", f"--address={head}"],
    }
    started = []
    try:
        for host, options in nodes.items():
            with open(logs / f"{host}.log", "w") as log:
                process = subprocess.Popen(
                    _in(host, [RAY, "start", *options, *common]),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            started.append(process)
            _wait_for_node(process, logs / f"{host}.log")  # the head first: then b may join
        yield head
    finally:
        for process in started:  # every process of both nodes, whatever it became
            try:
                family = [process, *psutil.Process(process.pid).children(recursive=True)]
            except psutil.Error:
                family = [process]
            for pid in [p.pid for p in family]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()


def _wait_for_node(process: subprocess.Popen, log: Path, seconds: float = 180) -> None:
    """Until ``ray start`` says its node runs (its raylet registered in the GCS)."""
    deadline = time.monotonic() + seconds
    while "Ray runtime started." not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"a Ray node did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


KERNEL = """
import json, os, sys, time
import ray, nbddp
started = time.monotonic()
ray.init(address=sys.argv[1], log_to_driver=False, _node_ip_address=sys.argv[2])
joined = time.monotonic()
alive = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
assert len(alive) == 2, f"the test started both nodes, yet Ray has {alive}"

def where():
    import torch, torch.distributed as dist
    t = torch.ones(1) * (nbddp.rank() + 1)
    dist.all_reduce(t)
    return {"sum": t.item(), "master": os.environ["MASTER_ADDR"],
            "interface": os.environ.get("GLOO_SOCKET_IFNAME"), "group": os.environ["GROUP_RANK"]}

ranks = nbddp.notebook_launch(where, cluster="ray", device="cpu", display="none",
                              return_all=True)
took = {"ray.init": joined - started, "launch": time.monotonic() - joined}
print("RESULT " + json.dumps({"ranks": ranks, "nodes": list(nbddp.last_run().nodes),
                              "took": took}))
"""


@pytest.mark.timeout(420)  # two Ray nodes, then a first launch (each node's helper imports torch)
def test_ranks_on_two_hosts_find_each_other(ray_on_two_hosts):
    done = subprocess.run(
        _in("a", [sys.executable, "-c", KERNEL, ray_on_two_hosts, HOSTS["a"]]),
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(line[len("RESULT ") :])
    print("seconds taken:", result["took"])
    nodes = result["nodes"]
    assert sorted(nodes) == sorted(HOSTS.values())  # node rank 0 may be either host
    for rank, facts in enumerate(result["ranks"]):
        assert facts["sum"] == 3.0
        assert facts["master"] == nodes[0]  # node rank 0's own address
        host = "a" if nodes[rank] == HOSTS["a"] else "b"
        assert facts["interface"] == VETH[host]  # the interface of the node's address
        assert facts["group"] == str(rank)
