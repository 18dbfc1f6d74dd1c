"""The root cause of a failed run, chosen by a pure function: a table of cases."""

from __future__ import annotations

import pytest

from nbddp import WorkerError
from nbddp.rules.tracker import Failure, ended_early, lost_a_peer, root_cause
from nbddp.wire.messages import ErrorReport

pytestmark = pytest.mark.unit


def report(exc_type: str, message: str = "", mro: tuple[str, ...] = ()) -> ErrorReport:
    return ErrorReport(
        exc_type,
        message,
        "",
        None,
        0.0,
        mro or (f"builtins.{exc_type}", "builtins.Exception"),
        "builtins",
    )


def failure(rank: int, time: float, kind: str) -> Failure:
    return Failure(rank, time, WorkerError(rank, exc_type=kind), kind)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("failures", "early", "expected"),
    [
        # one failure: itself
        ([(1, 1.0, "raised")], [], 1),
        # the earliest of two real errors
        ([(0, 2.0, "raised"), (1, 1.0, "raised")], [], 1),
        # a silent death explains the peer's lost connection, even when it is seen later
        ([(0, 1.0, "lost_peer"), (1, 2.0, "died")], [], 1),
        # a real error beats a later silent death, and beats an earlier lost connection
        ([(0, 1.0, "raised"), (1, 2.0, "died")], [], 0),
        ([(0, 1.0, "lost_peer"), (1, 3.0, "raised")], [], 1),
        # only lost connections, and a rank that ended early: that rank
        ([(0, 2.0, "lost_peer")], [(1, 1.0)], 1),
        # a rank that ended early does not hide a real error
        ([(0, 2.0, "raised")], [(1, 1.0)], 0),
        # only lost connections and nobody left early: the earliest of them
        ([(0, 2.0, "lost_peer"), (1, 1.5, "lost_peer")], [], 1),
    ],
)
def test_root_cause(failures, early, expected):
    chosen = root_cause(
        [failure(*f) for f in failures],
        [ended_early(rank, when, "returned") for rank, when in early],
    )
    assert chosen.rank == expected


def test_an_early_end_says_what_happened_and_what_to_do():
    error = ended_early(1, 0.0, "called sys.exit(0)").error
    assert str(error).startswith("rank 1 called sys.exit(0) while the other ranks were still")
    assert "nbddp.barrier()" in str(error)


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (
            report(
                "DistBackendError",
                "anything",
                ("torch.distributed.DistBackendError", "torch.distributed.DistError"),
            ),
            True,
        ),
        (report("DistNetworkError", "", ("torch.distributed.DistNetworkError",)), True),
        (
            report("RuntimeError", "[gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
            True,
        ),
        (report("RuntimeError", "shapes do not match"), False),
        (report("ValueError", "Connection closed by peer"), False),  # text only for gloo's type
    ],
)
def test_a_lost_peer_is_told_by_its_class_first(exc, lost):
    assert lost_a_peer(exc) is lost


def test_root_cause_needs_a_failure():
    with pytest.raises(ValueError):
        root_cause([])


def interrupted(rank: int, traceback: str, message: str = "") -> Failure:
    error = WorkerError(
        rank, exc_type="KeyboardInterrupt", exc_message=message, remote_traceback=traceback
    )
    return Failure(rank, 2.0, error, "raised")


IN_TRAIN = (
    "Traceback (most recent call last):\n"
    '  File "/home/u/train.py", line 12, in train\n'
    "    loss = step(batch)\n"
    '  File "/home/u/model.py", line 30, in step\n'
    "    time.sleep(1)\n"
    "KeyboardInterrupt\n"
)
IN_A_CELL = (
    "Traceback (most recent call last):\n  Cell In[4], line 3, in <module>\n    total = 0\n"
    "KeyboardInterrupt\n"
)


def test_the_note_names_each_interrupted_rank_where_it_was_and_never_the_root_cause():
    from nbddp.rules.tracker import interrupted_note
    from nbddp.wire.messages import BEFORE_THE_TASK

    root = failure(1, 1.0, "raised")
    failures = [
        interrupted(2, IN_A_CELL),
        root,
        interrupted(0, IN_TRAIN),
        interrupted(3, "", BEFORE_THE_TASK),
    ]
    assert interrupted_note(failures, root) == (
        "The failure interrupted rank 0 at /home/u/model.py:30 in step (time.sleep(1)), "
        "rank 2 at Cell In[4]:3 in <module> (total = 0), rank 3 before it started the task: "
        "their parts of the task did not finish."
    )
    assert interrupted_note([root], root) == ""  # nobody was cut short
    lost = Failure(0, 2.0, WorkerError(0, exc_type="DistBackendError"), "lost_peer")
    assert interrupted_note([root, lost], root) == ""  # failed, not interrupted


def test_a_long_list_of_interrupted_ranks_is_counted_after_three():
    from nbddp.rules.tracker import interrupted_note

    root = failure(0, 1.0, "raised")
    failures = [root, *(interrupted(rank, "") for rank in range(1, 8))]
    assert interrupted_note(failures, root) == (
        "The failure interrupted rank 1, rank 2, rank 3 and 4 more: their parts of the task did "
        "not finish."
    )
