"""What the detached-run tests share (imported by them; a conftest here would shadow the top
one): a private runs directory, the supervisor's process
family, and waiting for it to be gone."""

from __future__ import annotations

import glob
import os
import time

import psutil
import pytest

from nbddp.detached import store


@pytest.fixture(autouse=True, scope="module")
def no_standby():
    """The supervisor standing by for this process's next detached launch ends with the
    module's tests (in a notebook it ends with the kernel)."""
    from nbddp.detached.spawn import standby

    yield
    standby.discard()


@pytest.fixture(autouse=True)
def runs_dir(tmp_path, monkeypatch):
    """A private runs directory; a run a failing test left running is stopped afterwards."""
    root = tmp_path / "runs"
    monkeypatch.setenv(store.RUNS_DIR_VARIABLE, str(root))
    yield root
    left = []
    for run in store.stored_runs():
        if run.state()[1] is not None:  # it ended: its supervisor may still be exiting
            run.wait_unsupervised(10.0)
            continue
        info = run.supervisor()
        if info is not None and run.supervised():
            process = psutil.Process(int(info["pid"]))
            left.append(family(process))
            process.terminate()  # SIGTERM: the supervisor stops its run
    for processes in left:
        wait_gone(processes)
    assert not left, "a test left a detached run running (stopped now)"


def supervisor_of(run_id: str, timeout: float = 30.0) -> psutil.Process:
    """The run's supervisor, once it listens."""
    deadline = time.monotonic() + timeout
    while True:
        info = store.find(run_id).supervisor()
        if info is not None:
            return psutil.Process(int(info["pid"]))
        assert time.monotonic() < deadline, "the supervisor never wrote supervisor.json"
        time.sleep(0.02)


def family(process: psutil.Process) -> list[psutil.Process]:
    """A supervisor and everything it started (its helper, the ranks, the helper's pool)."""
    return [process, *process.children(recursive=True)]


def wait_gone(processes: list[psutil.Process], timeout: float = 30.0) -> list[int]:
    """The pids still running after ``timeout`` seconds (none, when all went)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p.pid for p in processes if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _running(process: psutil.Process) -> bool:
    """Running, or a zombie whose other threads still run (they hold its files)."""
    try:
        if not process.is_running():
            return False
        return (
            process.status() != psutil.STATUS_ZOMBIE
            or len(os.listdir(f"/proc/{process.pid}/task")) > 1
        )
    except (psutil.NoSuchProcess, OSError):
        return False


def lock_holders(run_id: str) -> list[str]:
    """The processes that hold a run's lock file open (why it counts as supervised)."""
    lock = store.find(run_id).join(store.LOCK)
    found = []
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == lock:
                pid = int(fd.split("/")[2])
                found.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())}")
        except (OSError, psutil.Error):
            continue
    return found


def wait_for_file(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
