"""The rank runtime (``worker/rank/runtime.py``): the per-call services are entered in one order
and undone in reverse, each putting back what it replaced, and a call's failure is described
before post-mortem pdb holds the rank. No process: the services are module state, checked
directly."""

from __future__ import annotations

import time
from typing import Any

import pytest

from nbddp.worker import context, live
from nbddp.worker.debugging import asking, debugger
from nbddp.worker.libraries import integrations
from nbddp.worker.output import rich
from nbddp.worker.rank import runtime
from nbddp.worker.rank.runtime import Call, Checkpoints, RankRuntime
from nbddp.worker.recovery import checkpoints, stopping

pytestmark = pytest.mark.unit


class Sink:
    def __init__(self) -> None:
        self.received: list[Any] = []

    def rows(self, first: int, blocks: list[Any]) -> None:
        self.received.append((first, blocks))

    def main_rows(self, rows: list[Any]) -> None:
        pass

    def bars(self, bars: list[Any]) -> None:
        pass


def _services() -> tuple[Any, ...]:
    return (
        stopping.current(),
        checkpoints.configure(*checkpoints.configure(None)),  # read, and put back
        live.current(),
        rich._publisher,
        asking.current(),
        integrations._output,
        context._installed,
    )


def test_a_calls_services_are_installed_inside_and_what_they_replaced_is_back_after():
    sent: list[Any] = []
    before = _services()
    agreement = stopping.Agreement(lambda step, where: None)
    ctx = context.Context(rank=1, local_rank=1, world_size=2, device=None)  # type: ignore[arg-type]
    host = RankRuntime(1, Sink(), sent.append)
    with host.call(
        agreement, Checkpoints("/tmp/ckpt", 3), output="all", world_size=2, task=7, context=ctx
    ) as call:
        assert stopping.current() is agreement is call.agreement
        assert checkpoints.directory() == "/tmp/ckpt" and checkpoints.keep() == 3
        assert live.current() is call.buffer
        assert rich._publisher is not None
        link = asking.current()
        assert link is not None and (link.rank, link.world_size, link.task) == (1, 2, 7)
        assert integrations._output == "all"
        assert context.current() is ctx
    assert _services() == before


def test_a_nested_call_gives_the_outer_ones_services_back():
    """The kernel's one rank may run a launch of its own: the outer run's services return."""
    outer_agreement = stopping.Agreement(lambda step, where: None)
    kernel = RankRuntime(0, Sink())
    with kernel.call(outer_agreement, Checkpoints("/outer", 2)) as outer:
        inner_agreement = stopping.Agreement(lambda step, where: None)
        with kernel.call(inner_agreement, Checkpoints("/inner", 1)) as inner:
            assert live.current() is inner.buffer and stopping.current() is inner_agreement
        assert live.current() is outer.buffer and stopping.current() is outer_agreement
        assert checkpoints.directory() == "/outer"


def test_the_services_are_undone_in_reverse_figures_before_the_last_rows(
    monkeypatch: pytest.MonkeyPatch,
):
    """Figures left open go to the cell, then the live buffer closes (every row before the
    outcome), then the agreement goes: the order the module's docstring gives."""
    undone: list[str] = []
    monkeypatch.setattr(rich, "finish", lambda: undone.append("rich.finish"))
    close = live.LiveBuffer.close
    monkeypatch.setattr(
        live.LiveBuffer, "close", lambda self: (undone.append("buffer.close"), close(self))[1]
    )
    install = stopping.install

    def recording_install(agreement: Any) -> Any:
        if agreement is None:
            undone.append("stopping removed")
        return install(agreement)

    monkeypatch.setattr(stopping, "install", recording_install)
    with RankRuntime(0, Sink(), lambda message: None).call(
        stopping.Agreement(lambda step, where: None), Checkpoints(None, 2)
    ):
        pass
    assert undone == ["rich.finish", "buffer.close", "stopping removed"]


def test_every_logged_row_reaches_the_sink_when_the_call_ends():
    sink = Sink()
    with RankRuntime(0, sink).call(stopping.Agreement(lambda s, w: None), Checkpoints(None, 2)):
        for step in range(5):
            live.log(loss=float(step))
    assert sum(len(block[2][0]) for _, blocks in sink.received for block in blocks) == 5


def test_a_failure_is_described_before_post_mortem_holds_the_rank(
    monkeypatch: pytest.MonkeyPatch,
):
    """The report's time is the failure's, not the end of a long pdb session: the kernel's
    root cause must stay this rank's error, not a peer's later timeout."""
    held: list[float] = []

    def post_mortem(exc: BaseException) -> None:
        held.append(time.time())
        time.sleep(0.05)  # a person at pdb: the report must not wait for them

    monkeypatch.setattr(debugger, "post_mortem", post_mortem)

    def fails() -> None:
        raise ValueError("boom")

    ended = Call.run(fails)
    assert ended.failure is not None and ended.failure.exc_type == "ValueError"
    assert held and ended.failure.time <= held[0]


@pytest.mark.parametrize(
    ("code", "early", "failed"), [(None, True, False), (0, True, False), (3, False, True)]
)
def test_sys_exit_zero_is_a_success_and_any_other_code_a_failure(code, early, failed):
    def leaves() -> None:
        raise SystemExit(code)

    ended = Call.run(leaves)
    assert (ended.early, ended.failure is not None) == (early, failed)


def test_the_module_names_the_order_it_installs():
    """The docstring is the contract of the order: it lists the nine services."""
    doc = runtime.__doc__ or ""
    steps = [line for line in doc.splitlines() if line[:2] in {f"{i}." for i in range(1, 10)}]
    assert len(steps) == 9
