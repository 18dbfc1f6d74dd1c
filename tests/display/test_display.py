"""The views: pure renderers of a snapshot (text line, HTML summary), and the live loop's
fall-back when a view fails."""

from __future__ import annotations

import io
import math
import threading
import time

import pytest
from conftest import blocks

from nbddp.display import LiveDisplay
from nbddp.display.html import summary_html
from nbddp.display.text import TextView
from nbddp.errors import NbddpWarning
from nbddp.state.format import bar_text
from nbddp.state.run import RunState, ShownBar


@pytest.mark.unit
def test_bar_text_is_tqdm_like():
    bar = ShownBar(id=0, level=0, desc="train", n=4, total=10, elapsed=2.0, closed=False, rate=2.0)
    assert bar_text(bar) == "train:  40% 4/10 [00:02<00:03, 2.00 it/s]"


@pytest.mark.unit
def test_text_view_writes_a_line_every_few_seconds_not_every_step():
    state = RunState(2, "cpu", "gloo", "cpu")
    stream = io.StringIO()
    view = TextView(stream)
    for step in range(100):
        state.rows(0, step, blocks((None, {"loss": 1.0})))
        state.rows(1, step, blocks((None, {"loss": 0.0})))
        view.render(state.snapshot())
    state.finish("succeeded", None)
    view.finish(state.snapshot())
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "loss=0.5" in lines[0]
    assert lines[-1].startswith("nbddp: succeeded after")


@pytest.mark.unit
def test_text_view_redraws_in_place_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    state = RunState(1, "cpu", "gloo", "cpu")
    stream = Terminal()
    view = TextView(stream)
    for step in range(3):
        state.rows(0, step, blocks((None, {"loss": float(step)})))
        view.render(state.snapshot())
    assert stream.getvalue().count("\r") == 3 and "\n" not in stream.getvalue()


@pytest.mark.unit
def test_summary_shows_failure_in_red_with_the_first_line():
    state = RunState(2, "cpu", "gloo", "cpu")
    state.rows(0, 0, blocks((None, {"loss": 1.0})))
    state.finish("failed", ValueError("bad batch\nmore"))
    html = summary_html(state.snapshot())
    assert "failed" in html and "ValueError: bad batch" in html and "more" not in html


@pytest.mark.unit
def test_summary_svg_has_the_curve():
    state = RunState(1, "cpu", "gloo", "cpu")
    for step in range(20):
        state.rows(0, step, blocks((None, {"loss": math.exp(-step / 5)})))
    state.finish("succeeded", None)
    html = summary_html(state.snapshot())
    assert html.count("<polyline") == 1 and "loss" in html


class BrokenView:
    def __init__(self) -> None:
        self.calls = 0

    def render(self, snapshot: object) -> None:
        self.calls += 1
        raise KeyError("a bug in a view")

    def finish(self, snapshot: object) -> None:
        raise KeyError("a bug in a view")


@pytest.mark.unit
def test_a_failing_view_warns_once_and_the_text_view_takes_over(capsys):
    state = RunState(1, "cpu", "gloo", "cpu")
    display = LiveDisplay(state, "none", None, blocking=True)
    broken = BrokenView()
    display._view = broken
    display._thread = None
    with pytest.warns(NbddpWarning, match="live none view failed with KeyError") as caught:
        display._render(state.snapshot())
        display._render(state.snapshot())  # the text view renders this one
    assert len(caught) == 1 and broken.calls == 1
    assert isinstance(display._view, TextView) and display.mode == "text"
    state.finish("succeeded", None)
    display.close()  # the broken view's finish is tried, quietly; the text summary is written
    assert "nbddp: succeeded after" in capsys.readouterr().out


@pytest.mark.unit
def test_the_live_loop_renders_snapshots_while_the_state_changes():
    state = RunState(2, "cpu", "gloo", "cpu")
    stream = io.StringIO()

    seen: list = []

    class Recording(TextView):
        def render(self, snapshot):
            seen.append(snapshot)

    display = LiveDisplay(state, "none", None, blocking=True)
    display._view = Recording(stream)
    display._thread = None
    thread = threading.Thread(target=display._loop, daemon=True)
    thread.start()
    for step in range(50):
        state.rows(0, step, blocks((None, {"loss": 1.0})))
        state.rows(1, step, blocks((None, {"loss": 3.0})))
        time.sleep(0.005)
    state.finish("succeeded", None)
    display._thread = thread
    display.close()
    assert seen and all(s.latest in ({}, {"loss": 2.0}) for s in seen)
    assert all(len(points) <= 300 for s in seen for points in s.series.values())


@pytest.mark.e2e
def test_a_notice_is_one_line_updated_in_place_in_a_notebook(kernel):
    """A Slurm job waiting in the queue: one output redrawn at every look, not a line each."""
    messages: list[dict] = []
    out, reply = kernel.run(
        "from nbddp.display.notice import Notice\n"
        "notice = Notice()\n"
        "for text in ('job 7 is PENDING (Priority)', 'job 7 is PENDING (Priority)',\n"
        "             'job 7 is PENDING (Resources)'):\n"
        "    notice.show(text)\n",
        messages=messages,
    )
    assert reply["status"] == "ok", out
    shown = [m for m in messages if m["msg_type"] == "display_data"]
    updates = [m for m in messages if m["msg_type"] == "update_display_data"]
    assert len(shown) == 1 and len(updates) == 2
    assert shown[0]["content"]["data"]["text/plain"] == "nbddp: job 7 is PENDING (Priority)"
    assert "Resources" in updates[-1]["content"]["data"]["text/html"]
    assert not [m for m in messages if m["msg_type"] == "stream"]


@pytest.mark.unit
def test_a_notice_outside_a_notebook_prints_each_change_once(capsys):
    from nbddp.display.notice import Notice

    notice = Notice()
    for text in ("job 7 is PENDING (Priority)", "job 7 is PENDING (Priority)", "job 7 runs"):
        notice.show(text)
    assert capsys.readouterr().err.splitlines() == [
        "nbddp: job 7 is PENDING (Priority)",
        "nbddp: job 7 runs",
    ]
