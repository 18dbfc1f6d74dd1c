"""A detached run on the test Slurm (``tests/slurm_cluster.py``, two nodes in two network
namespaces) is a batch job: kernel A submits it and is killed with SIGKILL; the job goes on;
kernel B (another process, in node A's namespace as a login node's kernel would be) lists
it, follows it (every metric row from before and after the kill), gets rank 0's value, and
forgets it; the queue is empty and no helper or rank is left. A run still queued is stopped
by cancelling its job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from slurm_cluster import NAMESPACES

pytestmark = [pytest.mark.e2e, pytest.mark.slurm, pytest.mark.slow]

ROOT = str(Path(__file__).resolve().parents[2])
HELPER = "nbddp.clusters.slurm.node"


def _ours() -> list[str]:
    """nbddp's node helpers, supervisors and ranks in either node's namespace."""
    namespaces = {os.stat(f"/run/netns/{ns}").st_ino for ns in NAMESPACES}
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino not in namespaces:
                continue
            line = " ".join(proc.info["cmdline"] or [])
            env = proc.info["environ"] or {}
            alive = proc.status() != psutil.STATUS_ZOMBIE
        except (psutil.Error, OSError):
            continue
        if alive and (HELPER in line or "NBDDP_RUN_ID" in env or "supervisor.py" in line):
            found.append(f"{proc.pid} {line[:80]}")
    return found


@pytest.fixture(autouse=True)
def nothing_left(slurm):
    yield
    deadline = time.monotonic() + 30
    while (slurm.queue() or _ours()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left, running = slurm.queue(), _ours()
    for job in left:
        slurm.run(["scancel", job.split()[0]])
    assert left == [], "a job was left in the queue"
    assert running == [], "a supervisor, node helper or rank was left running"


def environment(slurm, runs: Path) -> dict[str, str]:
    env = {**slurm.env, "PYTHONPATH": ROOT, "NBDDP_RUNS_DIR": str(runs)}
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def kernel_script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text("import json, os, sys, time\nimport nbddp\n" + textwrap.dedent(body))
    return [sys.executable, str(path)]


def result_of(stdout: str, stderr: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"the kernel printed no RESULT\n{stdout}\n{stderr}")


LAUNCH = """
def train(ready, go):
    import os, time
    import torch.distributed as dist
    import nbddp
    for i in range(5):
        nbddp.log(i=float(i))
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    for i in range(5, 10):
        nbddp.log(i=float(i))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, os.environ["GROUP_RANK"])
    return seen

run = nbddp.notebook_launch(train, ({ready!r}, {go!r}), cluster=nbddp.SlurmCluster(nodes=2),
                            device="cpu", display="none", detach=True)
print("RESULT " + json.dumps({{"id": run.id}}), flush=True)
time.sleep(600)  # killed by the test
"""

FOLLOW = """
listed = {{r.id: r for r in nbddp.runs()}}
info = listed[{run_id!r}]
run = nbddp.attach({run_id!r}, display="none")
before = [r["i"] for r in run.history]
open({go!r}, "w").close()
value = run.result(timeout=180)
after = [r["i"] for r in run.history]
run.forget()
print("RESULT " + json.dumps({{"status": info.status, "cluster": info.cluster, "before": before,
                               "after": after, "value": value, "left": len(nbddp.runs())}}))
"""


def test_a_detached_run_is_a_batch_job_that_outlives_its_kernel(slurm, tmp_path):
    runs, ready, go = tmp_path / "runs", str(tmp_path / "ready"), str(tmp_path / "go")
    env = environment(slurm, runs)
    a = subprocess.Popen(
        slurm.command(kernel_script(tmp_path, "a.py", LAUNCH.format(ready=ready, go=go))),
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert a.stdout is not None
        line = a.stdout.readline()
        assert line.startswith("RESULT "), line + a.stderr.read() if a.stderr else line
        run_id = json.loads(line[7:])["id"]
        deadline = time.monotonic() + 240
        while not os.path.exists(ready):  # the batch job runs its ranks
            assert time.monotonic() < deadline and a.poll() is None, "the job never ran"
            time.sleep(0.1)
    finally:
        a.send_signal(signal.SIGKILL)  # ip netns exec execs: this is the kernel itself
        a.wait()
        if a.stdout is not None:
            a.stdout.close()
        if a.stderr is not None:
            a.stderr.close()
    assert len(slurm.queue()) == 1 and "RUNNING" in slurm.queue()[0]
    done = subprocess.run(
        slurm.command(kernel_script(tmp_path, "b.py", FOLLOW.format(run_id=run_id, go=go))),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = result_of(done.stdout, done.stderr)
    assert result["status"] == "running"
    assert result["cluster"].startswith("slurm job ")
    assert result["before"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert result["after"] == [float(i) for i in range(10)]
    assert result["value"] == ["0", "1"]  # rank 0 and rank 1 on the two nodes
    assert result["left"] == 0


QUEUED = """
run = nbddp.notebook_launch(lambda: 1, cluster=nbddp.SlurmCluster(nodes=2), device="cpu",
                            display="none", detach=True)
print("RESULT " + json.dumps({"id": run.id}), flush=True)
"""

STOP_QUEUED = """
run = nbddp.attach({run_id!r}, display="none")
run.stop()
print("RESULT " + json.dumps({{"status": run.status, "listed": nbddp.runs()[0].status}}))
"""


def test_a_run_still_queued_is_stopped_by_cancelling_its_job(slurm, tmp_path):
    runs = tmp_path / "runs"
    env = environment(slurm, runs)
    holder = slurm.run(
        ["sbatch", "--parsable", "--nodes=2", "--output=/dev/null", "--wrap=exec sleep 300"]
    )
    assert holder.returncode == 0, holder.stderr
    try:
        done = subprocess.run(
            slurm.command(kernel_script(tmp_path, "a.py", QUEUED)),
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        run_id = result_of(done.stdout, done.stderr)["id"]
        assert any("PENDING" in job for job in slurm.queue())
        done = subprocess.run(
            slurm.command(kernel_script(tmp_path, "b.py", STOP_QUEUED.format(run_id=run_id))),
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        result = result_of(done.stdout, done.stderr)
        assert result == {"status": "stopped", "listed": "stopped"}
    finally:
        slurm.run(["scancel", holder.stdout.strip()])
