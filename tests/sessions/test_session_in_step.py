"""A session never keeps a process group whose collectives are out of step (issue #27).

An interrupt (a peer's failure, Stop, a timeout, the kernel's) that lands after torch issued a
collective and before it waited for it leaves that rank idle with a collective its peers never
matched: kept, the next collective would hang or pair with the stale one. Real rank processes,
2 CPU ranks. The window is microseconds wide in torch's ``all_reduce`` (between
``group.allreduce`` and ``work.wait()``); most tests widen it on rank 0, in the rank, by
sleeping right after the issue, so that every repetition lands in it. The kernel's own
interrupt is in ``test_session_kernel.py``, Ray in ``test_ray.py``.
"""

from __future__ import annotations

import textwrap
import time
import uuid

import pytest
import torch
import torch.distributed as dist
from conftest import running
from sharing import within

import nbddp
import nbddp.rules.task_referee as task_referee
from nbddp.rules.in_step import out_of_step
from nbddp.wire.messages import GroupCount

OPTIONS = {"display": "none"}


def notebook(source: str) -> dict:
    """Run ``source`` as a notebook cell does: what it defines lives in ``__main__``."""
    namespace = {"__name__": "__main__", "nbddp": nbddp, "torch": torch, "dist": dist}
    namespace["time"] = time
    exec(textwrap.dedent(source), namespace)
    return namespace


NB = notebook(
    """
    def count():
        global counter
        try:
            counter += 1
        except NameError:
            counter = 1
        return counter

    def total(group=None):
        t = torch.ones(1) * (nbddp.rank() + 1)
        dist.all_reduce(t, group=group)
        return t.item()

    def all_reduce_cut_short(token, rank_1_raises=True, group=None, marker=None):
        '''The issue's task: rank 1 raises while rank 0 is in dist.all_reduce(torch.ones(1)),
        with the window between torch's issue and its wait widened: the interrupt lands
        there. Rank 1 goes on once rank 0 issued (however late each got the task).'''
        store = dist.distributed_c10d._get_default_store()
        if nbddp.rank() == 1:
            store.wait([token])  # rank 0 issued its all_reduce
            if rank_1_raises:
                raise ValueError("rank 1 fails")
            time.sleep(60)  # a stop or a timeout interrupts it
        bound = dist.ProcessGroup.__dict__["allreduce"]  # the method, as pybind11 binds it
        issue = dist.ProcessGroup.allreduce

        def issue_then_linger(self, *args, **kwargs):
            work = issue(self, *args, **kwargs)
            store.set(token, "issued")
            if marker:
                open(marker, "w").close()
            time.sleep(60)  # between the issue and work.wait(): the interrupt lands here
            return work

        dist.ProcessGroup.allreduce = issue_then_linger
        try:
            dist.all_reduce(torch.ones(1), group=group)
        finally:
            dist.ProcessGroup.allreduce = bound

    def race(offset):
        '''The issue's task as it is, unwidened.'''
        if nbddp.rank() == 1:
            time.sleep(0.1)
            raise ValueError("rank 1 fails")
        time.sleep(0.1 + offset)  # about when the interrupt reaches rank 0
        dist.all_reduce(torch.ones(1))

    def in_step_then_rank_1_raises():
        dist.all_reduce(torch.ones(1))  # matched on both ranks
        if nbddp.rank() == 1:
            raise ValueError("rank 1 fails")
        time.sleep(60)  # interrupted before its next collective
        dist.all_reduce(torch.ones(1))

    def make_pair_group():
        global pair
        pair = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1), group=pair)

    def total_on_pair():
        global pair
        try:
            pair  # the ranks' own group
        except NameError:  # fresh ranks: make it again
            pair = dist.new_group([0, 1])
        return total(pair)

    def cut_short_on_pair(token):
        all_reduce_cut_short(token, group=pair)
    """
)
count, total = NB["count"], NB["total"]


def pids(session: nbddp.Session) -> set[int]:
    return {row["pid"] for row in session.status()}


def assert_right_and_prompt(session: nbddp.Session, fn: str = "total") -> None:
    """The next collective gives every rank the sum, at once (not the stale one's value,
    not a hang)."""
    started = time.monotonic()
    values = session.run(NB[fn], return_all=True, timeout=15, **OPTIONS)
    assert values == [3.0, 3.0]
    assert time.monotonic() - started < within(5)


@pytest.fixture
def session():
    with nbddp.Session(num_workers=2, device="cpu") as s:
        yield s


@pytest.mark.ranks
def test_a_collective_cut_short_by_a_peers_failure_restarts_the_ranks(session, monkeypatch):
    monkeypatch.setattr(task_referee, "GRACE", 60.0)  # a stuck rank would take a minute
    for _ in range(3):
        session.run(count, **OPTIONS)
        old = pids(session)
        started = time.monotonic()
        with pytest.raises(nbddp.WorkerError, match="rank 1 fails") as raised:
            session.run(NB["all_reduce_cut_short"], (uuid.uuid4().hex,), **OPTIONS)
        assert time.monotonic() - started < within(5)  # not stuck: every rank came back
        assert_right_and_prompt(session)
        message = str(raised.value)
        assert "The session was restarted: after the failure, the ranks' collectives " in message
        assert "different numbers of collectives on the default process group: " in message
        assert "rank 0 1, rank 1 0" in message or "rank 0 2, rank 1 1" in message
        assert "State on the ranks is lost" in message
        assert not old & pids(session) and not any(running(p) for p in old)
        status = session.status()[0]["restarted"]
        assert "out of step" in status and "at " in status
        assert session.run(count, **OPTIONS) == 1  # fresh ranks, a fresh namespace


@pytest.mark.ranks
def test_a_stop_or_a_timeout_that_cuts_a_collective_short_restarts_the_ranks(session, tmp_path):
    with (
        pytest.warns(nbddp.NbddpWarning, match="restarted: after the timeout, the ranks' coll"),
        pytest.raises(nbddp.LaunchTimeout, match="collectives were left out of step"),
    ):
        session.run(NB["all_reduce_cut_short"], (uuid.uuid4().hex, False), timeout=3, **OPTIONS)
    assert "after the timeout" in session.status()[0]["restarted"]
    assert_right_and_prompt(session)

    marker = tmp_path / "issued"
    cut_short = NB["all_reduce_cut_short"]
    args = (uuid.uuid4().hex, False, None, str(marker))
    run = session.run(cut_short, args, block=False, **OPTIONS)
    while not marker.exists():  # rank 0 issued its all_reduce
        time.sleep(0.01)
    run.stop()
    assert run.status == "stopped"
    with pytest.warns(nbddp.NbddpWarning, match="had ended"):  # replaced before the next task
        assert_right_and_prompt(session)


@pytest.mark.ranks
def test_a_group_made_with_new_group_counts_too(session):
    session.run(NB["make_pair_group"], **OPTIONS)
    with pytest.raises(nbddp.WorkerError) as raised:
        session.run(NB["cut_short_on_pair"], (uuid.uuid4().hex,), **OPTIONS)
    assert_right_and_prompt(session, "total_on_pair")
    assert "collectives on process group '1': rank 0 2, rank 1 1" in str(raised.value)


@pytest.mark.ranks
def test_the_issues_sequence_unwidened_every_next_collective_is_right_and_prompt(
    session, monkeypatch
):
    """The interrupt lands before rank 0's collective (kept), inside its wait (stuck:
    restarted), or, rarely, between its issue and its wait (out of step: restarted)."""
    monkeypatch.setattr(task_referee, "GRACE", 1.0)  # a stuck rank 0 costs 1 s, not 5
    outcomes = []
    for attempt in range(10):
        try:
            session.run(NB["race"], (attempt % 5 * 0.0008,), **OPTIONS)
        except nbddp.WorkerError as exc:
            assert "rank 1 fails" in str(exc), exc
            outcomes.append("restarted" if "restarted" in str(exc) else "kept")
        assert_right_and_prompt(session)
    assert len(outcomes) == 10  # every attempt failed on rank 1


@pytest.mark.ranks
def test_a_task_interrupted_before_any_collective_keeps_the_state(session):
    session.run(count, **OPTIONS)
    session.run(NB["make_pair_group"], **OPTIONS)
    old = pids(session)
    with pytest.raises(nbddp.WorkerError, match="rank 1 fails") as raised:
        session.run(NB["in_step_then_rank_1_raises"], **OPTIONS)
    assert "restarted" not in str(raised.value)
    with pytest.raises(nbddp.LaunchTimeout, match="interrupted and kept their state"):
        session.run(time.sleep, (30,), timeout=0.5, **OPTIONS)
    assert pids(session) == old and session.status()[0]["restarted"] is None
    assert session.run(count, return_all=True, **OPTIONS) == [2, 2]
    assert_right_and_prompt(session)
    assert_right_and_prompt(session, "total_on_pair")


def counts(*groups: tuple[str, tuple[int, ...], int]) -> tuple[GroupCount, ...]:
    return tuple(GroupCount(*g) for g in groups)


@pytest.mark.unit
def test_the_rule_compares_every_group_of_every_member():
    default = ("0", (0, 1, 2), 7)
    pair = ("1", (0, 1), 3)
    assert out_of_step({r: counts(default) for r in range(3)}, 3) is None
    both = counts(default, pair)
    assert out_of_step({0: both, 1: both, 2: counts(default)}, 3) is None  # 2 not in pair
    behind = counts(("0", (0, 1, 2), 6))
    assert out_of_step({0: both, 1: both, 2: behind}, 3) == (
        "the ranks issued different numbers of collectives on the default process group: "
        "rank 0 7, rank 1 7, rank 2 6"
    )
    assert out_of_step({0: both, 1: counts(default), 2: counts(default)}, 3) == (
        "rank 1 does not have process group '1' (ranks 0, 1) that its peers made"
    )
    assert out_of_step({0: both, 1: None, 2: counts(default)}, 3) == (
        "rank 1 could not count its collectives"
    )
    assert out_of_step({0: both, 1: both}, 3) == "rank 2 could not count its collectives"
