"""Where detached runs are kept: owner-only directories, ids, who may see them, when a run
counts as supervised, and the retention limits (age and size) that remove finished runs."""

from __future__ import annotations

import os
import stat
import time

import pytest
from detached.support import runs_dir

import nbddp
from nbddp.detached import info, retention, store

pytestmark = pytest.mark.unit

__all__ = ["runs_dir"]  # an autouse fixture (support.py)


def finished(
    run: store.StoredRun, status: str = "succeeded", ended_ago: float = 0.0, size: int = 0
) -> None:
    store.write_json(
        run.join(store.STATUS),
        {"status": status, "ended": True, "updated": time.time() - ended_ago},
    )
    with open(run.join("result.pkl"), "wb") as f:
        f.write(b"x" * size)


def test_a_run_directory_is_its_owners_alone(runs_dir):
    run, lock = store.create({"name": "train", "started": time.time()})
    os.close(lock)
    assert len(run.id) == 8 and int(run.id, 16) >= 0
    assert stat.S_IMODE(os.stat(runs_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(run.path).st_mode) == 0o700
    for name in (store.INFO, store.KEY, store.LOCK):
        assert stat.S_IMODE(os.stat(run.join(name)).st_mode) == 0o600
    assert len(run.key()) == 32
    assert store.find(run.id).info["name"] == "train"


def test_unknown_ids_and_other_users_runs_are_refused(runs_dir):
    with pytest.raises(ValueError, match="no detached run 0123abcd of yours"):
        store.find("0123abcd")
    with pytest.raises(ValueError, match="not a detached run's id"):
        store.find("../../etc")
    run, lock = store.create({"name": "theirs", "started": time.time()})
    os.close(lock)
    os.chown(run.join(store.INFO), 4242, 4242)
    with pytest.raises(ValueError, match="belongs to another user"):
        store.find(run.id)
    with pytest.raises(ValueError, match="belongs to another user"):
        nbddp.attach(run.id)


def test_a_runs_directory_of_someone_else_is_refused(runs_dir):
    runs_dir.mkdir(mode=0o700)
    os.chown(runs_dir, 4242, 4242)
    try:
        with pytest.raises(ValueError, match=r"belongs to another user.*NBDDP_RUNS_DIR"):
            nbddp.runs()
    finally:
        os.chown(runs_dir, os.getuid(), os.getgid())


def test_a_run_is_supervised_while_its_lock_is_held(runs_dir):
    run, lock = store.create({"name": "train", "started": time.time()})
    assert run.supervised()
    assert run.state() == ("starting", None)
    with pytest.raises(ValueError, match="still running"):
        info.forget(run.id)
    os.close(lock)  # its owner died without recording an end
    assert not run.supervised()
    status, ended = run.state()
    assert status == "failed" and ended is not None
    assert [r.status for r in nbddp.runs()] == ["failed"]
    info.forget(run.id)
    assert nbddp.runs() == [] and not os.path.exists(run.path)


def test_finished_runs_older_than_the_limit_go(runs_dir, monkeypatch):
    monkeypatch.setenv(retention.KEEP_DAYS_VARIABLE, "2")
    old, fresh, running = (store.create({"name": n, "started": time.time()}) for n in "abc")
    finished(old[0], ended_ago=3 * 86400)
    finished(fresh[0], ended_ago=1 * 86400)
    os.close(old[1])
    os.close(fresh[1])
    store.write_json(running[0].join(store.STATUS), {"status": "running", "updated": 0.0})
    removed = retention.sweep()
    assert removed == [old[0].id]
    assert {r.name for r in nbddp.runs()} == {"b", "c"}  # a running run stays, however old
    os.close(running[1])


def test_finished_runs_beyond_the_size_limit_go_oldest_first(runs_dir, monkeypatch):
    monkeypatch.setenv(retention.KEEP_GB_VARIABLE, str(1.5e-6))  # 1500 bytes: one run
    made = []
    for age in (30, 20, 10):
        run, lock = store.create({"name": f"ended {age} s ago", "started": time.time()})
        os.close(lock)
        finished(run, ended_ago=age, size=1000)
        made.append(run)
    retention.sweep()
    assert [r.id for r in nbddp.runs()] == [made[2].id]  # the two oldest went


def test_a_bad_limit_says_how_to_fix_it(monkeypatch):
    monkeypatch.setenv(retention.KEEP_DAYS_VARIABLE, "soon")
    with pytest.raises(ValueError, match="NBDDP_RUNS_KEEP_DAYS='soon' must be a number >= 0"):
        nbddp.runs()


def test_a_half_made_directory_of_a_killed_kernel_goes(runs_dir, monkeypatch):
    runs_dir.mkdir(mode=0o700)
    left = runs_dir / ".new-0123abcd-xyz"
    left.mkdir()
    (left / store.LOCK).write_bytes(b"")
    retention.sweep()
    assert left.exists()  # young: perhaps still being made
    monkeypatch.setattr(retention, "ABANDONED", 0.0)
    retention.sweep()
    assert not left.exists()


def test_runs_are_listed_newest_first_with_what_they_are(runs_dir):
    _first, lock1 = store.create(
        {"name": "first", "started": time.time() - 10, "world_size": 2, "device": "cpu"}
    )
    second, lock2 = store.create(
        {"name": "second", "started": time.time(), "world_size": 4, "device": "cuda"}
    )
    store.write_json(second.join(store.STATUS), {"status": "running", "progress": "step 3: a=1"})
    listed = nbddp.runs()
    assert [r.name for r in listed] == ["second", "first"]
    top = listed[0]
    assert isinstance(top, nbddp.RunInfo)
    assert (top.status, top.world_size, top.device, top.progress, top.cluster, top.path) == (
        "running",
        4,
        "cuda",
        "step 3: a=1",
        None,
        second.path,
    )
    assert "second" in str(listed) and "<table>" in listed._repr_html_()
    os.close(lock1)
    os.close(lock2)


def test_attaching_to_a_run_whose_supervisor_is_starting_waits_for_it(runs_dir):
    """The launching kernel holds the run's lock until its supervisor takes it over: a kernel
    that attaches then waits, and finds the run lost if the lock is let go without one."""
    run, lock = store.create(
        {"name": "starting", "started": time.time(), "world_size": 2, "device": "cpu"}
    )
    handle = nbddp.attach(run.id, display="none")
    try:
        assert not handle.wait(0.3) and handle.status == "running"
    finally:
        os.close(lock)  # the launching kernel died before the supervisor took over
    assert handle.wait(10) and handle.status == "failed"
    with pytest.raises(nbddp.NbddpError, match="ended without recording the run's end"):
        handle.result()
