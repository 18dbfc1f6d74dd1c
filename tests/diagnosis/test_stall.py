"""F2: the stall watch's verdict on two roll-calls (``diagnosis/stall.py``), with no process:
a rank spinning in a CUDA wait for a collective that never completes is not "working"."""

from __future__ import annotations

import pytest

from nbddp.diagnosis.stacks import Stacks
from nbddp.diagnosis.stall import _working
from nbddp.wire.stacks import Collective, StackFrame, StackReport, ThreadStack

pytestmark = pytest.mark.unit


def report(cpu: float, collective: Collective | None, line: int = 20) -> StackReport:
    frames = (
        StackFrame("/x/nbddp/worker/rank/entry.py", 1, "_run", "", True),
        StackFrame("/home/u/train.py", line, "train", "loss.item()", False),
        StackFrame("/v/site-packages/torch/cuda/__init__.py", 1080, "synchronize", "", False),
    )
    collectives = (collective,) if collective is not None else ()
    return StackReport(
        "asked", (ThreadStack("MainThread", True, frames),), collectives, (), cpu, "", ()
    )


def nccl(seq: int, completed: bool | None) -> Collective:
    return Collective(seq, "all_reduce", ((1024,),), ("Float",), "default_pg", completed)


def test_f2_an_nccl_rank_spinning_in_synchronize_on_a_stuck_collective_is_stalled():
    """F2: rank 0 burns a core (the CUDA runtime spins in synchronize()) while NCCL's
    recorder says all_reduce #12 has not completed; rank 1 sleeps elsewhere. Before the fix
    the spin counted as work and the banner never showed on an NCCL hang."""
    before = Stacks(2, {0: report(100.0, nccl(12, False)), 1: report(5.0, None, line=40)})
    after = Stacks(2, {0: report(130.0, nccl(12, False)), 1: report(5.0, None, line=40)})
    assert not _working(before, after, 30.0)


def test_a_rank_whose_collectives_complete_or_move_on_is_working():
    for then, now in (
        (nccl(12, True), nccl(12, True)),  # completed: the CPU time is its own work
        (nccl(12, False), nccl(13, False)),  # a new collective since: progress
        (None, None),  # no collective known (gloo without a recorder): the CPU time says
        (nccl(12, None), nccl(12, None)),  # gloo's recorder does not say: the CPU time says
    ):
        before = Stacks(2, {0: report(100.0, then), 1: report(5.0, None)})
        after = Stacks(2, {0: report(130.0, now), 1: report(5.0, None)})
        assert _working(before, after, 30.0), (then, now)
