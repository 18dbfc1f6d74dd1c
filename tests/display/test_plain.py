"""The panel's ``text/plain`` (``display/plain.py``): what the panel shows, as text, live and at
the end; pure functions of a snapshot, no process."""

from __future__ import annotations

import pytest
from conftest import blocks

from nbddp.display.plain import panel_text
from nbddp.state.run import RunState
from nbddp.wire.messages import BarSnapshot

pytestmark = pytest.mark.unit


def running(world: int = 2) -> RunState:
    state = RunState(world, "cpu", "gloo", "cpu")
    state.started()
    state.bars(
        [
            BarSnapshot(1, 0, "epoch", 1, 2, 3.0, False),
            BarSnapshot(2, 1, "batch", 20, 50, 3.0, False),
        ]
    )
    for step in range(20):
        for rank in range(world):
            state.rows(rank, step, blocks((None, {"loss": 1.0 + 2 * rank, "acc": 0.5 + rank / 5})))
    return state


def test_the_live_text_has_the_status_bars_metrics_output_and_how_to_stop():
    state = running()
    state.add_output("\x1b[1;31mEpoch 1\x1b[0m\nloss: 0.3  [ 64/1024]\n")
    text = panel_text(state.snapshot(), "stop: run.stop()")
    lines = text.splitlines()
    assert lines[0].startswith("nbddp run running · 2 × cpu (gloo) · ")
    assert lines[1].startswith("epoch:  50% 1/2") and lines[2].startswith("  batch:  40% 20/50")
    assert "metrics, averaged over 2 ranks, step 19:" in lines
    assert "  loss  2" in lines and "  acc   0.6" in lines
    assert lines[-4:] == ["rank 0 output:", "Epoch 1", "loss: 0.3  [ 64/1024]", "stop: run.stop()"]


def test_a_long_output_keeps_its_last_lines_and_says_how_many_are_left_out():
    state = running(world=1)
    state.add_output("".join(f"line {i}\n" for i in range(1, 501)))
    text = panel_text(state.snapshot())
    assert "… 300 earlier lines not shown\nline 301\n" in text and text.endswith("line 500")
    assert "line 300\n" not in text


def test_the_final_text_is_the_summary_with_both_ends_of_a_long_log(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = running()
    state.add_output("".join(f"line {i}\n" for i in range(1, 4_101)))
    state.finish("failed", ValueError("rank 1 raised ValueError: bad batch\nmore"))
    final = state.snapshot(final=True)
    text = panel_text(final, "stop: run.stop()")
    assert text.startswith("nbddp run failed · 2 × cpu (gloo) · ")
    assert "\n  ValueError: rank 1 raised ValueError: bad batch\n" in text and "more" not in text
    assert "line 1\nline 2\n" in text and text.endswith("line 4100")
    assert f"… 100 lines not shown here; all of rank 0's output: {final.output_file}\n" in text
    assert "stop:" not in text  # an ended run has nothing to stop


def test_the_stall_banner_and_the_graceful_stop_are_in_the_text():
    state = running()
    state.stopping("the Stop button")
    state.show_where("ranks 0, 1 wait in all_reduce", stalled_since=1_000_000.0)
    text = panel_text(state.snapshot())
    assert "stopping gracefully (the Stop button)" in text
    assert "no rank made progress since" in text and "  ranks 0, 1 wait in all_reduce" in text
