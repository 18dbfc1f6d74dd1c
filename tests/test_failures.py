"""Every way a run can end badly: the right error, raised fast, and nothing left running
(the autouse ``no_leftovers`` fixture checks processes and private directories)."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

import nbddp
from nbddp import LaunchTimeout, RunStopped, SerializationError, WorkerError

TWO_CPU = {"num_workers": 2, "device": "cpu"}


@pytest.fixture(autouse=True, params=["warm", "cold"])
def starter(request, monkeypatch):
    """Every failure mode, with workers forked by the warm helper and started cold."""
    if request.param == "cold":
        monkeypatch.setenv("NBDDP_PREWARM", "0")
    else:
        from nbddp import forkserver

        forkserver.prestart()
        assert forkserver.wait_until_ready(60)
    return request.param


def fails_on_rank_one() -> None:
    nbddp.barrier()
    if nbddp.rank() == 1:
        raise ValueError("bad batch on rank 1")
    nbddp.barrier()  # rank 0 waits here for a peer that is gone


def test_exception_on_one_rank_is_raised_with_its_traceback_and_cause():
    with pytest.raises(WorkerError) as info:
        nbddp.notebook_launch(fails_on_rank_one, **TWO_CPU)
    error = info.value
    assert (error.rank, error.exc_type, error.exitcode) == (1, "ValueError", None)
    assert isinstance(error.__cause__, ValueError)
    assert str(error.__cause__) == "bad batch on rank 1"
    assert "fails_on_rank_one" in error.remote_traceback
    assert 'raise ValueError("bad batch on rank 1")' in error.remote_traceback
    assert "nbddp/worker" not in error.remote_traceback  # our frames are trimmed
    assert str(error).startswith("rank 1 raised ValueError: bad batch on rank 1")
    assert nbddp.last_run().status == "failed"


def dies_while_peer_waits(how: str) -> None:
    nbddp.barrier()
    if nbddp.rank() == 1:
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            import ctypes

            ctypes.string_at(0)
    nbddp.barrier()  # would wait for a collective timeout (30 min) without supervision
    time.sleep(600)


@pytest.mark.parametrize(
    ("how", "exitcode", "text"),
    [
        ("exit", 3, "exited with code 3"),
        ("sigkill", -9, "signal 9 (SIGKILL)"),
        ("segfault", -11, "signal 11 (SIGSEGV)"),
    ],
)
def test_a_rank_dying_without_traceback_is_reported_within_seconds(how, exitcode, text):
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        nbddp.notebook_launch(dies_while_peer_waits, (how,), **TWO_CPU)
    assert time.monotonic() - started < 20  # process start (~4 s) + detection, not a timeout
    assert (info.value.rank, info.value.exitcode, info.value.exc_type) == (1, exitcode, None)
    assert text in str(info.value)


def peer_error_reaches_the_kernel_before_the_death(real_error_first: bool) -> None:
    """The race a real crash makes: the dying rank's sockets close before it can be seen to
    exit, so its peer's "connection closed" report may arrive first."""
    nbddp.barrier()
    if nbddp.rank() == 1:
        time.sleep(0.05)
        os._exit(3)
    if real_error_first:
        raise ValueError("a real bug on rank 0")
    raise RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]")


def test_a_silent_death_is_the_root_cause_of_its_peers_connection_errors():
    with pytest.raises(WorkerError) as info:
        nbddp.notebook_launch(peer_error_reaches_the_kernel_before_the_death, (False,), **TWO_CPU)
    assert (info.value.rank, info.value.exitcode) == (1, 3)


def test_a_real_error_before_a_silent_death_stays_the_root_cause():
    with pytest.raises(WorkerError) as info:
        nbddp.notebook_launch(peer_error_reaches_the_kernel_before_the_death, (True,), **TWO_CPU)
    assert (info.value.rank, info.value.exc_type) == (0, "ValueError")


def both_fail_rank_one_first() -> None:
    if nbddp.rank() == 1:
        raise KeyError("root cause")
    time.sleep(1.0)
    raise RuntimeError("consequence")


def test_several_failures_raise_the_first_one():
    with pytest.raises(WorkerError) as info:
        nbddp.notebook_launch(both_fail_rank_one_first, **TWO_CPU)
    assert (info.value.rank, info.value.exc_type) == (1, "KeyError")


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def test_timeout_terminates_the_workers():
    started = time.monotonic()
    with pytest.raises(LaunchTimeout, match="timeout=6 s") as info:
        nbddp.notebook_launch(sleeps, (300,), **TWO_CPU, timeout=6)
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - started < 6 + 5


def returns_a_lock() -> object:
    return {"stats": [1, 2], "lock": threading.Lock()}


def test_a_return_value_that_cannot_travel_back_is_named():
    with pytest.raises(
        SerializationError,
        match=r"rank 0's return value.*result -> \['lock'\] "
        r"-> _thread.lock",
    ):
        nbddp.notebook_launch(returns_a_lock, **TWO_CPU)


def test_an_argument_that_cannot_travel_fails_before_any_process():
    children_before = psutil.Process().children(recursive=True)
    started = time.monotonic()
    with pytest.raises(SerializationError, match=r"args\[0\] -> _thread.lock"):
        nbddp.notebook_launch(sleeps, (threading.Lock(),), **TWO_CPU)
    assert time.monotonic() - started < 1
    assert psutil.Process().children(recursive=True) == children_before


def test_stop_ends_a_background_run():
    run = nbddp.notebook_launch(sleeps, (300,), **TWO_CPU, block=False)
    assert run.status == "running" and not run.wait(timeout=0.5)
    started = time.monotonic()
    run.stop()
    assert time.monotonic() - started < 5
    assert run.status == "stopped" and run.wait(0)
    with pytest.raises(RunStopped, match="stopped"):
        run.result()
    with pytest.raises(TimeoutError):
        nbddp.notebook_launch(sleeps, (300,), **TWO_CPU, block=False).result(timeout=0.1)
    nbddp.last_run().stop()


def _resources() -> tuple[int, int, int]:
    me = psutil.Process()
    return me.num_fds(), threading.active_count(), len(me.children(recursive=True))


@pytest.mark.slow
def test_twenty_launches_do_not_leak_fds_threads_or_processes():
    nbddp.notebook_launch(int, **TWO_CPU)
    time.sleep(0.2)
    baseline = _resources()
    for _ in range(20):
        assert nbddp.notebook_launch(abs, (-3,), **TWO_CPU) == 3
    time.sleep(0.2)
    assert _resources() == baseline
