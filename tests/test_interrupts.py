"""The stop button pressed during a launch: the launch ends, nothing is left, and the next launch
works. The interrupt is sent at each phase of a launch in turn (``nbddp.interrupts.PHASES``:
planning, pickling, the helper, the ranks' start, the supervisor, the job handed out, the
process group, fn, the result, the exit work, the teardown, the finish), on both starters and
in the kernel's own one-rank run: a launch names each phase it enters, and the test's observer
sends the SIGINT there and records which phase the launch was in when the KeyboardInterrupt
was raised. A phase entered on the supervisor's thread holds that thread until the interrupt
is delivered, so every phase is hit however loaded the machine. Two instants are also reached
on purpose by the ranks' own doing: just after the ranks started, and while a large result
arrives."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import psutil
import pytest
import torch.distributed as dist
from conftest import TWO_CPU_QUIET, is_warm_helper, running, wait_until
from sharing import within

import nbddp
from nbddp import interrupts
from nbddp.interrupts import PHASES, Phase
from nbddp.run import Run
from nbddp.worker import live

# how soon after the interrupt the launch must have ended (fn would run on for 30-60 s)
PROMPT = 10.0

# the phases of a launch in the kernel itself, in order (the rest are a launch of processes')
IN_KERNEL: tuple[Phase, ...] = (
    "planning",
    "joining the process group",
    "running fn",
    "tearing down",
    "finishing",
    "watching",
)


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def returns_a_big_tensor(mib: int, marker: str):
    import torch

    if nbddp.rank() != 0:
        return None
    value = torch.empty(mib * 2**18)
    open(marker, "w").close()  # it is being sent from now on
    return value


class InterruptAt:
    """Sends the kernel's interrupt (SIGINT to the main thread, where Jupyter's lands) as a
    launch enters ``target``, and records where it landed: the phase that the thread which
    entered ``target`` was in when the KeyboardInterrupt was raised. On the supervisor's thread
    the observer holds the launch at ``target`` until then. ``seen``: every phase entered, with
    the thread that entered it."""

    def __init__(self, target: Phase | None) -> None:
        self.target = target
        self.seen: list[tuple[int, Phase]] = []
        self.landed_in: Phase | None = None
        self.sent_at = float("inf")  # when the interrupt was sent
        self._latest: dict[int, Phase] = {}
        self._sender: int | None = None
        self._landed = threading.Event()

    def __call__(self, phase: Phase) -> None:
        me = threading.get_ident()
        self.seen.append((me, phase))
        self._latest[me] = phase
        if phase != self.target or self._sender is not None:
            return
        self._sender = me
        self.sent_at = time.monotonic()
        main = threading.main_thread().ident
        assert main is not None
        signal.pthread_kill(main, signal.SIGINT)
        if me != main:  # the launch waits here until the main thread took the interrupt
            self._landed.wait(60)

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self._sender is not None and self.landed_in is None:
            self.landed_in = self._latest[self._sender]
        self._landed.set()
        raise KeyboardInterrupt

    def first_seen(self, thread: int | None = None, other_than: int | None = None) -> list[Phase]:
        """The phases in the order they were first entered (by ``thread``, by any thread but
        ``other_than``)."""
        return list(dict.fromkeys(self._entered(thread, other_than)))

    def last_seen(self, thread: int | None = None, other_than: int | None = None) -> list[Phase]:
        """The phases in the order they were last entered."""
        return list(reversed(dict.fromkeys(reversed(self._entered(thread, other_than)))))

    def _entered(self, thread: int | None, other_than: int | None) -> list[Phase]:
        return [
            phase
            for entered_by, phase in self.seen
            if thread in (None, entered_by) and entered_by != other_than
        ]


@contextmanager
def interrupting_at(target: Phase | None) -> Iterator[InterruptAt]:
    at = InterruptAt(target)
    previous = signal.signal(signal.SIGINT, at.handler)
    try:
        with interrupts.observed(at):
            yield at
    finally:
        signal.signal(signal.SIGINT, previous)


def our_processes() -> set[int]:
    """This test's live descendants, but the warm helper (and what it forked ahead)."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        if running(proc.pid) and not is_warm_helper(proc):
            found.add(proc.pid)
    return found


def run_directories() -> set[str]:
    import glob
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"nbddp-{os.getpid()}-*")))


def interrupted(delay: float, launch, after: Path, sent: list) -> bool:
    """Run ``launch`` with a SIGINT ``delay`` seconds after the file ``after`` appears; True if
    it raised KeyboardInterrupt. ``sent`` gets the signal's time."""

    def fire() -> None:
        assert wait_until(after.exists, 120)
        time.sleep(delay)  # how far into the transfer: a spread, not a synchronisation
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=fire, daemon=True)
    timer.start()
    try:
        try:
            launch()
        except KeyboardInterrupt:
            return True
        timer.join()  # an interrupt that comes after the launch returned lands here
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


@pytest.mark.ranks
def test_a_launch_names_its_phases_in_order(starter):
    """The caller's thread enters the first six, the supervisor's the rest, each in order.
    The supervisor's phases overlap across ranks (rank 0's result may be read before rank 1's
    word that it joined), so there the order is that of each phase's last entry: a rank's own
    messages come in order, and the last rank to join sends its result after that."""
    with interrupting_at(None) as at:
        assert nbddp.notebook_launch(abs, (-3,), **TWO_CPU_QUIET) == 3
    caller = threading.get_ident()
    assert at.first_seen(caller) == list(PHASES[:6]), at.seen
    assert at.last_seen(other_than=caller) == list(PHASES[6:]), at.seen
    with interrupting_at(None) as at:
        assert nbddp.notebook_launch(abs, (-3,), num_workers=1, display="none") == 3
    assert at.first_seen() == list(IN_KERNEL), at.seen


# Cold starts take another path only where ranks are started, run and ended: an interrupt in
# the other phases meets the same code (the kernel's alone, or the supervisor's once every
# rank runs), which the warm cases cover.
COLD_PHASES: tuple[Phase, ...] = ("starting the ranks", "supervising", "running fn", "tearing down")


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("starter", "phase"),
    [("warm", phase) for phase in PHASES] + [("cold", phase) for phase in COLD_PHASES],
    indirect=["starter"],
)
def test_an_interrupt_in_each_phase_of_a_launch_ends_it_there_and_leaves_nothing(starter, phase):
    """Up to fn, fn would sleep a minute; from its result on, it returns at once."""
    seconds = 60 if PHASES.index(phase) <= PHASES.index("running fn") else 0
    before, dirs = our_processes(), run_directories()
    with interrupting_at(phase) as at, pytest.raises(KeyboardInterrupt):
        nbddp.notebook_launch(sleeps, (seconds,), **TWO_CPU_QUIET)
    took = time.monotonic() - at.sent_at
    assert phase in at.first_seen(), f"the launch never entered {phase!r}: {at.seen}"
    assert at.landed_in == phase, f"sent in {phase!r}, landed in {at.landed_in!r}: {at.seen}"
    assert took < within(PROMPT), f"the launch ended {took:.1f} s after the interrupt"
    assert our_processes() - before == set(), "a process of the launch outlived the interrupt"
    assert run_directories() <= dirs, "the launch's run directory outlived the interrupt"
    assert_next_launch_works()


def writes_its_pid_and_sleeps(directory: str) -> None:
    with open(os.path.join(directory, str(nbddp.rank())), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


@pytest.mark.ranks
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


@pytest.mark.ranks
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


@pytest.mark.ranks
@pytest.mark.parametrize("phase", IN_KERNEL)
def test_an_interrupt_in_each_phase_of_the_kernels_own_run_restores_the_kernel(phase):
    """Up to fn, fn would spin half a minute; after it, it has returned at once."""
    seconds = 30 if IN_KERNEL.index(phase) <= IN_KERNEL.index("running fn") else 0
    with interrupting_at(phase) as at, pytest.raises(KeyboardInterrupt):
        nbddp.notebook_launch(spins_with_progress, (seconds,), num_workers=1)
    took = time.monotonic() - at.sent_at
    assert at.landed_in == phase, f"sent in {phase!r}, landed in {at.landed_in!r}: {at.seen}"
    assert took < within(PROMPT), f"the launch ended {took:.1f} s after the interrupt"
    assert not dist.is_initialized()
    assert "RANK" not in os.environ and "NBDDP_RUN_ID" not in os.environ
    assert live._buffer is None
    assert nbddp.notebook_launch(abs, (-2,), num_workers=1, display="none") == 2


def interrupts_itself_at_step_3() -> int:
    for step in nbddp.progress(range(10_000)):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the kernel's own run: this is its main thread
    return step


@pytest.mark.ranks
def test_an_interrupt_once_the_kernels_own_run_checks_stops_it_gracefully_and_restores_it():
    """The first interrupt of a run that checks (nbddp.progress) is a graceful stop at its next
    check: fn's value, a warning, and the kernel as it was."""
    with pytest.warns(nbddp.NbddpWarning, match="stopped gracefully at step"):
        step = nbddp.notebook_launch(interrupts_itself_at_step_3, num_workers=1, display="none")
    assert step == 3
    assert not dist.is_initialized()
    assert "RANK" not in os.environ and "NBDDP_RUN_ID" not in os.environ
    assert live._buffer is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert nbddp.notebook_launch(abs, (-2,), num_workers=1, display="none") == 2
