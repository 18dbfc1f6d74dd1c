"""A rank's GPU paths with a fake ``torch.cuda`` (``worker/rank/job.py``, ``world.py``,
``report.py``): the group bound to the rank's GPU, the device's work done before the result,
a post-mortem failure stamped when it was raised."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from nbddp.wire.messages import Result
from nbddp.worker.debugging import asking
from nbddp.worker.debugging.rank_pdb import RankPdb
from nbddp.worker.diagnosis import collective_watch
from nbddp.worker.rank import job, report, world

pytestmark = pytest.mark.unit


class Conn:
    def __init__(self, log: list) -> None:
        self.log = log

    def send(self, message, buffers=None) -> None:
        self.log.append(type(message).__name__)


def test_f8_a_ranks_gpu_work_completes_before_its_result_leaves(monkeypatch):
    """F8: a rank that returned right after ``dist.all_reduce`` (NCCL: queued, not done) and
    then exited killed its half of the collective: the peer hung until NCCL's watchdog."""
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("synchronize"))
    assert job.send_result(Conn(log), 0, 7, False, True)
    assert log == ["synchronize", Result.__name__]


def test_a_cpu_rank_sends_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synced"))
    assert job.send_result(Conn([]), 0, 7, False, True)


@pytest.mark.parametrize(("backend", "bound"), [("nccl", True), ("gloo", False)])
def test_f16_an_nccl_group_is_bound_to_the_ranks_gpu_and_built_with_the_native_timeout(
    monkeypatch, backend, bound
):
    """F16: without ``device_id`` every ``dist.barrier()`` warned on rank 0 and NCCL's
    communicator was made at the first collective, inside the first step. The asked timeout
    is the watch's; torch's own must never fire first (F3)."""
    made: list[dict] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    built = world.World(0, 1, backend, dist.HashStore(), lambda **kw: made.append(kw))
    try:
        built.build(timeout=collective_watch.timedelta(seconds=3))
    finally:
        collective_watch.stop()
    assert made[0]["timeout"] == collective_watch.NATIVE
    assert made[0].get("device_id") == (torch.device("cuda", 1) if bound else None)


def test_f3_a_post_mortem_failure_is_stamped_when_it_was_raised(monkeypatch):
    """F3: the report was stamped after pdb was left, so after minutes in post-mortem a
    peer's later death looked first and became the run's root cause."""
    monkeypatch.setattr(RankPdb, "interaction", lambda self, frame, tb: time.sleep(0.3))
    monkeypatch.setattr(RankPdb, "leave", lambda self: None)
    asking.configure(asking.Link(lambda message: None, 1, 2, "rank0", debug=True))

    def fn():
        raise ValueError("bad batch")

    try:
        try:
            fn()
        except ValueError as exc:
            raised = time.time()
            from nbddp.worker.debugging import debugger

            debugger.post_mortem(exc)
            failure = report.error_report(exc)
    finally:
        asking.configure(None)
    assert failure.time - raised < 0.2 < time.time() - raised
