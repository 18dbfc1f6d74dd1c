"""A run's roll-calls start and end with it: the stall watch and the timeout's roll-call are
started by the cell's thread while the run's end may cancel them from another, so a start that
comes after the cancel must start nothing (a watch started then ran for the kernel's life: two
of them were left after ``tests/sessions/test_session.py``'s fast tasks)."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_until

from nbddp.diagnosis.answers import Answers
from nbddp.diagnosis.rollcalls import RollCalls

pytestmark = pytest.mark.unit


def roll_calls() -> RollCalls:
    return RollCalls(2, Answers(2), lambda ask: None, lambda text, since: None, lambda: False)


def watches() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "nbddp-stall"}


def test_a_start_after_the_run_ended_starts_nothing():
    before = watches()
    calls = roll_calls()
    calls.cancel()  # the run ended first
    calls.start(1.0, 10.0, lambda: 0.0)
    assert calls.watch is None and watches() == before


def test_the_runs_end_ends_what_its_start_started():
    before = watches()
    calls = roll_calls()
    calls.start(1.0, 10.0, lambda: 0.0)
    started = watches() - before
    assert len(started) == 1
    calls.cancel()
    assert wait_until(lambda: not watches() & started, 5)
