"""F3: the asked collective timeout, enforced by the rank's watch (``collective_watch.py``), on a
fake store and a fake clock: a peer that has not issued the collective fails the rank once the
timeout passed, a person at a prompt on any rank holds it, NCCL's incomplete collective too."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from nbddp.worker.diagnosis import collective_watch as watch

pytestmark = pytest.mark.unit


class Store:
    """The part of a c10d store the watch uses."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def add(self, key: str, step: int) -> int:
        value = int(self.data.get(key, b"0")) + step
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time_ns(self) -> int:
        return int(self.now * 1e9)


@pytest.fixture
def world(monkeypatch):
    """Rank 0 of 2 on gloo, asked for 3 s; rank 1's count is the test's to set."""
    clock, store = Clock(), Store()
    counts = {"mine": 0}
    monkeypatch.setattr(watch, "time", clock)
    monkeypatch.setattr(watch, "_own_counts", lambda: {"0": ((0, 1), counts["mine"])})
    entries: list[dict] = []
    monkeypatch.setattr(
        "nbddp.worker.diagnosis.stacks.flight_entries", lambda backend, strict=False: entries
    )
    watch.ask(timedelta(seconds=3))
    w = watch._Watch(store, 1, 0, 2, "gloo")

    def peer(count: int) -> None:
        store.set(f"{w.prefix}1", json.dumps({"0": [[0, 1], count]}))

    peer(0)
    yield w, clock, counts, peer, entries, store
    watch.stop()


def test_f3_a_peer_that_never_issued_the_collective_fails_the_rank_after_the_asked_timeout(world):
    """F3: the asked 3 s (today nbddp drops it: the group exists, torch's 30 min apply)."""
    w, clock, counts, _, entries, _ = world
    entries.append({"collective_seq_id": 1, "profiling_name": "gloo:all_reduce"})
    assert w.look() is None
    counts["mine"] = 1  # all_reduce #1 issued; rank 1 is elsewhere
    assert w.look() is None
    clock.now += 2.9
    assert w.look() is None
    clock.now += 0.2
    verdict = w.look()
    assert verdict is not None
    assert verdict.startswith(
        "collective timed out after 3 s: all_reduce #1 on the default group, waiting for rank 1"
    )


def test_a_peer_that_catches_up_is_no_timeout(world):
    w, clock, counts, peer, _, _ = world
    counts["mine"] = 5
    w.look()
    clock.now += 2
    peer(5)
    clock.now += 10
    assert w.look() is None
    counts["mine"] = 6  # the next one starts its own wait
    w.look()
    clock.now += 2
    assert w.look() is None


def test_f3_a_person_at_a_prompt_on_any_rank_holds_every_collective(world):
    """F3: pdb on rank 1 for longer than the timeout: rank 0 does not fail, and it gets a
    whole timeout again once the prompt is answered."""
    w, clock, counts, _, _, store = world
    counts["mine"] = 1
    w.look()
    watch._store = store
    with watch.held():  # rank 1 in pdb (its counts are in the same store)
        for _ in range(20):
            clock.now += 1
            assert w.look() is None
    assert w.look() is None  # the next look (a tick later) sees the prompt answered
    clock.now += 2.9
    assert w.look() is None
    clock.now += 0.2
    assert w.look() is not None


def test_f3_nccl_a_collective_every_rank_issued_that_never_completes_times_out(world):
    """F3 on NCCL: all ranks issued #4, its kernel never completed (a transport that hangs):
    the flight recorder says so, and the timeout applies."""
    w, clock, counts, peer, entries, _ = world
    w.backend = "nccl"
    counts["mine"] = 4
    peer(4)
    entries.append(
        {
            "collective_seq_id": 4,
            "profiling_name": "nccl:all_reduce",
            "state": "scheduled",
            "time_created_ns": clock.time_ns(),
        }
    )
    w.look()
    clock.now += 2
    assert w.look() is None
    clock.now += 1.5
    verdict = w.look()
    assert verdict is not None and "all_reduce #4" in verdict and "not completed" in verdict
    entries[0]["state"] = "completed"
    assert w.look() is None


def test_torchs_default_applies_when_nothing_was_asked(monkeypatch):
    watch.stop()
    assert watch.timeout_for("gloo") == 1800.0
    assert watch.timeout_for("nccl") == 600.0
    watch.ask(7)
    assert watch.timeout_for("nccl") == 7.0
    watch.stop()  # a world left: the next one asks anew
    assert watch.asked() is None


def test_a_timed_out_rank_fails_through_the_jobs_action_with_its_place_in_fn(monkeypatch):
    failures: list[BaseException] = []
    watch.configure(failures.append)
    monkeypatch.setattr(watch, "_tick", lambda limit: 0.001)
    w = watch._Watch(Store(), 1, 0, 2, "gloo")
    monkeypatch.setattr(w, "look", lambda: "collective timed out after 3 s: all_reduce #1")
    watch.arm()
    try:
        w.run()
    finally:
        watch.configure(None)
        watch.disarm()
    assert len(failures) == 1 and isinstance(failures[0], watch.CollectiveTimeout)
    assert failures[0].__traceback__ is not None  # the main thread's stack: where fn waits
