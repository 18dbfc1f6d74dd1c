"""The run's state model without processes: rows averaged across ranks, bounded history,
progress bars as shown."""

from __future__ import annotations

import itertools

import pytest
from conftest import blocks

from nbddp.state.metrics import History, MetricsAggregator
from nbddp.state.run import RunState
from nbddp.wire.messages import BarSnapshot

pytestmark = pytest.mark.unit


def test_rows_wait_for_every_rank_and_nothing_is_lost():
    history = History()
    metrics = MetricsAggregator(2, history)
    metrics.add(1, 0, blocks((None, {"loss": 1.0}), (None, {"loss": 3.0})))  # rank 1 runs ahead
    assert len(history) == 0
    metrics.add(0, 0, blocks((0, {"loss": 0.0})))
    assert history.rows() == [{"step": 0, "epoch": 0, "loss": 0.5}]
    metrics.add(0, 1, blocks((0, {"loss": 1.0}), (1, {"loss": 5.0})))  # rank 0 now ahead
    metrics.finish()  # row 2 only rank 0 logged: averaged over those who did
    assert [r["loss"] for r in history.rows()] == [0.5, 2.0, 5.0]
    assert metrics.latest == {"loss": 5.0}


def test_ranks_logging_different_keys_follow_the_documented_rule():
    history = History()
    metrics = MetricsAggregator(2, history)
    metrics.add(0, 0, blocks((None, {"loss": 2.0, "acc": 1.0})))
    metrics.add(1, 0, blocks((None, {"loss": 4.0})))
    assert history.rows() == [{"step": 0, "loss": 3.0, "acc": 1.0}]
    assert "not every rank logged acc" in metrics.notes[0]


def test_history_memory_is_bounded_and_evenly_spread():
    history = History(max_rows=1000)
    for step in range(10_000):
        history.extend(step, None, {"loss": [float(step)]})
    assert len(history) < 1000 and history.stride == 16
    steps = [row["step"] for row in history.rows()]
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    assert steps[0] == 0 and steps[-1] > 9_900 and gaps == {16}
    assert len(history.series("loss", points=100)) == 100


def test_a_new_outer_bar_replaces_finished_ones():
    state = RunState(1, "cpu", "gloo", "cpu")
    for bar_id in range(3):  # three loops in a row, each finished
        state.bars(
            [BarSnapshot(id=bar_id, level=0, desc="loop", n=5, total=5, elapsed=1.0, closed=True)]
        )
    assert [b.id for b in state.snapshot().bars] == [2]


def test_inner_bars_go_when_closed_and_rates_are_smoothed():
    state = RunState(1, "cpu", "gloo", "cpu")
    state.bars(
        [
            BarSnapshot(0, 0, "epoch", 0, 2, 1.0, False),
            BarSnapshot(1, 1, "batch", 10, 100, 1.0, False),
        ]
    )
    state.bars([BarSnapshot(1, 1, "batch", 30, 100, 2.0, False)])
    bars = state.snapshot().bars
    assert [b.desc for b in bars] == ["epoch", "batch"]
    assert bars[1].rate == pytest.approx(0.3 * 20 + 0.7 * 10)
    state.bars([BarSnapshot(1, 1, "batch", 100, 100, 3.0, True)])
    assert [b.desc for b in state.snapshot().bars] == ["epoch"]


def test_the_panel_says_which_rank_is_in_pdb_and_that_is_no_stall():
    from nbddp.display.html import header_html
    from nbddp.display.text import status_line
    from nbddp.wire.prompts import LeftPdb, Prompt

    state = RunState(2, "cpu", "gloo", "cpu")
    quiet_since = state.last_progress
    state.prompt(1, Prompt(1, 1, "pdb", "", "(Pdb rank 1) ", ("f.py", 3)))
    snapshot = state.snapshot()
    assert snapshot.pdb_line == "rank 1 in pdb · run.wait() answers in its cell"
    assert "rank 1 in pdb" in header_html(snapshot) and "rank 1 in pdb" in status_line(snapshot)
    assert state.progress_mark > quiet_since  # the stall watch sees a person at work
    state.prompts._servers = 1  # a cell waits for the run: it asks there
    assert state.snapshot().pdb_line == "rank 1 in pdb"
    state.left_pdb(1, LeftPdb(1, 0, 0))
    state.prompt(0, Prompt(0, 1, "input", "", "name? ", ("f.py", 9)))
    assert state.snapshot().pdb_line == "rank 0 waiting in input()"
    state.left_pdb(0, None)  # it ended
    assert state.snapshot().pdb_line == "" and state.progress_mark == state.last_progress
