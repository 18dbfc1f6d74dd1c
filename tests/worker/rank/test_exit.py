"""What runs when a rank ends, in real ranks: after a normal end its exit handlers run (a file
written, a buffered log flushed, a W&B or MLflow run finished without an explicit finish) and
the processes it started get SIGTERM first, all within a bound that cuts a stuck handler
with a warning; after a failure nothing of it runs. The same for a session's close()."""

from __future__ import annotations

import glob
import os
import struct
import time

import pytest

import nbddp
from nbddp.display.html import header_html
from nbddp.planning import make_plan
from nbddp.rules import referee as referee_module
from nbddp.rules.referee import Referee
from nbddp.state.run import RunState
from nbddp.wire.messages import Ended, Received, Result

TWO_CPU = {"num_workers": 2, "device": "cpu", "display": "none"}


def register_writer(path: str, how: str = "return") -> str:
    import atexit
    import sys

    import nbddp

    def write() -> None:  # also sees the rank's place: the process group is still there
        with open(f"{path}.{nbddp.rank()}", "w") as f:
            f.write(f"rank {nbddp.rank()} of {nbddp.world_size()}")

    atexit.register(write)
    if how == "sys.exit(0)":
        sys.exit(0)
    return "returned"


@pytest.mark.ranks
@pytest.mark.parametrize("how", ["return", "sys.exit(0)"])
def test_an_atexit_handler_registered_in_fn_runs_on_every_rank(tmp_path, how):
    path = str(tmp_path / "handler")
    value = nbddp.notebook_launch(register_writer, args=(path, how), **TWO_CPU)
    assert value == ("returned" if how == "return" else None)
    for rank in range(2):
        with open(f"{path}.{rank}") as f:
            assert f.read() == f"rank {rank} of 2"


def log_buffered(path: str, records: int) -> None:
    import logging
    import logging.handlers

    import nbddp

    if nbddp.rank() != 0:
        return
    target = logging.FileHandler(path)
    buffered = logging.handlers.MemoryHandler(10_000, logging.CRITICAL, target)
    logger = logging.getLogger("nbddp-test-buffered")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(buffered)
    for step in range(records):
        logger.info("step %d", step)  # stays in the buffer: only logging.shutdown flushes it


@pytest.mark.ranks
def test_a_memory_handler_buffer_reaches_its_file(tmp_path):
    path = tmp_path / "buffered.log"
    nbddp.notebook_launch(log_buffered, args=(str(path), 20), **TWO_CPU)
    assert path.read_text().splitlines() == [f"step {step}" for step in range(20)]


def finish_work_in_a_pool(path: str) -> None:
    import concurrent.futures
    import time

    def slow_write() -> None:
        time.sleep(0.3)
        with open(path, "w") as f:
            f.write("done")

    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(slow_write)  # neither waited for nor shut down: the interpreter's exit joins it


@pytest.mark.ranks
def test_a_thread_pool_finishes_its_work_as_at_a_normal_exit(tmp_path):
    path = tmp_path / "pool"
    nbddp.notebook_launch(finish_work_in_a_pool, args=(str(path),), num_workers=2, device="cpu")
    assert path.read_text() == "done"


def start_children(path: str, ignore_sigterm: bool) -> None:
    import subprocess
    import sys

    import nbddp

    code = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    open(sys.argv[1], 'w').write('SIGTERM')\n"
        "    sys.exit(0)\n"
        f"signal.signal(signal.SIGTERM, {'signal.SIG_IGN' if ignore_sigterm else 'bye'})\n"
        "print('ready', flush=True)\n"
        "time.sleep(1000)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, f"{path}.{nbddp.rank()}"], stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    child.stdout.readline()  # its handler is in place


@pytest.mark.ranks
def test_processes_a_rank_started_get_sigterm_and_end_by_themselves(tmp_path):
    path = str(tmp_path / "child")
    nbddp.notebook_launch(start_children, args=(path, False), **TWO_CPU)
    for rank in range(2):
        with open(f"{path}.{rank}") as f:
            assert f.read() == "SIGTERM"


@pytest.mark.ranks
def test_a_process_that_ignores_sigterm_is_killed_at_the_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("NBDDP_EXIT_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.warns(nbddp.NbddpWarning) as caught:
        nbddp.notebook_launch(start_children, args=(str(tmp_path / "c"), True), **TWO_CPU)
    assert time.monotonic() - start < 25  # the 1 s bound, not the default 30 s
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}'s exit: process python")
        assert "did not end within the 1 s after SIGTERM (NBDDP_EXIT_TIMEOUT): killed" in message


def hang_at_exit(also_raise: bool) -> int:
    import atexit
    import subprocess
    import time

    import nbddp

    def never_returns() -> None:
        while True:
            time.sleep(1)

    def fails() -> None:
        raise ValueError("disk full")

    atexit.register(never_returns)
    if also_raise:
        atexit.register(fails)  # runs first (last registered), then never_returns hangs
    subprocess.Popen(["sleep", "1000"])  # still running when the bound cuts the handler
    return nbddp.rank()


HANDLER = "test_exit.hang_at_exit.<locals>"  # named as where it was defined


@pytest.mark.ranks
def test_a_handler_that_never_returns_is_cut_at_the_bound_with_a_warning(monkeypatch):
    monkeypatch.setenv("NBDDP_EXIT_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.warns(nbddp.NbddpWarning) as caught:
        assert nbddp.notebook_launch(hang_at_exit, args=(True,), **TWO_CPU) == 0
    assert time.monotonic() - start < 25  # the 1 s bound (not 30 s), the watchdog, the launch
    messages = [str(w.message) for w in caught]
    for rank in range(2):
        mine = [m for m in messages if m.startswith(f"rank {rank}'s exit: ")]
        assert mine == [
            f"rank {rank}'s exit: the exit handler {HANDLER}.fails raised ValueError: disk full.",
            f"rank {rank}'s exit: the exit handler {HANDLER}.never_returns did not return within "
            "1 s (NBDDP_EXIT_TIMEOUT): it was cut short, and the handlers after it did not run.",
            mine[2],
        ]
        assert mine[2].startswith(f"rank {rank}'s exit: process sleep (pid ")
        assert mine[2].endswith("still ran at the bound: killed.")


@pytest.mark.ranks
def test_the_launch_timeout_does_not_cut_exit_work_the_ranks_bound_themselves(tmp_path):
    """``timeout`` is fn's; a rank that returned within it finishes its exit handlers."""
    path = str(tmp_path / "slow")
    start = time.time()
    nbddp.notebook_launch(slow_handler, args=(path, start + 3.5), timeout=3.0, **TWO_CPU)
    assert time.time() - start > 3.5
    assert sorted(os.listdir(tmp_path)) == ["slow.0", "slow.1"]


def slow_handler(path: str, until: float) -> None:
    import atexit
    import time

    import nbddp

    def slow() -> None:  # still running when the launch's timeout has passed
        time.sleep(max(0.0, until - time.time()))
        open(f"{path}.{nbddp.rank()}", "w").close()

    atexit.register(slow)


def fail_on_rank_1(path: str) -> None:
    import torch.distributed as dist

    register_writer(path)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    dist.barrier()  # rank 0 loses its peer here


@pytest.mark.ranks
def test_after_a_failure_no_exit_handler_runs_and_the_run_ends_at_once(tmp_path):
    path = str(tmp_path / "handler")
    with pytest.raises(ValueError, match="rank 1 fails"):
        nbddp.notebook_launch(fail_on_rank_1, args=(path,), **TWO_CPU)
    assert glob.glob(f"{path}.*") == []


def wait_at_exit(go: str) -> None:
    import atexit
    import os
    import time

    def wait_for_go() -> None:
        while not os.path.exists(go):
            time.sleep(0.01)

    atexit.register(wait_for_go)


@pytest.mark.ranks
def test_the_panel_shows_the_ranks_finishing_their_exit_handlers(tmp_path):
    go = tmp_path / "go"
    run = nbddp.notebook_launch(wait_at_exit, args=(str(go),), block=False, **TWO_CPU)
    try:
        deadline = time.monotonic() + 60
        while run._state.snapshot().finishing != (0, 1):
            assert time.monotonic() < deadline, "the ranks never showed as finishing"
            time.sleep(0.02)
        snapshot = run._state.snapshot()
        assert run.status == "running"
        assert "finishing exit handlers (ranks 0, 1)" in header_html(snapshot)
    finally:
        go.touch()
    assert run.result() is None
    assert run._state.snapshot().finishing_line == ""


# -- W&B and MLflow, as a script that never calls finish() / end_run() --------------------------


def log_to_wandb(directory: str, steps: int) -> None:
    import nbddp

    if nbddp.rank() == 0:
        import wandb

        wandb.init(project="nbddp-test", dir=directory)
        for step in range(steps):
            wandb.log({"loss": 1.0 / (step + 1)})


def wandb_steps(directory: str) -> list[int]:
    """The steps of the history records in an offline run's ``.wandb`` file (W&B's log format:
    32 KiB blocks of records, each chunk with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(directory, "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    records, pending, pos = [], b"", 7  # after the file's header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first / middle, last
        if kind in (1, 4):
            records.append(pending)
    steps = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            steps.append(record.history.step.num)
    return steps


@pytest.mark.ranks
@pytest.mark.slow
def test_wandb_offline_without_finish_keeps_every_logged_step(tmp_path):
    pytest.importorskip("wandb")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
    }
    nbddp.notebook_launch(log_to_wandb, args=(str(tmp_path), 50), env=env, **TWO_CPU)
    assert wandb_steps(str(tmp_path)) == list(range(50))


def log_to_mlflow(uri: str, steps: int) -> None:
    import nbddp

    if nbddp.rank() == 0:
        import mlflow

        mlflow.set_tracking_uri(uri)
        mlflow.start_run()
        for step in range(steps):
            mlflow.log_metric("loss", 1.0 / (step + 1), step=step)


@pytest.mark.ranks
@pytest.mark.slow
def test_mlflow_run_without_end_run_is_finished_with_every_step(tmp_path):
    pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    env = {"MLFLOW_ALLOW_FILE_STORE": "true"}  # a local file store, as the docs' quickstart
    nbddp.notebook_launch(log_to_mlflow, args=(store.as_uri(), 30), env=env, **TWO_CPU)
    (meta,) = glob.glob(str(store / "0" / "*" / "meta.yaml"))
    with open(meta) as f:
        fields = dict(line.rstrip("\n").split(": ", 1) for line in f if ": " in line)
    assert fields["status"] == "3"  # FINISHED, by mlflow's own exit handler (RUNNING is 1)
    assert fields["end_time"] != "null"
    with open(os.path.join(os.path.dirname(meta), "metrics", "loss")) as f:
        assert [int(line.split()[2]) for line in f] == list(range(30))


# -- a session's close() --------------------------------------------------------------------------


@pytest.mark.ranks
def test_session_close_runs_every_ranks_exit_handlers(tmp_path):
    path = str(tmp_path / "handler")
    with nbddp.Session(num_workers=2, device="cpu") as session:
        session.run(register_writer, args=(path,), display="none")
        session.run(register_writer, args=(path + "-second",), display="none")
        assert glob.glob(f"{path}*") == []  # the ranks are still up
    for rank in range(2):
        with open(f"{path}.{rank}") as f:
            assert f.read() == f"rank {rank} of 2"
        assert os.path.exists(f"{path}-second.{rank}")


@pytest.mark.ranks
def test_session_close_cuts_a_stuck_handler_at_the_bound_with_a_warning(monkeypatch):
    monkeypatch.setenv("NBDDP_EXIT_TIMEOUT", "1")
    session = nbddp.Session(num_workers=2, device="cpu")
    session.run(hang_at_exit, args=(False,), display="none")
    start = time.monotonic()
    with pytest.warns(nbddp.NbddpWarning) as caught:
        session.close()
    assert time.monotonic() - start < 25  # the 1 s bound, not the default 30 s
    messages = sorted(str(w.message) for w in caught if "did not return" in str(w.message))
    assert messages == [
        f"rank {rank}'s exit: the exit handler {HANDLER}.never_returns did not return within "
        "1 s (NBDDP_EXIT_TIMEOUT): it was cut short, and the handlers after it did not run."
        for rank in range(2)
    ]


# -- the kernel's side, without processes -----------------------------------------------------


@pytest.mark.unit
def test_a_bad_exit_timeout_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("NBDDP_EXIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="NBDDP_EXIT_TIMEOUT='soon' in the environment"):
        make_plan(num_workers=2, device="cpu")
    monkeypatch.setenv("NBDDP_EXIT_TIMEOUT", "2.5")
    assert make_plan(num_workers=2, device="cpu").exit_timeout == 2.5


@pytest.mark.unit
def test_the_kernel_gives_up_on_a_rank_whose_own_bound_could_not_act(monkeypatch):
    """A handler that holds the GIL in native code stops the rank's watchdog too: past the
    bound and EXIT_GRACE, the run succeeds with a warning (the teardown kills the rank)."""
    monkeypatch.setattr(referee_module, "EXIT_GRACE", 0.05)
    state = RunState(2, "cpu", "gloo", "cpu")
    judge = Referee(2, False, 0.01, state, broadcast=lambda m: None, exit_timeout=0.0)
    for rank in range(2):
        judge.event(Received(rank, Result(rank, None), []))
    judge.event(Ended(1, 0, ""))
    assert state.snapshot().finishing == (0,)
    time.sleep(0.02)
    assert judge.verdict() is None  # the launch timeout (0.01 s) is fn's, now over
    deadline = judge.deadline()
    assert deadline is not None and deadline > time.monotonic()  # no busy loop meanwhile
    time.sleep(max(0.0, deadline - time.monotonic()))
    outcome = judge.verdict()
    assert outcome is not None and outcome.status == "succeeded"
    assert outcome.exit_warnings == (
        "rank 0 was still running its exit work 0.05 s after its result "
        "(NBDDP_EXIT_TIMEOUT=0 s, plus 0.05): killed. An exit handler may hold the GIL in "
        "native code.",
    )
