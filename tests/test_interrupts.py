"""The stop button pressed at any instant of a launch: the launch ends, nothing is left, and the
next launch works. A fuzz over delays, so that the interrupt lands in planning, pickling, the
run directory, the helper request, the fork, the handshake, the rendezvous, training, the
result's transfer and the teardown, on both starters and in the kernel's own one-rank run."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch.distributed as dist
from conftest import TWO_CPU_QUIET, running

import nbddp
from nbddp.run import Run
from nbddp.worker import live


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def returns_a_big_tensor(mib: int):
    import torch

    return torch.empty(mib * 2**18) if nbddp.rank() == 0 else None


def interrupted(delay: float, launch) -> bool:
    """Run ``launch`` with a SIGINT ``delay`` seconds in; True if it raised KeyboardInterrupt.
    An interrupt that lands after the launch returned is swallowed here, as a user's next
    cell would be interrupted instead. The delay counts from just before the launch is
    called: a timer started earlier could fire inside ``Thread.start()`` on a loaded machine,
    where a KeyboardInterrupt breaks threading's own lock, and the test would test nothing."""
    go = threading.Event()

    def fire() -> None:
        go.wait()
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=fire, daemon=True)
    timer.start()  # it waits for go: no signal can come during the start
    try:
        go.set()
        try:
            launch()
        except KeyboardInterrupt:
            return True
        time.sleep(delay + 0.5)  # let a late interrupt land here
        return False
    except KeyboardInterrupt:
        return False
    finally:
        timer.join()


def assert_next_launch_works() -> None:
    assert nbddp.notebook_launch(abs, (-7,), **TWO_CPU_QUIET, timeout=60) == 7


@pytest.fixture(params=["warm", "cold"])
def starter(request, monkeypatch):
    if request.param == "cold":
        monkeypatch.setenv("NBDDP_PREWARM", "0")
    else:
        from nbddp.local import forkserver

        forkserver.prestart()
        assert forkserver.wait_until_ready(60)
    return request.param


def test_an_interrupt_at_any_instant_leaves_the_next_launch_working(starter):
    # warm: a launch is ~40 ms from call to result; cold: ~1.5 s of importing torch first
    delays = [0.002 + i * 0.004 for i in range(16)] if starter == "warm" else [0.002, 0.3, 0.8, 1.5]
    delays += [0.08, 0.15, 0.3] if starter == "warm" else [3.0]  # training
    for delay in delays:
        assert interrupted(delay, lambda: nbddp.notebook_launch(sleeps, (60,), **TWO_CPU_QUIET)), (
            delay
        )
        assert_next_launch_works()
    for delay in [i * 0.006 for i in range(12)] if starter == "warm" else [1.2, 1.8]:
        interrupted(delay, lambda: nbddp.notebook_launch(abs, (-3,), **TWO_CPU_QUIET))  # to the end
        assert_next_launch_works()


def writes_its_pid_and_sleeps(directory: str) -> None:
    with open(os.path.join(directory, str(nbddp.rank())), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def test_an_interrupt_just_after_the_ranks_started_ends_them(monkeypatch, tmp_path):
    """The start returned and the ranks run fn, but the launch has not begun waiting yet
    (setting up the stall watch): the interrupt must end them, not only mark the run ended."""

    def interrupted_here(self: Run) -> None:
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(Run, "_watch_for_stalls", interrupted_here)
    with pytest.raises(KeyboardInterrupt):
        nbddp.notebook_launch(writes_its_pid_and_sleeps, (str(tmp_path),), **TWO_CPU_QUIET)
    pids = [int((tmp_path / name).read_text()) for name in os.listdir(tmp_path)]
    assert len(pids) == 2
    assert not [pid for pid in pids if running(pid)]  # gone when the interrupt is raised
    monkeypatch.undo()
    assert_next_launch_works()


def test_an_interrupt_while_a_large_result_arrives_is_honoured_at_once():
    finished: list[float] = []

    def launch() -> None:
        try:
            nbddp.notebook_launch(returns_a_big_tensor, (2048,), **TWO_CPU_QUIET)  # 2 GiB back
        finally:
            finished.append(time.monotonic())

    for delay in (0.15, 0.4, 0.8):
        finished.clear()
        started = time.monotonic()
        if interrupted(delay, launch):
            assert finished[0] - (started + delay) < 1.0
        assert_next_launch_works()


def spins_with_progress(seconds: float) -> None:
    end = time.monotonic() + seconds
    for _ in nbddp.progress(iter(int, 1)):
        if time.monotonic() > end:
            return
        nbddp.log(x=1.0)
        time.sleep(0.001)


def test_an_interrupt_of_the_kernels_own_run_restores_the_kernel():
    for delay in [i * 0.003 for i in range(12)]:
        interrupted(delay, lambda: nbddp.notebook_launch(spins_with_progress, (30,), num_workers=1))
        assert not dist.is_initialized()
        assert "RANK" not in os.environ and "NBDDP_RUN_ID" not in os.environ
        assert live._buffer is None
        assert nbddp.notebook_launch(abs, (-2,), num_workers=1, display="none") == 2
