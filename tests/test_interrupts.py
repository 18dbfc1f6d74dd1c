"""The stop button pressed during a launch: the launch ends, nothing is left, and the next launch
works. A fuzz over a spread of delays (on both starters and in the kernel's own one-rank run)
covers a quiet machine's warm launch from its call to its end (~40 ms: planning, pickling, the
run directory, the helper request, the fork, the handshake, the rendezvous); which phase each
interrupt lands in is not checked, and on a loaded machine the later delays land in training.
The instants that matter most are reached on purpose instead: just after the ranks started,
and while a large result arrives."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import TWO_CPU_QUIET, running, wait_until

import nbddp
from nbddp.run import Run
from nbddp.worker import live


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def returns_a_big_tensor(mib: int, marker: str):
    import torch

    if nbddp.rank() != 0:
        return None
    value = torch.empty(mib * 2**18)
    open(marker, "w").close()  # it is being sent from now on
    return value


def interrupted(delay: float, launch, after: Path | None = None, sent: list | None = None) -> bool:
    """Run ``launch`` with a SIGINT ``delay`` seconds in; True if it raised KeyboardInterrupt.
    An interrupt that lands after the launch returned is swallowed here, as a user's next
    cell would be interrupted instead. The delay counts from just before the launch is
    called (or from when the file ``after`` appears): a timer started earlier could fire
    inside ``Thread.start()`` on a loaded machine, where a KeyboardInterrupt breaks
    threading's own lock, and the test would test nothing. ``sent`` gets the signal's time."""
    go = threading.Event()

    def fire() -> None:
        go.wait()
        if after is not None:  # the delay counts from when ``after`` appears instead
            assert wait_until(after.exists, 120)
        time.sleep(delay)
        if sent is not None:
            sent.append(time.monotonic())
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


def test_interrupts_over_a_spread_of_delays_leave_the_next_launch_working(starter):
    # warm: a launch is ~40 ms from call to result; cold: ~1.5 s of importing torch first
    delays = [0.002 + i * 0.004 for i in range(16)] if starter == "warm" else [0.002, 0.3, 0.8, 1.5]
    delays += [0.08, 0.15, 0.3] if starter == "warm" else [3.0]  # training
    for delay in delays:
        assert interrupted(delay, lambda: nbddp.notebook_launch(sleeps, (60,), **TWO_CPU_QUIET)), (
            delay
        )
        assert_next_launch_works()
    # launches that end by themselves: interrupted or not (an interrupt after the end is
    # swallowed), the next one works
    for delay in [i * 0.006 for i in range(12)] if starter == "warm" else [1.2, 1.8]:
        interrupted(delay, lambda: nbddp.notebook_launch(abs, (-3,), **TWO_CPU_QUIET))
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


def test_an_interrupt_while_a_large_result_arrives_is_honoured_at_once(tmp_path):
    """The signal comes 0-0.2 s after rank 0 began sending 2 GiB (over a second here)."""
    for delay in (0.0, 0.1, 0.2):
        marker, finished, sent = tmp_path / f"sending-{delay}", [], []

        def launch(marker: Path = marker, finished: list = finished) -> None:
            try:
                nbddp.notebook_launch(returns_a_big_tensor, (2048, str(marker)), **TWO_CPU_QUIET)
            finally:
                finished.append(time.monotonic())

        assert interrupted(delay, launch, after=marker, sent=sent), delay
        assert finished[0] - sent[0] < 1.0, finished[0] - sent[0]
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
