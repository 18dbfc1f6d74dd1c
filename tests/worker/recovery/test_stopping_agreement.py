"""The graceful stop's agreement on the rank side (``worker/recovery/stopping.py``), with threads as
ranks: a barrier per step stands for the step's collective, and a "kernel" thread asks each rank's
listener at random moments. Every rank must stop at the same check, and none may hang."""

from __future__ import annotations

import random
import threading
import time

import pytest

from nbddp.worker.recovery import stopping
from nbddp.worker.recovery.stopping import Agreement

pytestmark = pytest.mark.unit


def _world(seed: int, world_size: int, jitter: float) -> tuple[list[int | None], int | None]:
    """One run: ranks step in lockstep until they stop; the kernel asks mid-run. Returns the
    check each rank stopped at and the agreed one."""
    rng = random.Random(seed)
    ranks = [Agreement() for _ in range(world_size)]
    collective = threading.Barrier(world_size, timeout=10)
    stopped: list[int | None] = [None] * world_size
    agreed: list[int] = []

    def train(rank: int) -> None:
        own = random.Random(seed * 100 + rank)
        agreement = ranks[rank]
        for step in range(10_000):
            if agreement.check(step, "test"):
                stopped[rank] = agreement.checks
                return
            if own.random() < jitter:
                time.sleep(own.random() * 0.002)
            collective.wait()  # the step's all-reduce: no rank gets a step ahead of it
        raise AssertionError("never stopped")

    def kernel() -> None:
        time.sleep(rng.random() * 0.01)
        order = list(range(world_size))
        rng.shuffle(order)
        counts = []
        for rank in order:  # each listener hears at its own moment
            counts.append(ranks[rank].asked())
            time.sleep(rng.random() * 0.001)
        agreed.append(max(counts) + 1)
        rng.shuffle(order)
        for rank in order:
            time.sleep(rng.random() * 0.001)
            ranks[rank].agree(agreed[0])

    threads = [threading.Thread(target=train, args=(r,), daemon=True) for r in range(world_size)]
    threads.append(threading.Thread(target=kernel, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
        assert not t.is_alive(), f"a rank hung (seed {seed}): stopped at {stopped}"
    return stopped, agreed[0] if agreed else None


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_every_rank_stops_at_the_same_check_whatever_the_timing(world_size):
    for seed in range(60):
        stopped, agreed = _world(seed, world_size, jitter=0.3)
        assert stopped == [agreed] * world_size, f"seed {seed}: {stopped} vs agreed {agreed}"


def test_a_rank_that_never_checked_says_so():
    agreement = Agreement()
    assert agreement.asked() == 0
    agreement = Agreement()
    agreement.check(0, "test")
    assert agreement.asked() == 1


def test_stopping_stays_true_after_the_agreed_check_and_is_announced_once():
    heard = []
    agreement = Agreement(lambda step, where: heard.append((step, where)))
    previous = stopping.install(agreement)
    try:
        assert not stopping.stopping()
        assert not stopping.stopping()
        assert agreement.ask_here()  # asked at count 2: the next check stops
        assert [stopping.stopping() for _ in range(3)] == [True, True, True]
        assert heard == [(3, "nbddp.stopping()")]
    finally:
        stopping.install(previous)


def test_outside_a_launch_nothing_stops_and_progress_is_the_iterable():
    import nbddp

    assert stopping.current() is None
    assert nbddp.stopping() is False
    items = [1, 2, 3]
    assert nbddp.progress(items) is items


def test_progress_ends_its_loop_at_the_agreed_step_before_fetching_the_next_item():
    import nbddp

    fetched = []

    def source():
        for i in range(100):
            fetched.append(i)
            yield i

    agreement = Agreement()
    previous = stopping.install(agreement)
    try:
        seen = []
        for item in nbddp.progress(source()):
            seen.append(item)
            if item == 4:
                agreement.ask_here()
        assert seen == [0, 1, 2, 3, 4] and fetched == [0, 1, 2, 3, 4]
        assert nbddp.stopping()  # stays True after the loop: where fn saves
    finally:
        stopping.install(previous)


class _HeardRightAfterTheFlagRead(Agreement):
    """An agreement whose listener runs exactly after one read of the flag by the training
    thread: the narrowest interleaving, which the random runs above rarely hit."""

    __slots__ = ("_at", "_flag")

    def __init__(self, at: int) -> None:
        self._flag = False
        self._at = at  # the read after which the stop is asked (and agreed at once)
        super().__init__()

    @property  # type: ignore[override]
    def pending(self) -> bool:
        seen = self._flag
        self._at -= 1
        if self._at == 0:
            self.agree(self.asked() + 1)  # the listener, then the kernel's answer
        return seen

    @pending.setter
    def pending(self, value: bool) -> None:
        self._flag = value


@pytest.mark.parametrize("at", [1, 2, 5])
def test_a_stop_heard_between_the_flag_read_and_the_count_still_lands_on_the_agreed_check(at):
    agreement = _HeardRightAfterTheFlagRead(at)
    first_true = next(n for n in range(1, 50) if agreement.check(n, "test"))
    assert first_true == agreement.agreed


def test_an_exported_runs_stop_watch_ends_with_the_function(monkeypatch):
    """Under torchrun the watch polls the store from a thread of its own; the runner closes it
    before the interpreter ends (a daemon thread unwound inside a store call aborts the
    process), and a closed watch asks for nothing."""
    import torch.distributed as dist

    import nbddp.worker.recovery.standalone as standalone
    from nbddp.worker.recovery.standalone import Watcher

    class Looked:
        """The store, noting each look the watch takes."""

        def __init__(self) -> None:
            self.store, self.looked = dist.HashStore(), threading.Event()

        def check(self, keys: list[str]) -> bool:
            self.looked.set()
            return self.store.check(keys)

        def __getattr__(self, name: str) -> object:
            return getattr(self.store, name)

    store = Looked()
    monkeypatch.setattr(standalone, "POLL", 60.0)  # a wait between looks that close cuts short
    watcher = Watcher(store, 0, 1, "nbddp/stop/0")
    watcher.start()
    assert store.looked.wait(30)  # it polls: it has looked and waits for the next look
    started = time.monotonic()
    watcher.close()
    # at once: not after the wait for the next look (60 s), on any machine
    assert not watcher._thread.is_alive() and time.monotonic() - started < 20
    assert not watcher.agreement.pending and not store.check(["nbddp/stop/0/asked"])
