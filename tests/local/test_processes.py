"""Rank processes without torch: exit codes, signals, and a teardown that leaves nothing,
not even processes that left the rank's session."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil
import pytest
from sharing import within

from nbddp.environment import RUN_ID_VARIABLE
from nbddp.local.processes import ColdStarter, WorkerProcess, terminate
from nbddp.worker.reaping import exit_status

# Run ids as unique as nbddp's own: the teardown ends every process of a run id machine-wide,
# so a fixed one would end another test process's ranks (another xdist worker's).
RUN = f"test-run-{os.getpid()}"


def start(code: str, run_id: str = RUN) -> tuple[WorkerProcess, int]:
    """A tiny rank: ``python -c code``; returns it and the read end of its stdout."""
    out_r, out_w = os.pipe()
    env = {**os.environ, RUN_ID_VARIABLE: run_id}
    try:
        process = ColdStarter().start(["-c", code], env, out_w, out_w)
    finally:
        os.close(out_w)
    return process, out_r


def read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        assert chunk, "the process ended before printing its line"
        data += chunk
    return data.decode().strip()


def wait_ended(process: WorkerProcess, timeout: float = 10) -> int | None:
    deadline = time.monotonic() + timeout
    while process.exitcode() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode()


def gone(pid: int, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import os; os._exit(3)", 3),
        ("import ctypes; ctypes.string_at(0)", -signal.SIGSEGV),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
        ("pass", 0),
    ],
)
def test_exit_status_is_read_without_reaping(code, expected):
    process, out = start(code)
    try:
        assert wait_ended(process) == expected
        assert exit_status(process.pid) == expected  # still unreaped: asking again works
        assert psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        terminate([process], RUN, time.time())
        os.close(out)
    assert not psutil.pid_exists(process.pid)


@pytest.mark.ranks
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace():
    process, out = start(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\ntime.sleep(60)"
    )
    try:
        assert read_line(out) == "ready"
        started = time.monotonic()
        terminate([process], RUN, time.time(), grace=0.5)
        assert 0.4 < time.monotonic() - started < within(3)  # the grace, not its sleep (60 s)
    finally:
        os.close(out)
    assert not psutil.pid_exists(process.pid)


class ReportedLate:
    """A rank whose end is known only through a report that comes a moment after it was
    killed (a warm rank: its helper reaps it, then tells the kernel); it ignores SIGTERM."""

    def __init__(self) -> None:
        self.pid = 2**22 + 7  # no such process: signals to its group go nowhere
        self.sentinel, self._reported = os.pipe()
        self.code: int | None = None
        self.known_at_release: bool | None = None

    def exitcode(self) -> int | None:
        return self.code

    def signal_group(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            threading.Timer(0.3, self._reaped).start()

    def _reaped(self) -> None:
        self.code = -signal.SIGKILL
        os.write(self._reported, b"x")

    def release(self) -> None:
        self.known_at_release = self.code is not None
        os.close(self.sentinel)
        os.close(self._reported)


@pytest.mark.unit
def test_the_teardown_returns_once_a_killed_ranks_end_is_seen():
    """Returning at SIGKILL left a warm rank still exiting when an interrupt was raised
    (test_interrupts' 'a process of the launch outlived the interrupt', now and then)."""
    process = ReportedLate()
    terminate([process], "reported-late", time.time(), grace=0.1)  # type: ignore[list-item]
    assert process.known_at_release


ESCAPES = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.ranks
def test_a_process_that_left_the_session_is_ended_with_the_run():
    since = time.time()
    process, out = start(ESCAPES, run_id=f"escapes-1-{os.getpid()}")
    try:
        escaped = int(read_line(out))
        assert os.getpgid(escaped) != process.pid  # not in the rank's group: killpg misses it
        terminate([process], f"escapes-1-{os.getpid()}", since, grace=0.5)
        assert gone(escaped)
    finally:
        os.close(out)


@pytest.mark.ranks
def test_an_orphan_of_a_killed_rank_is_found_by_the_run_id():
    since = time.time()
    process, out = start(ESCAPES, run_id=f"escapes-2-{os.getpid()}")
    try:
        escaped = int(read_line(out))
        os.kill(process.pid, signal.SIGKILL)  # its child is re-parented away from the tree
        assert wait_ended(process) == -signal.SIGKILL
        assert psutil.Process(escaped).ppid() != process.pid
        terminate([process], f"escapes-2-{os.getpid()}", since, grace=0.5)
        assert gone(escaped)
    finally:
        os.close(out)


DOUBLE_FORK = """\
import os, subprocess, sys
from nbddp.worker.reaping import become_subreaper, end_descendants
become_subreaper()
if os.fork() == 0:  # an intermediate that starts a daemon in a new session, then exits
    os.setsid()
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(daemon.pid, flush=True)
    os._exit(0)
os.wait()  # the intermediate is gone: the daemon is this subreaper's child from its exit on
end_descendants()
print("ended", flush=True)
"""


@pytest.mark.ranks
def test_a_rank_ends_its_descendants_even_after_they_double_forked():
    process, out = start(DOUBLE_FORK)
    try:
        daemon = int(read_line(out))
        assert read_line(out) == "ended"
        assert gone(daemon)
        assert wait_ended(process) == 0
    finally:
        terminate([process], RUN, time.time())
        os.close(out)


@pytest.mark.ranks
def test_the_cold_starter_gives_each_rank_its_own_session():
    process, out = start("import os; print(os.getsid(0), os.getpgrp(), flush=True)")
    try:
        sid, group = map(int, read_line(out).split())
        assert sid == group == process.pid
    finally:
        terminate([process], RUN, time.time())
        os.close(out)


@pytest.mark.ranks
def test_python_is_the_interpreter_of_cold_ranks():
    process, out = start("import sys; print(sys.executable, flush=True)")
    try:
        assert read_line(out) == sys.executable
    finally:
        terminate([process], RUN, time.time())
        os.close(out)
