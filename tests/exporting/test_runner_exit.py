"""An exported script's end waits for gloo's worker threads to fall asleep
(``NbddpScript._let_gloo_settle`` in ``runner.py``): one still freeing a work as the interpreter
finalizes aborts the rank after its value was saved. The race itself shows about once in a hundred
loaded runs, so these tests check the wait on stand-in threads named as gloo names its
workers: one that runs holds the end back, one that sleeps does not."""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from nbddp.exporting.runner import NbddpScript

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        not os.path.isdir("/proc/self/task"), reason="the wait reads /proc (Linux only)"
    ),
]


def _as_gloo_worker(body: Callable[[], object], named: threading.Event) -> Callable[[], None]:
    def run() -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write("pt_gloo_runloop")
        named.set()
        body()

    return run


Start = Callable[[Callable[[], object]], None]
_done = threading.Event()  # set when a test ends: its stand-in workers return


@pytest.fixture
def started() -> Iterator[Start]:
    threads: list[threading.Thread] = []
    _done.clear()

    def start(body: Callable[[], object]) -> None:
        named = threading.Event()
        thread = threading.Thread(target=_as_gloo_worker(body, named), daemon=True)
        thread.start()
        assert named.wait(30)  # named before the wait looks
        threads.append(thread)

    yield start
    _done.set()
    for thread in threads:
        thread.join(timeout=30)


@functools.cache
def _block() -> bytes:
    return b"x" * (1 << 28)  # 256 MiB: hashing it holds no GIL for a good fraction of a second


def _busy(seconds: float) -> Callable[[], None]:
    """Hash without the GIL (what a worker inside a collective's C++ looks like) for about
    ``seconds``, taking the GIL only between blocks, far apart."""
    start = time.monotonic()
    hashlib.sha256(_block()).digest()
    rounds = max(1, round(seconds / (time.monotonic() - start)))

    def body() -> None:
        digest = hashlib.sha256()
        for _ in range(rounds):
            if _done.is_set():
                return
            digest.update(_block())

    return body


def test_a_running_worker_holds_the_end_back_until_it_sleeps(started: Start) -> None:
    ended = threading.Event()
    busy = _busy(0.5)

    def body() -> None:
        busy()
        ended.set()
        _done.wait(30)  # then waits, as a worker waits for the next work

    started(body)
    NbddpScript._let_gloo_settle(limit=20)
    assert ended.is_set()


def test_sleeping_workers_let_the_script_end_at_once(started: Start) -> None:
    started(lambda: _done.wait(30))
    started(lambda: _done.wait(30))
    began = time.monotonic()
    NbddpScript._let_gloo_settle(limit=20)
    assert time.monotonic() - began < 10  # at once: far from the limit, on any machine


def test_a_worker_that_never_sleeps_holds_the_end_back_no_longer_than_the_limit(
    started: Start,
) -> None:
    started(_busy(60.0))  # busy for far longer than the limit (it ends with the test)
    began = time.monotonic()
    NbddpScript._let_gloo_settle(limit=0.5)
    assert 0.5 <= time.monotonic() - began < 20
