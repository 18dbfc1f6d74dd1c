"""``cluster="slurm"`` and ``nbddp.SlurmCluster`` on a real Slurm (``tests/slurm_cluster.py``:
``slurmctld`` and two ``slurmd`` in two network namespaces, 10.201.0.1 and .2).

The kernel side is a Python process in node A's namespace, as a notebook's kernel would be on
a login node: under ``salloc --nodes=2`` it runs inside an allocation (``SLURM_JOB_ID``, for
``cluster="slurm"``), without it it asks for one (``SlurmCluster``). Each script prints one
``RESULT <json>`` line. Every test checks that nothing is left: no job in ``squeue``, no node
helper, no rank."""

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

HELPER = "nbddp.clusters.slurm.node"
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(autouse=True)
def nothing_left(slurm):
    yield
    deadline = time.monotonic() + 20
    while (slurm.queue() or _ours()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left, running = slurm.queue(), _ours()
    for job in left:  # one test's leftovers must not fail the next ones
        slurm.run(["scancel", job.split()[0]])
    assert left == [], "a job was left in the queue"
    assert running == [], "a node helper or a rank was left running"


def _ours() -> list[str]:
    """nbddp's node helpers and the ranks they start, in either node's namespace (never
    another test's processes on this machine)."""
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
        if alive and (HELPER in line or "NBDDP_RUN_ID" in env):
            found.append(f"{proc.pid} {line[:80]}")
    return found


def _kernel_process(pid: int) -> psutil.Process:
    """The kernel's Python: ``pid`` itself (``ip netns exec`` execs it) or salloc's child."""
    top = psutil.Process(pid)
    return next(
        p for p in [top, *top.children(recursive=True)] if p.cmdline()[:1] == [sys.executable]
    )


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "kernel.py"
    head = "import json, os, sys, time\nimport nbddp\n"
    path.write_text(head + textwrap.dedent(body))
    return path


def kernel(slurm, path: Path, inside: bool) -> list[str]:
    """The command that runs ``path`` as the kernel, in node A's namespace."""
    python = [sys.executable, str(path)]
    return slurm.command(["salloc", "--nodes=2", "--quiet", *python] if inside else python)


def environment(slurm) -> dict[str, str]:
    env = {**slurm.env, "PYTHONPATH": ROOT}
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def run_kernel(slurm, tmp_path: Path, body: str, inside: bool = True, timeout: float = 240):
    path = script(tmp_path, body)
    done = subprocess.run(
        kernel(slurm, path, inside),
        env=environment(slurm),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return _result(done.stdout, done.stderr), done


def _result(stdout: str, stderr: str):
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"the kernel printed no RESULT\n{stdout}\n{stderr}")


# -- inside an allocation (cluster="slurm") -------------------------------------------------


def test_a_launch_on_two_nodes_returns_rank_0s_value_and_names_the_nodes(slurm, tmp_path):
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        def where(scale):
            import torch, torch.distributed as dist
            t = torch.ones(1) * (dist.get_rank() + 1) * scale
            dist.all_reduce(t)
            env = {k: os.environ[k] for k in ("RANK", "GROUP_RANK", "MASTER_ADDR",
                                              "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
            env["launchers"] = sorted(k for k in os.environ
                                      if k.startswith(("SLURM", "PMI", "NBDDP_HELPER")))
            env["helper"] = __import__("psutil").Process(os.getppid()).ppid()
            return [t.item(), env]

        first = nbddp.notebook_launch(where, (2.0,), cluster="slurm", return_all=True,
                                      display="none")
        nodes = list(nbddp.last_run().nodes)
        again = nbddp.notebook_launch(where, (1.0,), cluster="slurm", nodes=2,
                                      workers_per_node=1, return_all=True, display="none")
        print("RESULT " + json.dumps([first, nodes, again]))
        """,
    )
    first, nodes, again = result
    assert nodes == ["10.201.0.1", "10.201.0.2"]
    assert [value for value, _ in first] == [6.0, 6.0]
    for rank, (_, env) in enumerate(first):
        assert env["RANK"] == env["GROUP_RANK"] == str(rank)
        assert env["MASTER_ADDR"] == "10.201.0.1"
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "1")
        assert env["launchers"] == [], "a scheduler's variables reached a rank"
    assert [value for value, _ in again] == [3.0, 3.0]
    # the second launch ran on the same warm helpers
    assert [env["helper"] for _, env in again] == [env["helper"] for _, env in first]


def test_a_failing_rank_names_its_node(slurm, tmp_path):
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        def fails():
            import torch.distributed as dist
            if dist.get_rank() == 1:
                raise ValueError("rank 1 gives up")
            time.sleep(3600)

        started = time.monotonic()
        try:
            nbddp.notebook_launch(fails, cluster="slurm", display="none")
        except nbddp.WorkerError as exc:
            print("RESULT " + json.dumps([exc.rank, exc.node, exc.exc_type, str(exc),
                                          time.monotonic() - started]))
        """,
    )
    rank, node, kind, message, took = result
    assert (rank, node, kind) == (1, "10.201.0.2", "ValueError")
    assert "rank 1 (on 10.201.0.2) raised ValueError: rank 1 gives up" in message
    assert took < 120, f"rank 0 ran on for {took:.0f} s after rank 1 failed"  # not its hour


def test_a_lost_node_fails_the_launch_naming_it_and_the_next_launch_starts_anew(slurm, tmp_path):
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        import psutil, signal

        def loses_node_b():
            import torch.distributed as dist
            if dist.get_rank() == 1:  # its node's helper: the forkserver's parent
                helper = psutil.Process(os.getppid()).parent()
                assert "nbddp.clusters.slurm.node" in " ".join(helper.cmdline())
                helper.send_signal(signal.SIGKILL)
            time.sleep(3600)

        started = time.monotonic()
        try:
            nbddp.notebook_launch(loses_node_b, cluster="slurm", display="none")
        except nbddp.WorkerError as exc:
            error = [exc.rank, exc.node, str(exc), time.monotonic() - started]
        again = nbddp.notebook_launch(abs, (-2,), cluster="slurm", display="none")
        print("RESULT " + json.dumps([error, again]))
        """,
    )
    (rank, node, message, took), again = result
    assert (rank, node) == (1, "10.201.0.2"), message
    assert "lost" in message, message
    assert took < 120  # not rank 0's hour of sleep
    assert again == 2  # on helpers started anew


def test_stop_timeout_and_rank_0s_output_on_the_allocation(slurm, tmp_path):
    result, done = run_kernel(
        slurm,
        tmp_path,
        """
        def sleeps():
            print(f"rank {nbddp.rank()} says hello", flush=True)
            nbddp.log(step=1)
            time.sleep(300)

        import threading

        class Heard:  # this kernel's stdout, which sets ``hello`` as rank 0's greeting comes
            def __init__(self, stream):
                self.stream = stream
            def write(self, text):
                if "rank 0 says hello" in text:
                    hello.set()
                return self.stream.write(text)
            def __getattr__(self, name):
                return getattr(self.stream, name)

        hello = threading.Event()
        sys.stdout = Heard(sys.stdout)  # where the launch sends rank 0's output
        run = nbddp.notebook_launch(sleeps, cluster="slurm", block=False, display="none")
        assert hello.wait(120), "rank 0's output never came"
        sys.stdout = sys.stdout.stream
        started = time.monotonic()
        stopped = run.stop()
        took_stop = time.monotonic() - started
        started = time.monotonic()
        try:
            nbddp.notebook_launch(sleeps, cluster="slurm", timeout=3, display="none")
            timed_out = False
        except nbddp.LaunchTimeout:
            timed_out = True
        took_timeout = time.monotonic() - started
        print("RESULT " + json.dumps([stopped, run.status, took_stop, timed_out,
                                      took_timeout]))
        """,
    )
    stopped, status, took_stop, timed_out, took_timeout = result
    assert stopped and status == "stopped"
    assert took_stop < 20
    assert timed_out and took_timeout < 30
    assert "rank 0 says hello" in done.stdout  # rank 0's output, through its node
    assert "rank 1 says hello" not in done.stdout


def test_a_ddp_cell_runs_on_the_allocation(slurm, tmp_path):
    result, done = run_kernel(
        slurm,
        tmp_path,
        """
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
        shell.run_cell("%load_ext nbddp")
        shell.run_cell("import os, nbddp; base = 20")
        ran = shell.run_cell(
            "%%ddp --cluster slurm --display none\\n"
            "import torch, torch.distributed as dist\\n"
            "total = torch.tensor([float(base + nbddp.rank())])\\n"
            "dist.all_reduce(total)\\n"
            "where = os.environ['GROUP_RANK']\\n"
        )
        ran.raise_error()
        ns = shell.user_ns
        print("RESULT " + json.dumps([ns["total"].item(), ns["where"],
                                      list(nbddp.last_run().nodes)]))
        """,
    )
    assert result == [41.0, "0", ["10.201.0.1", "10.201.0.2"]], done.stderr


def test_a_session_keeps_its_ranks_for_two_tasks(slurm, tmp_path):
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        def count():
            global counter
            counter = globals().get("counter", 0) + 1
            import torch, torch.distributed as dist
            t = torch.tensor([float(counter)])
            dist.all_reduce(t)
            return [t.item(), os.getpid()]

        with nbddp.Session(cluster="slurm") as session:
            nodes = list(session.nodes)
            first = session.run(count, return_all=True, display="none")
            second = session.run(count, return_all=True, display="none")
        print("RESULT " + json.dumps([nodes, first, second]))
        """,
    )
    nodes, first, second = result
    assert nodes == ["10.201.0.1", "10.201.0.2"]
    assert [v for v, _ in first] == [2.0, 2.0]
    assert [v for v, _ in second] == [4.0, 4.0]  # each rank kept its counter
    assert [p for _, p in second] == [p for _, p in first]  # the same rank processes


def test_a_ranks_pdb_on_the_second_node_is_answered_in_the_kernel(slurm, tmp_path):
    """breakpoint() on rank 1, on node B: its prompt travels over the node helper's stream to
    the kernel, which asks it (here ``input()`` answers as a person would at the input box),
    and the lines typed go back to the rank."""
    result, done = run_kernel(
        slurm,
        tmp_path,
        """
        import builtins
        from nbddp.diagnosis import input_box

        input_box.missing = lambda: ""  # this script's stand-in for the notebook's input box
        typed, prompts = iter(["import os", "p x, os.environ['GROUP_RANK']", "c"]), []
        builtins.input = lambda prompt="": (prompts.append(prompt), next(typed))[1]

        def stops():
            import torch.distributed as dist
            x = 100 + dist.get_rank()
            if dist.get_rank() == 1:
                breakpoint()
            return x

        value = nbddp.notebook_launch(stops, cluster="slurm", display="none")
        print("RESULT " + json.dumps([value, prompts]))
        """,
    )
    assert result == [100, ["(Pdb rank 1) "] * 3]
    assert "(101, '1')" in done.stdout and "-> return x" in done.stdout  # rank 1, node 1


def test_impossible_requests_are_refused_before_anything_starts(slurm, tmp_path):
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        errors = []
        for options in ({"nodes": 3}, {"workers_per_node": 2}, {"num_workers": 3},
                        {"device": "cuda"}):
            try:
                nbddp.notebook_launch(abs, (-1,), cluster="slurm", display="none", **options)
            except ValueError as exc:
                errors.append(str(exc))
        import psutil
        started = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
        print("RESULT " + json.dumps([errors, started]))
        """,
    )
    errors, started = result
    assert len(errors) == 4, errors
    assert "2 alive node(s) can hold 1 rank(s)" in errors[0]
    assert "can hold 2 rank(s)" in errors[1]
    assert "nodes=2 x workers_per_node=1 is 2" in errors[2]
    assert "no node of the cluster has a GPU" in errors[3]
    assert not any("srun" in line for line in started), started  # no helper was started


def test_cluster_slurm_outside_an_allocation_says_to_ask_for_one(slurm, tmp_path):
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        errors = []
        for bad in (lambda: nbddp.notebook_launch(abs, (-1,), cluster="slurm"),
                    lambda: nbddp.SlurmCluster(nodes=0),
                    lambda: nbddp.SlurmCluster(extra_args="--qos=x"),
                    lambda: nbddp.notebook_launch(abs, (-1,), display="none",
                                                  cluster=nbddp.SlurmCluster(nodes=3))):
            try:
                bad()
            except ValueError as exc:
                errors.append(str(exc))
        print("RESULT " + json.dumps(errors))
        """,
        inside=False,
    )
    assert len(result) == 4, result
    assert "not in one (no SLURM_JOB_ID" in result[0] and "nbddp.SlurmCluster(" in result[0]
    assert "nodes=0" in result[1]
    assert "extra_args" in result[2]
    assert "Slurm refused the allocation" in result[3]


# -- an interrupt ---------------------------------------------------------------------------


def test_an_interrupt_ends_every_rank_on_both_nodes(slurm, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    path = script(
        tmp_path,
        f"""
        def sleeps():
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
            time.sleep(300)

        try:
            nbddp.notebook_launch(sleeps, cluster="slurm", display="none")
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            deadline = time.monotonic() + 60  # alive until the test has looked for the ranks
            while not os.path.exists({str(tmp_path / "looked")!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
        """,
    )
    proc = subprocess.Popen(
        kernel(slurm, path, inside=True),
        env=environment(slurm),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [int(p.name) for p in pids.iterdir()]
        assert len(ranks) == 2, "the ranks did not start"
        python = _kernel_process(proc.pid)
        python.send_signal(signal.SIGINT)  # the kernel's interrupt, not salloc's
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")  # the ranks' own output may come first
        assert "INTERRUPTED" in (line.strip() for line in lines)
        assert [pid for pid in ranks if _running(pid)] == [], "ranks outlived the interrupt"
        (tmp_path / "looked").touch()
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


# -- an allocation asked for from a login node ----------------------------------------------


def test_a_slurm_cluster_asks_for_an_allocation_keeps_it_and_releases_it(slurm, tmp_path):
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        import subprocess

        def queue():
            out = subprocess.run(["squeue", "--noheader", "--format=%i %T %D"],
                                 capture_output=True, text=True, check=True).stdout
            return out.split()

        def total():
            import torch, torch.distributed as dist
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()

        cluster = nbddp.SlurmCluster(nodes=2, time="10")
        first = nbddp.notebook_launch(total, cluster=cluster, display="none")
        held = queue()
        with nbddp.Session(cluster=cluster) as session:
            in_session = session.run(total, display="none")
        second = nbddp.notebook_launch(total, cluster=cluster, display="none")
        same_job = queue() == held
        cluster.close()
        print("RESULT " + json.dumps([first, in_session, second, held, same_job, queue(),
                                      cluster.job_id]))
        """,
        inside=False,
    )
    first, in_session, second, held, same_job, after, job_id = result
    assert first == in_session == second == 2.0
    assert held == [job_id, "RUNNING", "2"]
    assert same_job, "a later launch asked for another allocation"
    assert after == []


def test_the_kernels_exit_releases_the_allocation(slurm, tmp_path):
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        cluster = nbddp.SlurmCluster(nodes=2)
        value = nbddp.notebook_launch(abs, (-1,), cluster=cluster, display="none")
        print("RESULT " + json.dumps([value, cluster.job_id]))
        """,  # no close(): the kernel's exit releases it
        inside=False,
    )
    assert result[0] == 1
    assert slurm.queue() == []


def test_a_pending_allocation_shows_its_state_and_an_interrupt_cancels_it(slurm, tmp_path):
    blocker = slurm.run(
        ["sbatch", "--parsable", "--nodes=2", "--output=/dev/null", "--wrap=sleep 300"]
    ).stdout.strip()
    path = script(
        tmp_path,
        """
        import subprocess

        try:
            nbddp.notebook_launch(abs, (-1,), cluster=nbddp.SlurmCluster(nodes=2))
        except KeyboardInterrupt:  # the queue as the interrupt left it, before the exit's
            queue = subprocess.run(["squeue", "--noheader", "--format=%i"],
                                   capture_output=True, text=True).stdout.split()
            print("INTERRUPTED " + json.dumps(queue), flush=True)
        """,
    )
    proc = subprocess.Popen(
        kernel(slurm, path, inside=False),
        env=environment(slurm),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "is PENDING" in line and "Interrupt the kernel to cancel it" in line, line
        pending = line.split("Slurm job ")[1].split()[0]
        assert any(job.split()[0] == pending for job in slurm.queue())
        python = _kernel_process(proc.pid)
        python.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert "INTERRUPTED" in out
        assert json.loads(out.split("INTERRUPTED ")[1]) == [blocker]  # ours was cancelled
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        slurm.run(["scancel", blocker])


def test_slurms_signal_before_the_time_limit_stops_a_launch_gracefully(slurm, tmp_path):
    """The allocation asks Slurm for SIGUSR1 before its time limit, sent to its steps: here
    sent at once (``scancel --signal=USR1``, as Slurm sends it). Every rank stops at one step
    with fn's value; the node helpers live on for the next launch."""
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        import subprocess, warnings

        def loop():
            done = 0
            for _ in nbddp.progress(range(1_000_000)):
                nbddp.log(x=1.0)
                time.sleep(0.01)
                done += 1
            return [done, nbddp.stopping()]

        cluster = nbddp.SlurmCluster(nodes=2, time="10")
        run = nbddp.notebook_launch(loop, cluster=cluster, display="none", block=False,
                                    return_all=True)
        while len(run.history) < 10:
            time.sleep(0.05)
        subprocess.run(["scancel", "--signal=USR1", cluster.job_id], check=True)
        run.wait(60)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = run.result()
        again = nbddp.notebook_launch(lambda: 5, cluster=cluster, display="none")
        cluster.close()
        print("RESULT " + json.dumps([run.status, value, [str(w.message) for w in caught],
                                      again]))
        """,
        inside=False,
    )
    status, value, warned, again = result
    assert status == "stopped"
    assert value[0][0] == value[1][0] >= 10 and value[0][1] and value[1][1]  # one step, both
    assert any("Slurm's signal before the time limit" in w for w in warned), warned
    assert again == 5


def test_a_script_runs_on_both_nodes_and_its_exit_code_names_the_node(slurm, tmp_path):
    """``run_script`` on the allocation: each node's rank runs the script (on the shared
    file system) in the kernel's working directory; a rank's ``sys.exit(3)`` names its node."""
    (tmp_path / "nodes.py").write_text(
        textwrap.dedent(
            """\
            import os, sys
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")
            total = torch.ones(1)
            dist.all_reduce(total)
            with open(sys.argv[1] + os.environ["RANK"], "w") as f:
                f.write(f"{os.environ['GROUP_RANK']} {total.item():.0f} {os.getcwd()}")
            if os.environ["RANK"] == "1":
                sys.exit(int(sys.argv[2]))
            """
        )
    )
    result, _ = run_kernel(
        slurm,
        tmp_path,
        """
        code = nbddp.run_script("nodes.py", ["seen", "0"], cluster="slurm", display="none")
        seen = [open(f"seen{rank}").read() for rank in (0, 1)]
        try:
            nbddp.run_script("nodes.py", ["again", "3"], cluster="slurm", display="none")
        except nbddp.WorkerError as exc:
            failed = [exc.rank, exc.exitcode, exc.node, exc.remote_traceback]
        print("RESULT " + json.dumps([code, seen, failed]))
        """,
    )
    code, seen, (rank, exitcode, node, trace) = result
    assert code == 0
    assert seen == [f"0 2 {tmp_path}", f"1 2 {tmp_path}"]
    assert (rank, exitcode, node) == (1, 3, "10.201.0.2")
    assert f'File "{tmp_path / "nodes.py"}", line 11, in <module>' in trace
