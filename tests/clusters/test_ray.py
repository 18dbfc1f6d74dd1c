"""Launches on a Ray cluster of two simulated nodes (``ray.cluster_utils.Cluster``: two raylets
on this machine, each with one CPU), one rank per node, gloo: everything that holds on one
machine holds here, and nothing is left on any node. Every address is on the loopback
interface (127.0.0.2: Ray rewrites 127.0.0.1 to the machine's outward address)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import in_all_reduce, running, starts_nothing, wait_until
from sharing import within

import nbddp
from nbddp import LaunchTimeout, RunStopped, WorkerError

# Ray is imported where a test uses it, not here: every worker collects this file, one runs it
# (an import of Ray costs ~3 core-s)
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed: pip install -e '.[ray]'", allow_module_level=True)
pytestmark = [pytest.mark.e2e, pytest.mark.ray]
NODE_IP = "127.0.0.2"
RAY = {"cluster": "ray", "display": "none", "device": "cpu"}


@pytest.fixture(scope="module", autouse=True)
def like_notebook_code():
    """This module's functions travel by value, as a notebook's do: the nodes cannot import
    this test module."""
    import sys

    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no reports to the outside world
    simulated = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": NODE_IP, "include_dashboard": False},
    )
    simulated.add_node(num_cpus=1, node_ip_address=NODE_IP)
    ray.init(address=simulated.address, log_to_driver=False, _node_ip_address=NODE_IP)
    try:
        yield simulated
    finally:
        from nbddp.clusters.ray import cluster as ray_cluster

        ray.shutdown()
        ray_cluster._by_address.clear()
        simulated.shutdown()


@pytest.fixture
def helpers(cluster):
    """Every node helper's pid: a rank's grandparent (helper -> forkserver -> rank)."""
    from nbddp.clusters.ray import cluster as ray_cluster

    nbddp.notebook_launch(abs, (-1,), **RAY)  # helpers up and warm
    registry = ray_cluster.named("ray")
    return {node: registry.info(node)["pid"] for node in registry._helpers}


@pytest.fixture(autouse=True)
def nothing_left(request):
    yield
    if "cluster" not in request.fixturenames:
        return
    from ray.util import placement_group_table

    from nbddp.clusters import choice
    from nbddp.clusters.ray import cluster as ray_cluster

    for kept in {choice._default, *ray_cluster._by_address.values()} - {None}:
        kept.release_reservations()  # a launch's is kept a few seconds for the next one
    states = {p["state"] for p in placement_group_table().values()}
    assert states <= {"REMOVED"}, f"placement groups left: {states}"


def where_am_i() -> dict:
    import torch
    import torch.distributed as dist

    total = torch.ones(1) * (nbddp.rank() + 1)
    dist.all_reduce(total)
    return {
        "rank": nbddp.rank(),
        "sum": total.item(),
        "pid": os.getpid(),
        "helper": psutil.Process(os.getppid()).ppid(),
        "env": {
            k: os.environ[k]
            for k in (
                "RANK",
                "LOCAL_RANK",
                "GROUP_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "GROUP_WORLD_SIZE",
                "MASTER_ADDR",
                "GLOO_SOCKET_IFNAME",
            )
        },
    }


def test_ranks_run_on_different_nodes_and_see_the_torchrun_environment(cluster, helpers):
    ranks = nbddp.notebook_launch(where_am_i, **RAY, return_all=True)
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    assert {r["helper"] for r in ranks} == set(helpers.values())  # one rank on each node
    for rank, facts in enumerate(ranks):
        assert facts["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "GROUP_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_WORLD_SIZE": "2",
            "MASTER_ADDR": NODE_IP,
            "GLOO_SOCKET_IFNAME": "lo",
        }
    assert nbddp.last_run().nodes == (NODE_IP, NODE_IP)
    assert nbddp.notebook_launch(where_am_i, **RAY)["rank"] == 0  # rank 0's alone
    for facts in ranks:
        assert not running(facts["pid"]), "a rank outlived its launch"


def logs_per_rank(steps: int) -> None:
    for step in nbddp.progress(range(steps), desc="steps"):
        nbddp.log(loss=float(nbddp.rank()), step=float(step))
        print(f"step {step} on rank {nbddp.rank()}", flush=True)


def test_live_rows_are_averaged_across_nodes_and_rank_0_output_comes_back(cluster, capsys):
    nbddp.notebook_launch(logs_per_rank, (5,), **RAY)
    run = nbddp.last_run()
    assert [row["loss"] for row in run.history] == [0.5] * 5
    assert run._state.snapshot().bars[0].n == 5
    out = capsys.readouterr().out
    assert "step 4 on rank 0" in out and "on rank 1" not in out


def raises_on_rank_one() -> None:
    if nbddp.rank() == 1:
        raise KeyError("missing feature")
    time.sleep(60)


def test_a_raising_rank_fails_the_run_fast_with_rank_node_and_cause(cluster):
    started = time.monotonic()
    with pytest.raises(KeyError) as info:
        nbddp.notebook_launch(raises_on_rank_one, **RAY)
    error = info.value
    assert isinstance(error, WorkerError) and (error.rank, error.node) == (1, NODE_IP)
    assert "raise KeyError" in error.remote_traceback
    assert isinstance(error.__cause__, KeyError)
    assert time.monotonic() - started < within(10)
    assert nbddp.last_run().status == "failed"


def kills_rank_one() -> None:
    if nbddp.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_a_killed_rank_is_named_with_its_signal(cluster):
    with pytest.raises(WorkerError) as info:
        nbddp.notebook_launch(kills_rank_one, **RAY)
    assert (info.value.rank, info.value.exitcode, info.value.node) == (1, -9, NODE_IP)


def sleeps(seconds: float, folder: str | None = None) -> None:
    """Sleep, once this rank said it runs (a file ``rank<n>`` in ``folder``)."""
    if folder is not None:
        open(os.path.join(folder, f"rank{nbddp.rank()}"), "w").close()
    time.sleep(seconds)


def every_rank_runs(folder: Path, ranks: int = 2) -> bool:
    return wait_until(lambda: len(os.listdir(folder)) == ranks, 60)


def test_stop_and_timeout_end_every_rank(cluster, tmp_path):
    run = nbddp.notebook_launch(sleeps, (60, str(tmp_path)), **RAY, block=False)
    assert every_rank_runs(tmp_path)
    started = time.monotonic()
    assert run.stop() and run.status == "stopped"
    assert time.monotonic() - started < within(5)
    with pytest.raises(RunStopped):
        run.result()
    with pytest.raises(LaunchTimeout):
        nbddp.notebook_launch(sleeps, (60,), **RAY, timeout=3)


def test_impossible_requests_are_refused_before_anything_starts(cluster):
    with starts_nothing():
        with pytest.raises(ValueError, match=r"2 alive node\(s\) can hold 1 rank\(s\)"):
            nbddp.notebook_launch(abs, (-1,), **RAY, nodes=3)
        with pytest.raises(ValueError, match="no node of the cluster has a GPU"):
            nbddp.notebook_launch(abs, (-1,), cluster="ray", device="cuda")
        with pytest.raises(ValueError, match="nodes=2 x workers_per_node=1 is 2"):
            nbddp.notebook_launch(abs, (-1,), **RAY, num_workers=3)


def test_a_module_no_node_can_import_is_refused_before_any_rank_starts(helpers):
    """Only the node can say what it cannot import: its helper (the node's warm helper, up
    here as after any launch; a first launch starts it to ask) is asked, and nothing else
    starts. Apart from the checks above, which need no node, so that neither passes only
    because an earlier test started the helpers."""
    uses_a_local_module = _uses(_a_module_only_in_the_kernel())
    refused = pytest.raises(ValueError, match=r"nbddp_only_here, which node .* cannot import")
    with starts_nothing(), refused:
        nbddp.notebook_launch(uses_a_local_module, **RAY)


def _a_module_only_in_the_kernel():
    """A module the notebook imported from its folder, which the nodes do not have."""
    import sys
    import tempfile

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "nbddp_only_here.py"), "w") as f:
        f.write("VALUE = 1\n")
    sys.path.insert(0, folder)
    try:
        import nbddp_only_here

        return nbddp_only_here
    finally:
        sys.path.remove(folder)


def _uses(module):
    return lambda: module.VALUE


def test_a_launch_right_after_another_starts_on_its_reservation(cluster):
    from ray.util import placement_group_table

    assert nbddp.notebook_launch(abs, (-1,), **RAY, num_workers=2) == 1
    kept = {k for k, p in placement_group_table().items() if p["state"] == "CREATED"}
    assert len(kept) == 1  # kept for the next launch
    assert nbddp.notebook_launch(abs, (-2,), **RAY, num_workers=2) == 2
    now = {k for k, p in placement_group_table().items() if p["state"] == "CREATED"}
    assert now == kept  # the same one, not a new reservation


def test_the_default_cluster_is_used_by_later_launches(cluster):
    nbddp.set_cluster("ray")
    try:
        assert nbddp.notebook_launch(where_am_i, display="none", device="cpu")["sum"] == 3.0
        assert nbddp.last_run().nodes == (NODE_IP, NODE_IP)
    finally:
        nbddp.set_cluster(None)
    assert nbddp.notebook_launch(os.getpid, num_workers=1) == os.getpid()  # this machine again


def lose_the_worker_node(simulated) -> None:
    """Kill the one node besides the head, whichever it is now: a test that lost one before
    added a fresh node in its place, so the node the cluster started with may be gone."""
    [worker] = simulated.worker_nodes
    simulated.remove_node(worker)


def test_a_lost_node_ends_the_run_and_is_named(cluster, helpers, tmp_path):
    run = nbddp.notebook_launch(sleeps, (60, str(tmp_path)), **RAY, block=False)
    assert every_rank_runs(tmp_path)
    lose_the_worker_node(cluster)
    try:
        assert run.wait(timeout=60)
        with pytest.raises(WorkerError) as info:
            run.result()
        assert info.value.node == NODE_IP and "lost with its node" in str(info.value)
    finally:
        cluster.add_node(num_cpus=1, node_ip_address=NODE_IP)  # two nodes again


def sleeps_the_first_time(folder: str) -> int:
    """The first world sleeps (its node will be lost); the restarted one returns."""
    if not os.path.exists(os.path.join(folder, f"rank{nbddp.rank()}")):  # this rank's first
        sleeps(60, folder)
    return nbddp.world_size()


def test_max_restarts_restarts_the_world_after_a_lost_node(cluster, helpers, tmp_path):
    run = nbddp.notebook_launch(
        sleeps_the_first_time, (str(tmp_path),), **RAY, block=False, max_restarts=1
    )
    try:
        assert every_rank_runs(tmp_path)
        lose_the_worker_node(cluster)
        cluster.add_node(num_cpus=1, node_ip_address=NODE_IP)  # room for the restarted world
        assert run.wait(timeout=120)
        assert run.result() == 2 and run.status == "succeeded"
        [(_, cause)] = run.restarts
        assert isinstance(cause, WorkerError) and "lost with its node" in str(cause)
    finally:
        run.stop()


def test_a_ddp_cell_runs_on_the_cluster_from_a_kernel(cluster, kernel_factory):
    simulated = cluster
    kernel = kernel_factory()
    try:
        out, reply = kernel.run(
            "import os, ray, nbddp\n"
            "os.environ['RAY_USAGE_STATS_ENABLED'] = '0'\n"
            f"ray.init(address={simulated.address!r}, log_to_driver=False, "
            f"_node_ip_address={NODE_IP!r})\n"
            "%load_ext nbddp"
        )
        assert reply["status"] == "ok", out
        base = 20
        kernel.run(f"base = {base}")
        out, reply = kernel.run(
            "%%ddp --cluster ray --nodes 2 --workers-per-node 1 --device cpu --display none\n"
            "import torch, torch.distributed as dist\n"
            "total = torch.tensor([float(base + nbddp.rank())])\n"
            "dist.all_reduce(total)\n"
            "where = os.environ['GROUP_RANK']\n"
            "from IPython.display import HTML\n"
            "print('before')\n"
            "display(HTML('<b>from the cluster</b>'))\n"
            "print('after')"
        )
        assert reply["status"] == "ok", out
        # rank 0's rich output comes back through its node, in order with its text
        assert "before\n<b>from the cluster</b>\nafter\n" in out, out
        out, _ = kernel.run("print(total.item(), where, nbddp.last_run().nodes)")
        assert out.strip() == f"{2 * base + 1}.0 0 ('{NODE_IP}', '{NODE_IP}')"
    finally:
        kernel.shutdown()


def test_a_ranks_pdb_on_a_ray_node_is_answered_in_the_notebooks_input_box(cluster, kernel_factory):
    """breakpoint() on rank 1, on the second node: its prompt travels over the node's stream
    to the kernel's input box, and the lines typed there back to it."""
    simulated = cluster
    kernel = kernel_factory()
    try:
        out, reply = kernel.run(
            "import os, ray, nbddp\n"
            "os.environ['RAY_USAGE_STATS_ENABLED'] = '0'\n"
            f"ray.init(address={simulated.address!r}, log_to_driver=False, "
            f"_node_ip_address={NODE_IP!r})\n"
            "%load_ext nbddp"
        )
        assert reply["status"] == "ok", out
        prompts: list[str] = []
        typed = iter(["p where, x", "c"])
        out, reply = kernel.run_answering(
            "%%ddp --cluster ray --nodes 2 --workers-per-node 1 --device cpu --display none\n"
            "where = os.environ['GROUP_RANK']\n"
            "x = 100 + nbddp.rank()\n"
            "if nbddp.rank() == 1:\n"
            "    breakpoint()\n"
            "y = x\n",
            lambda prompt: (prompts.append(prompt), next(typed))[1],
        )
        assert reply["status"] == "ok", out
        assert prompts == ["(Pdb rank 1) "] * 2
        assert "('1', 101)" in out  # rank 1, on node 1
        assert f"Cell In[{reply['execution_count']}], line 6" in out
    finally:
        kernel.shutdown()


# -- sessions on the cluster ---------------------------------------------------------------


def count_on_rank():
    global counter
    try:
        counter += 1  # left by the previous run, on the rank
    except NameError:
        counter = 1
    print(f"rank {nbddp.rank()} counted {counter}")
    return counter


def rank_one_raises():
    if nbddp.rank() == 1:
        raise ValueError("rank 1 on its node")
    return "fine"


def rank_one_raises_while_rank_zero_waits(go: str):
    import torch
    import torch.distributed as dist

    if nbddp.rank() == 1:
        # the test says go once the roll-call finds rank 0 inside the native wait: the
        # interrupt that follows this failure could reach it in Python before that
        while not os.path.exists(go):
            time.sleep(0.02)
        raise ValueError("rank 1 fails first")
    dist.all_reduce(torch.ones(1))


def test_a_session_keeps_its_ranks_on_every_node(cluster, capsys):
    with nbddp.Session(cluster="ray", device="cpu") as session:
        assert repr(session) == "<nbddp.Session 2 nodes × 1 cpu (gloo), alive>"
        assert session.nodes == (NODE_IP, NODE_IP)
        first = {row["pid"] for row in session.status()}
        for expected in (1, 2, 3):
            values = session.run(count_on_rank, return_all=True, display="none")
            assert values == [expected, expected]
        assert "rank 0 counted 3" in capsys.readouterr().out  # rank 0's print, forwarded
        with pytest.raises(ValueError, match="rank 1 on its node") as raised:
            session.run(rank_one_raises, display="none")
        assert raised.value.node == NODE_IP and "restarted" not in str(raised.value)
        assert session.run(count_on_rank, display="none") == 4  # the state survived
        assert {row["pid"] for row in session.status()} == first  # the very same processes


def checks_every_step(folder: str) -> tuple[int, int]:
    """Steps until a graceful stop, once this rank said it checks (a file in ``folder``)."""
    done = 0
    while not nbddp.stopping():
        if done == 1:
            open(os.path.join(folder, f"rank{nbddp.rank()}"), "w").close()
        done += 1
        time.sleep(0.01)
    return nbddp.rank(), done


def test_a_graceful_stop_of_a_session_task_reaches_every_node(cluster, tmp_path):
    """The agreement travels over each node's stream: both ranks stop at one step, and the
    same processes serve the next task."""
    with nbddp.Session(cluster="ray", device="cpu") as session:
        first = {row["pid"] for row in session.status()}
        run = session.run(
            checks_every_step, (str(tmp_path),), return_all=True, display="none", block=False
        )
        assert every_rank_runs(tmp_path)
        assert run.stop(graceful=True, timeout=30) and run.status == "stopped"
        with pytest.warns(nbddp.NbddpWarning, match="stopped gracefully"):
            (_, zero), (_, one) = run.result()
        assert zero == one > 1
        assert session.run(count_on_rank, display="none") == 1
        assert {row["pid"] for row in session.status()} == first


def test_a_stuck_session_on_the_cluster_restarts_with_fresh_ranks(cluster, tmp_path):
    with nbddp.Session(cluster="ray", device="cpu") as session:
        session.run(count_on_rank, display="none")
        first = {row["pid"] for row in session.status()}
        go, before, found = tmp_path / "go", nbddp.last_run(), []

        def rank_0_waits_inside() -> bool:
            run = nbddp.last_run()
            return run is not before and in_all_reduce(run, 0)

        def say_go() -> None:  # once the roll-call finds rank 0 inside the native wait
            found.append(wait_until(rank_0_waits_inside, timeout=60))
            go.touch()  # (also when not found: the test fails below, not at its timeout)

        watcher = threading.Thread(target=say_go, daemon=True)
        watcher.start()
        with pytest.raises(WorkerError, match="The session was restarted"):
            session.run(rank_one_raises_while_rank_zero_waits, (str(go),), display="none")
        watcher.join()
        assert found == [True], "the roll-call never found rank 0 inside all_reduce"
        assert session.alive
        assert not first & {row["pid"] for row in session.status()}
        assert session.run(count_on_rank, return_all=True, display="none") == [1, 1]


def test_a_node_lost_during_a_session_task_is_named(cluster, tmp_path):
    """The session's judge hears a lost node as a launch's does (``NodeLost``), so the error
    names the node; before, a session said only that the rank died."""
    session = nbddp.Session(cluster="ray", device="cpu")
    try:
        run = session.run(sleeps, (60, str(tmp_path)), display="none", block=False)
        assert every_rank_runs(tmp_path)
        lose_the_worker_node(cluster)
        assert run.wait(timeout=60)
        with pytest.raises(WorkerError) as info:
            run.result()
        assert info.value.node == NODE_IP and "lost with its node" in str(info.value)
    finally:
        session.close()
        cluster.add_node(num_cpus=1, node_ip_address=NODE_IP)  # two nodes again


def all_reduce_cut_short_on_rank_zero(token):
    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if nbddp.rank() == 1:
        store.wait([token])  # rank 0 issued its all_reduce (each node got the task when it did)
        raise ValueError("rank 1 fails")
    bound = dist.ProcessGroup.__dict__["allreduce"]
    issue = dist.ProcessGroup.allreduce

    def issue_then_linger(self, *args, **kwargs):
        work = issue(self, *args, **kwargs)
        store.set(token, "issued")
        time.sleep(60)  # between the issue and work.wait(): the interrupt lands here
        return work

    dist.ProcessGroup.allreduce = issue_then_linger
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        dist.ProcessGroup.allreduce = bound


def test_a_session_on_the_cluster_never_keeps_collectives_out_of_step(cluster):
    """Issue #27, on two nodes: rank 0 came back to idle with an all_reduce rank 1 never
    matched; the ranks are replaced, and the next all_reduce is right, at once."""
    with nbddp.Session(cluster="ray", device="cpu") as session:
        session.run(count_on_rank, display="none")
        with pytest.raises(WorkerError, match="rank 1 fails") as raised:
            session.run(all_reduce_cut_short_on_rank_zero, ("cut-short",), display="none")
        # not stuck (both ranks came back), but out of step: fresh ranks on both nodes
        assert "the ranks' collectives were out of step" in str(raised.value)
        started = time.monotonic()
        results = session.run(where_am_i, return_all=True, timeout=15, display="none")
        assert [r["sum"] for r in results] == [3.0, 3.0]
        assert time.monotonic() - started < within(10)  # no hang until the timeout
        assert "out of step" in session.status()[0]["restarted"]


def stalls(hog: bool) -> None:
    import re

    import torch.distributed as dist

    if nbddp.rank() == 1:
        if hog:  # the GIL held: only the node's signal dump can say where
            re.match(r"(a+)+$", "a" * 40 + "b")
        time.sleep(600)
    dist.barrier()


@pytest.mark.parametrize("hog", [False, True])
def test_a_stalled_launch_on_two_nodes_names_the_odd_rank(cluster, hog):
    """The ranks' stacks are not taken at one instant (a rank whose listener cannot get the
    GIL is dumped by its node's signal, later), so one answer can show rank 1 in ``fn`` and
    rank 0 still joining, as CI saw once: the test waits for both ranks to be where they
    stay, not for rank 1 alone."""
    run = nbddp.notebook_launch(stalls, (hog,), **RAY, block=False)
    waits = "in match()" if hog else "in time.sleep(600)"
    try:
        deadline = time.monotonic() + 90
        while True:
            stacks = run.stacks()
            rollcall = stacks.rollcall()
            settled = waits in rollcall and "rank 0 waits in barrier" in rollcall
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    finally:
        run.stop()
    assert "rank 1 is the odd one out" in rollcall, stacks
    assert "rank 0 waits in barrier" in rollcall, stacks
    assert re.search(rf"rank 1 is at \S*test_ray\.py:\d+ {re.escape(waits)}", rollcall), stacks
    if hog:
        assert "faulthandler" in str(stacks)


def write_at_exit(path: str) -> int:
    import atexit

    import nbddp

    rank = nbddp.rank()

    def write() -> None:
        with open(f"{path}.{rank}", "w") as f:
            f.write("ran")

    atexit.register(write)
    return rank


def test_exit_handlers_run_on_every_node_after_a_launch_and_a_session(cluster, tmp_path):
    """A rank that ended normally runs its exit handlers on its node too (worker/rank/exiting.py):
    after a launch, and at a session's close()."""
    launched = str(tmp_path / "launched")
    assert nbddp.notebook_launch(write_at_exit, (launched,), **RAY) == 0
    assert sorted(os.listdir(tmp_path)) == ["launched.0", "launched.1"]
    closed = str(tmp_path / "closed")
    with nbddp.Session(cluster="ray", device="cpu") as session:
        session.run(write_at_exit, (closed,), display="none")
        assert not os.path.exists(f"{closed}.0")  # the ranks are still up
    assert os.path.exists(f"{closed}.0") and os.path.exists(f"{closed}.1")


NODES_SCRIPT = """\
import os, sys
import psutil
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
helper = psutil.Process(os.getppid()).ppid()
with open(sys.argv[1] + os.environ["RANK"], "w") as f:
    f.write(f"{os.environ['GROUP_RANK']} {total.item():.0f} {helper} {os.getcwd()}")
if os.environ["RANK"] == "1":
    sys.exit(int(sys.argv[2]))
"""


def test_a_script_runs_on_every_node_and_its_exit_code_names_the_node(
    cluster, helpers, tmp_path, monkeypatch
):
    script = tmp_path / "nodes.py"
    script.write_text(NODES_SCRIPT)
    monkeypatch.chdir(tmp_path)  # the ranks' working directory: the kernel's
    assert nbddp.run_script("nodes.py", [str(tmp_path / "seen"), "0"], **RAY) == 0
    seen = [(tmp_path / f"seen{rank}").read_text().split() for rank in (0, 1)]
    assert [(group, total, cwd) for group, total, _, cwd in seen] == [
        ("0", "2", str(tmp_path)),
        ("1", "2", str(tmp_path)),
    ]
    assert {int(helper) for _, _, helper, _ in seen} == set(helpers.values())  # one per node
    with pytest.raises(WorkerError) as info:
        nbddp.run_script("nodes.py", [str(tmp_path / "again"), "3"], **RAY)
    assert (info.value.rank, info.value.exitcode, info.value.node) == (1, 3, NODE_IP)
    assert f'File "{script}", line 13, in <module>' in info.value.remote_traceback
