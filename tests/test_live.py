"""The live view: log rows averaged across ranks, progress bars, the panel and its summary."""

from __future__ import annotations

import io
import itertools
import math
import re
import sys
import time

import nbformat
import pytest
import torch
from nbclient import NotebookClient

import nbddp
from nbddp.display.html import bar_text, summary_html
from nbddp.display.state import History, MetricsAggregator, RunState
from nbddp.display.text import TextView
from nbddp.worker import live
from nbddp.worker.live import LiveBuffer

TWO_CPU = {"num_workers": 2, "device": "cpu"}


def blocks(*rows: tuple) -> list:
    """Rows ``(epoch, {name: value})`` as a worker sends them: runs of rows with the same
    epoch and keys, a list of values per key."""
    sent: list = []
    for epoch, values in rows:
        if not sent or sent[-1][:2] != (epoch, tuple(values)):
            sent.append((epoch, tuple(values), [[] for _ in values]))
        for column, value in zip(sent[-1][2], values.values(), strict=True):
            column.append(value)
    return sent


# -- the model, without processes -------------------------------------------------------------


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


def test_log_rejects_what_cannot_be_averaged():
    buffer = LiveBuffer(lambda kind, data: None)
    try:
        with pytest.raises(ValueError, match=r"'x' must be a scalar.*shape \[2\].*x.mean\(\)"):
            buffer.log({"x": torch.ones(2)})
        with pytest.raises(TypeError, match="'name' must be a number"):
            buffer.log({"name": "abc"})
    finally:
        buffer.close()


def test_log_ships_rows_in_batches_of_columns():
    received = []
    buffer = LiveBuffer(lambda kind, data: received.append((kind, data)))
    for i in range(50):
        buffer.log({"loss": torch.tensor(i / 10), "lr": 0.1})
    buffer.log({"lr": 0.2})  # another set of keys starts another block
    buffer.close()
    batches = [data for kind, data in received if kind == "log"]
    assert 1 <= len(batches) < 50 and batches[0][0] == 0
    merged: dict[tuple, list[list[float]]] = {}
    for _, sent in batches:
        for _, keys, columns in sent:
            for column, values in zip(merged.setdefault(keys, [[] for _ in keys]), columns,
                                      strict=True):
                column += values
    assert merged[("loss", "lr")][0][7] == pytest.approx(0.7)
    assert merged[("loss", "lr")][1] == [0.1] * 50 and merged[("lr",)] == [[0.2]]


def test_unread_tensors_become_floats_in_place():
    sent = blocks(*[(None, {"loss": torch.tensor(i / 10), "n": torch.tensor(i)})
                    for i in range(5)])
    live._read_tensors(sent)
    assert sent == [(None, ("loss", "n"), [[pytest.approx(i / 10) for i in range(5)],
                                           [float(i) for i in range(5)]])]
    assert all(type(v) is float for column in sent[0][2] for v in column)


def test_no_row_is_lost_or_reordered_while_the_flusher_races_the_logger(monkeypatch):
    monkeypatch.setattr(live, "FLUSH_INTERVAL", 0.0002)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch between the two threads very often
    received = []
    try:
        buffer = LiveBuffer(lambda kind, data: received.append(data) if kind == "log" else None)
        for i in range(60_000):
            if i % 997 == 0:
                buffer.epoch = i  # a new block now and then
            buffer.log({"i": float(i)} if i % 3000 < 1500 else {"i": float(i), "x": 0.0})
        buffer.close()
    finally:
        sys.setswitchinterval(interval)
    assert len(received) > 10  # the flusher did run while rows were logged
    seen: list[float] = []
    for first, sent in received:
        assert first == len(seen)
        for _, keys, columns in sent:
            seen += columns[keys.index("i")]
    assert seen == [float(i) for i in range(60_000)]


def test_rows_with_the_same_keys_in_another_order_stay_apart():
    received = []
    buffer = LiveBuffer(lambda kind, data: received.append(data))
    buffer.log({"a": 1.0, "b": 2.0})
    buffer.log({"b": 4.0, "a": 3.0})
    buffer.close()
    assert received == [(0, [(None, ("a", "b"), [[1.0], [2.0]]),
                             (None, ("b", "a"), [[4.0], [3.0]])])]


def test_bar_text_is_tqdm_like():
    bar = {"desc": "train", "n": 4, "total": 10, "elapsed": 2.0, "rate": 2.0}
    assert bar_text(bar) == "train:  40% 4/10 [00:02<00:03, 2.00 it/s]"


def test_text_view_writes_a_line_every_few_seconds_not_every_step():
    state = RunState(2, "cpu", "gloo", "cpu")
    stream = io.StringIO()
    view = TextView(state, stream)
    for step in range(100):
        state.add_rows(0, step, blocks((None, {"loss": 1.0})))
        state.add_rows(1, step, blocks((None, {"loss": 0.0})))
        view.render()
    state.finish("succeeded", None)
    view.finish()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "loss=0.5" in lines[0]
    assert lines[-1].startswith("nbddp: succeeded after")


def test_text_view_redraws_in_place_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    state = RunState(1, "cpu", "gloo", "cpu")
    stream = Terminal()
    view = TextView(state, stream)
    for step in range(3):
        state.add_rows(0, step, blocks((None, {"loss": float(step)})))
        view.render()
    assert stream.getvalue().count("\r") == 3 and "\n" not in stream.getvalue()


def test_summary_shows_failure_in_red_with_the_first_line():
    state = RunState(2, "cpu", "gloo", "cpu")
    state.add_rows(0, 0, blocks((None, {"loss": 1.0})))
    state.finish("failed", ValueError("bad batch\nmore"))
    html = summary_html(state)
    assert "failed" in html and "ValueError: bad batch" in html and "more" not in html


# -- real launches ----------------------------------------------------------------------------


def logs_rank_and_progress(steps: int) -> int:
    epoch = -1
    for epoch in nbddp.progress(range(2), desc="epoch"):  # noqa: B007 - returned below
        for step in nbddp.progress(range(steps), desc="batch"):
            nbddp.log(loss=torch.tensor(float(nbddp.rank())), step_in_epoch=step)
            if nbddp.rank() == 1:
                time.sleep(0.002)  # rank 1 runs behind: its rows must still all count
    return epoch


def test_history_holds_cross_rank_averages_with_step_and_epoch(capsys):
    assert nbddp.notebook_launch(logs_rank_and_progress, (25,), **TWO_CPU) == 1
    history = nbddp.last_run().history
    assert len(history) == 50
    assert {row["loss"] for row in history} == {0.5}
    assert [row["step"] for row in history] == list(range(50))
    assert [row["epoch"] for row in history] == [0] * 25 + [1] * 25
    assert history[-1]["step_in_epoch"] == 24
    final = nbddp.last_run().state.snapshot_bars()
    assert [(b["desc"], b["n"], b["total"]) for b in final] == [("epoch", 2, 2)]
    assert "loss=0.5" in capsys.readouterr().out  # the text view's final line


def test_fallback_shows_the_same_history():
    nbddp.notebook_launch(logs_rank_and_progress, (5,), num_workers=1, display="none")
    assert [row["loss"] for row in nbddp.last_run().history] == [0.0] * 10


def test_progress_is_a_pass_through_off_rank_zero_and_outside_a_launch():
    items = [1, 2, 3]
    assert nbddp.progress(items) is items
    nbddp.log(loss=1.0)  # outside a launch: nothing to do, no error


# -- in a real kernel ---------------------------------------------------------------------------


def _widget_values(messages: list[dict]) -> list[str]:
    return [m["content"]["data"]["state"]["value"] for m in messages
            if m["msg_type"] == "comm_msg" and "value" in m["content"]["data"].get("state", {})]


def test_widget_shows_bars_reaching_total_and_averaged_metrics(kernel):
    kernel.run(
        "def train(steps):\n"
        "    for step in nbddp.progress(range(steps), desc='batch'):\n"
        "        nbddp.log(loss=float(nbddp.rank()))\n"
        "        time.sleep(0.01)\n"
        "        print('step', step, flush=True)\n"
    )
    messages: list[dict] = []
    out, reply = kernel.run("nbddp.notebook_launch(train, (40,), num_workers=2, device='cpu')",
                            messages=messages)
    assert reply["status"] == "ok", out
    shown = [m for m in messages if m["msg_type"] == "display_data"]
    assert "application/vnd.jupyter.widget-view+json" in shown[0]["content"]["data"]
    values = _widget_values(messages)
    bars = [v for v in values if "nbddp-bar" in v]
    assert any('value="40" max="40"' in v for v in bars)
    assert len({re.search(r'value="(\d+)"', v).group(1) for v in bars}) > 1  # it moved
    assert any("nbddp-metrics" in v and ">0.5<" in v for v in values)
    assert any("step 39" in v for v in values)  # rank 0's output, in the panel
    final = [m for m in messages if m["msg_type"] == "update_display_data"][-1]["content"]
    assert "nbddp-summary" in final["data"]["text/html"]
    assert "application/vnd.jupyter.widget-view+json" not in final["data"]


def test_saved_notebook_keeps_a_static_summary(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import nbddp, torch"),
        nbformat.v4.new_code_cell(
            "def train():\n"
            "    for step in nbddp.progress(range(30)):\n"
            "        nbddp.log(loss=1.0 / (step + 1))\n"
            "    return 'ok'\n"
            "nbddp.notebook_launch(train, num_workers=2, device='cpu')"
        ),
        nbformat.v4.new_code_cell(
            "def fails():\n    raise RuntimeError('diverged')\n"
            "try:\n    nbddp.notebook_launch(fails, num_workers=2, device='cpu')\n"
            "except nbddp.WorkerError:\n    pass"
        ),
    ]
    NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
    path = tmp_path / "saved.ipynb"
    nbformat.write(notebook, path)
    saved = nbformat.read(path, as_version=4)
    ok_html = saved.cells[1].outputs[0]["data"]["text/html"]
    assert "nbddp-summary" in ok_html and "done" in ok_html and "<svg" in ok_html
    assert "application/vnd.jupyter.widget-view+json" not in saved.cells[1].outputs[0]["data"]
    failed_html = saved.cells[2].outputs[0]["data"]["text/html"]
    assert ">failed<" in failed_html
    assert re.search(r"rank \d raised RuntimeError: diverged", failed_html)


def test_summary_svg_has_the_curve():
    state = RunState(1, "cpu", "gloo", "cpu")
    for step in range(20):
        state.add_rows(0, step, blocks((None, {"loss": math.exp(-step / 5)})))
    state.finish("succeeded", None)
    html = summary_html(state)
    assert html.count("<polyline") == 1 and "loss" in html


def test_background_panel_updates_between_cells_and_its_stop_button_works(kernel):
    kernel.run(
        "def slow():\n"
        "    for step in nbddp.progress(range(10_000), desc='slow'):\n"
        "        nbddp.log(loss=float(step))\n"
        "        time.sleep(0.02)\n"
    )
    messages: list[dict] = []
    out, reply = kernel.run(
        "run = nbddp.notebook_launch(slow, num_workers=2, device='cpu', block=False)",
        messages=messages)
    assert reply["status"] == "ok", out
    button = next(m["content"]["comm_id"] for m in messages if m["msg_type"] == "comm_open"
                  and m["content"]["data"]["state"].get("_model_name") == "ButtonModel")
    assert not next(m for m in messages if m["content"].get("comm_id") == button)[
        "content"]["data"]["state"]["disabled"]  # usable: the cell is not busy

    later: list[dict] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            "nbddp-bar" in v for v in _widget_values(later)):
        kernel.run("x = 1", messages=later)  # other cells run while the panel updates
        time.sleep(0.5)
    assert any("nbddp-bar" in v for v in _widget_values(later))

    kernel.client.session.send(kernel.client.shell_channel.socket, "comm_msg", {
        "comm_id": button, "data": {"method": "custom", "content": {"event": "click"}}})
    deadline = time.monotonic() + 20
    status = ""
    while time.monotonic() < deadline and status != "stopped":
        status, _ = kernel.run("print(run.status, end='')")
        time.sleep(0.2)
    assert status == "stopped"


def test_fallback_shows_the_same_panel(kernel):
    kernel.run("def short():\n    for s in nbddp.progress(range(5)):\n"
               "        nbddp.log(loss=float(s))\n        print('step', s)\n")
    messages: list[dict] = []
    out, reply = kernel.run("nbddp.notebook_launch(short, num_workers=1)", messages=messages)
    assert reply["status"] == "ok", out
    shown = next(m for m in messages if m["msg_type"] == "display_data")["content"]["data"]
    assert "application/vnd.jupyter.widget-view+json" in shown
    final = [m for m in messages if m["msg_type"] == "update_display_data"][-1]["content"]
    html = final["data"]["text/html"]
    assert "1 × cpu" in html and "nbddp-metrics" in html and "step 4" in html


def test_a_new_outer_bar_replaces_finished_ones():
    state = RunState(1, "cpu", "gloo", "cpu")
    for bar_id in range(3):  # three loops in a row, each finished
        state.set_bars([{"id": bar_id, "level": 0, "desc": "loop", "n": 5, "total": 5,
                         "elapsed": 1.0, "closed": True}])
    assert [b["id"] for b in state.snapshot_bars()] == [2]
