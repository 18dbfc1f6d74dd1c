"""Did DDP happen? A multi-rank run whose ranks trained apart says so (an NbddpWarning, the
panel, run.warning); one DDP job says nothing. Real ranks, real gloo; the verdict's rules as a
table."""

from __future__ import annotations

import contextlib
import io

import pytest
from conftest import TWO_CPU_QUIET

import nbddp
from nbddp.display.html import summary_html
from nbddp.display.text import summary_text
from nbddp.rules.sync import judge
from nbddp.wire.messages import ModelPrint, SyncCheck

A = ModelPrint("Linear", 2, 1.5, 2.5, 3.25)
B = ModelPrint("Linear", 2, 1.25, 2.5, 3.0)


def check(
    *models: ModelPrint, collectives: int = 5, stepped: bool = True, alone: str = ""
) -> SyncCheck:
    return SyncCheck(tuple(models), collectives, stepped, alone)


@pytest.mark.unit
@pytest.mark.parametrize(
    "checks",
    [
        {0: check(collectives=0, alone="accelerate"), 1: check(collectives=0, alone="accelerate")},
        {0: check(A, alone="accelerate"), 1: check(B)},
    ],
)
def test_a_library_that_ran_each_rank_alone_is_named_instead_of_prepare_model(checks):
    verdict = judge(2, checks)
    assert verdict is not None and verdict.startswith("ranks trained independently")
    assert "Accelerate ran each rank as a process of its own" in verdict
    assert "ACCELERATE_USE_CPU=true" in verdict and "Accelerator(cpu=True)" in verdict
    assert "prepare_model" not in verdict


@pytest.mark.unit
@pytest.mark.parametrize(
    ("checks", "says"),
    [
        ({0: check(A), 1: check(A)}, None),  # one DDP job
        ({0: check(A), 1: check(B)}, "the parameters of the DDP model (Linear) differ"),
        ({0: check(A, A), 1: check(A, B)}, "the DDP model #2 (Linear)"),
        ({0: check(collectives=0), 1: check(collectives=0)}, "never communicated"),
        ({0: check(collectives=0, stepped=False), 1: check(collectives=0)}, "never communicated"),
        ({0: check(collectives=3), 1: check(collectives=3)}, None),  # averaged by hand
        ({0: check(collectives=0, stepped=False), 1: check(collectives=0, stepped=False)}, None),
        ({0: check(A)}, None),  # a rank that could not report: nothing to compare
        ({0: check(A), 1: check(ModelPrint("Linear", 2, 1.5 * (1 + 1e-7), 2.5, 3.25))}, None),
        ({0: check(A), 1: check(ModelPrint("Linear", 2, 1.5, 2.5 * (1 + 1e-3), 3.25))}, "differ"),
        ({0: check(A), 1: check(ModelPrint("Linear", 3, 1.5, 2.5, 3.25))}, "differ"),
        (  # a sum that cancels to ~0: compared against the magnitude, not itself
            {
                0: check(ModelPrint("L", 2, 1e-9, 2.0, 1.0)),
                1: check(ModelPrint("L", 2, -1e-9, 2.0, 1.0)),
            },
            None,
        ),
        (
            {
                0: check(ModelPrint("L", 1, float("nan"), float("nan"), 1.0)),
                1: check(ModelPrint("L", 1, float("nan"), float("nan"), 1.0)),
            },
            None,
        ),  # a run that diverged to NaN did so together
    ],
)
def test_the_verdict_rules(checks, says):
    verdict = judge(2, checks)
    if says is None:
        assert verdict is None
    else:
        assert verdict is not None and says in verdict
        assert verdict.startswith("ranks trained independently")


def run_quietly(fn, *args, **options):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        value = nbddp.notebook_launch(fn, args, **{**TWO_CPU_QUIET, **options})
    return value, nbddp.last_run()


def fully_shard():
    """FSDP2's ``fully_shard``: public from torch 2.6, under ``_composable`` in 2.4 and 2.5."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def train(how: str) -> float:
    """A few steps of a small model on rank-dependent data, wrapped (or not) as ``how`` says."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    if how == "ddp":
        model = nbddp.prepare_model(net)
    elif how == "compiled":
        model = torch.compile(nbddp.prepare_model(net), backend="eager")
    elif how == "fsdp2":  # sharded: not fingerprinted, its collectives are counted
        model = fully_shard()(net)
    elif how == "module":  # the classic: wrapped, but the unwrapped module is trained
        nbddp.prepare_model(net)
        model = net
    else:  # "alone": no DDP at all
        model = net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.full((8, 4), float(nbddp.rank() + 1))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if how == "ddp":
        dist.destroy_process_group()  # the check does not need the group at the end
    return float(loss.detach())


@pytest.mark.ranks
@pytest.mark.smoke
@pytest.mark.parametrize("how", ["ddp", "compiled", "fsdp2"])
def test_one_ddp_job_gets_no_warning(how):
    if how == "fsdp2":
        try:
            fully_shard()
        except ImportError:
            pytest.skip("FSDP2 (fully_shard) needs torch >= 2.4")
    _, run = run_quietly(train, how)  # -W error: a warning here would fail the test
    assert run.warning is None
    assert "ranks trained" not in summary_html(run._state.snapshot())


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("how", "says"),
    [("alone", "never communicated"), ("module", "the parameters of the DDP model (Linear)")],
)
@pytest.mark.smoke
def test_ranks_that_trained_independently_get_the_warning(how, says):
    with pytest.warns(nbddp.NbddpWarning, match="ranks trained independently") as caught:
        run_quietly(train, how)
    assert says in str(caught[0].message)
    run = nbddp.last_run()
    assert run.status == "succeeded" and run.warning is not None and says in run.warning
    snapshot = run._state.snapshot()
    assert "ranks trained independently" in summary_html(snapshot)  # the saved summary
    assert "warning: ranks trained independently" in summary_text(snapshot)


def no_training() -> int:
    return nbddp.rank()


@pytest.mark.ranks
def test_a_run_that_trains_nothing_is_not_judged():
    value, run = run_quietly(no_training)
    assert value == 0 and run.warning is None
