"""The live view: log rows averaged across ranks, progress bars, the panel and its summary."""

from __future__ import annotations

import re
import sys
import time

import nbformat
import pytest
import torch
from conftest import TWO_CPU, TWO_CPU_QUIET, blocks, run_notebook

import nbddp
from nbddp.worker import live
from nbddp.worker.live import LiveBuffer

# -- the buffer, without processes ---------------------------------------------------------


class Recorder:
    """A LiveSink that keeps what the flusher delivers."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def rows(self, first: int, blocks: list) -> None:
        self.sent.append(("log", (first, blocks)))

    def bars(self, bars: list) -> None:
        self.sent.append(("progress", bars))

    def logged(self) -> list:
        return [data for kind, data in self.sent if kind == "log"]


@pytest.mark.unit
def test_log_rejects_what_cannot_be_averaged():
    buffer = LiveBuffer(Recorder())
    try:
        with pytest.raises(ValueError, match=r"'x' must be a scalar.*shape \[2\].*x.mean\(\)"):
            buffer.log({"x": torch.ones(2)})
        with pytest.raises(TypeError, match="'name' must be a number"):
            buffer.log({"name": "abc"})
    finally:
        buffer.close()


@pytest.mark.unit
def test_log_ships_rows_in_batches_of_columns():
    received = Recorder()
    buffer = LiveBuffer(received)
    for i in range(50):
        buffer.log({"loss": torch.tensor(i / 10), "lr": 0.1})
    buffer.log({"lr": 0.2})  # another set of keys starts another block
    buffer.close()
    batches = received.logged()
    assert 1 <= len(batches) < 50 and batches[0][0] == 0
    merged: dict[tuple, list[list[float]]] = {}
    for _, sent in batches:
        for _, keys, columns in sent:
            for column, values in zip(
                merged.setdefault(keys, [[] for _ in keys]), columns, strict=True
            ):
                column += values
    assert merged[("loss", "lr")][0][7] == pytest.approx(0.7)
    assert merged[("loss", "lr")][1] == [0.1] * 50 and merged[("lr",)] == [[0.2]]


@pytest.mark.unit
def test_unread_tensors_become_floats_in_place():
    sent = blocks(*[(None, {"loss": torch.tensor(i / 10), "n": torch.tensor(i)}) for i in range(5)])
    live._read_tensors(sent)
    assert sent == [
        (
            None,
            ("loss", "n"),
            [[pytest.approx(i / 10) for i in range(5)], [float(i) for i in range(5)]],
        )
    ]
    assert all(type(v) is float for column in sent[0][2] for v in column)


@pytest.mark.unit
def test_no_row_is_lost_or_reordered_while_the_flusher_races_the_logger(monkeypatch):
    monkeypatch.setattr(live, "FLUSH_INTERVAL", 0.0002)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch between the two threads very often
    recorder = Recorder()
    try:
        buffer = LiveBuffer(recorder)
        for i in range(60_000):
            if i % 997 == 0:
                buffer.epoch = i  # a new block now and then
            buffer.log({"i": float(i)} if i % 3000 < 1500 else {"i": float(i), "x": 0.0})
        buffer.close()
    finally:
        sys.setswitchinterval(interval)
    received = recorder.logged()
    assert len(received) > 10  # the flusher did run while rows were logged
    seen: list[float] = []
    for first, sent in received:
        assert first == len(seen)
        for _, keys, columns in sent:
            seen += columns[keys.index("i")]
    assert seen == [float(i) for i in range(60_000)]


@pytest.mark.unit
def test_rows_with_the_same_keys_in_another_order_stay_apart():
    recorder = Recorder()
    buffer = LiveBuffer(recorder)
    buffer.log({"a": 1.0, "b": 2.0})
    buffer.log({"b": 4.0, "a": 3.0})
    buffer.close()
    assert recorder.logged() == [
        (0, [(None, ("a", "b"), [[1.0], [2.0]]), (None, ("b", "a"), [[4.0], [3.0]])])
    ]


# -- real launches ----------------------------------------------------------------------------


def logs_rank_and_progress(steps: int) -> int:
    epoch = -1
    for epoch in nbddp.progress(range(2), desc="epoch"):  # noqa: B007 - returned below
        for step in nbddp.progress(range(steps), desc="batch"):
            nbddp.log(loss=torch.tensor(float(nbddp.rank())), step_in_epoch=step)
            if nbddp.rank() == 1:
                time.sleep(0.002)  # rank 1 runs behind: its rows must still all count
    return epoch


@pytest.mark.ranks
def test_history_holds_cross_rank_averages_with_step_and_epoch(capsys):
    assert nbddp.notebook_launch(logs_rank_and_progress, (25,), **TWO_CPU) == 1
    history = nbddp.last_run().history
    assert len(history) == 50
    assert {row["loss"] for row in history} == {0.5}
    assert [row["step"] for row in history] == list(range(50))
    assert [row["epoch"] for row in history] == [0] * 25 + [1] * 25
    assert history[-1]["step_in_epoch"] == 24
    final = nbddp.last_run()._state.snapshot().bars
    assert [(b.desc, b.n, b.total) for b in final] == [("epoch", 2, 2)]
    assert "loss=0.5" in capsys.readouterr().out  # the text view's final line


@pytest.mark.ranks
def test_fallback_shows_the_same_history():
    nbddp.notebook_launch(logs_rank_and_progress, (5,), num_workers=1, display="none")
    assert [row["loss"] for row in nbddp.last_run().history] == [0.0] * 10


def progress_passes_through() -> tuple[bool, bool, int]:
    items = [1, 2, 3]
    shown = nbddp.progress(items)
    return shown is items, list(shown) == items, len(shown)


@pytest.mark.ranks
def test_progress_is_a_pass_through_outside_a_launch_and_checks_on_every_rank_in_one():
    assert progress_passes_through() == (True, True, 3)
    nbddp.log(loss=1.0)  # outside a launch: nothing to do, no error
    # in a launch: rank 0's is the live bar; every rank's checks for a graceful stop
    ranks = nbddp.notebook_launch(progress_passes_through, return_all=True, **TWO_CPU_QUIET)
    assert ranks == [(False, True, 3), (False, True, 3)]


# -- in a real kernel ---------------------------------------------------------------------------


def _bar_values(messages: list[dict]) -> set[str]:
    return {
        match
        for v in _widget_values(messages)
        if "nbddp-bar" in v
        for match in re.findall(r'value="(\d+)"', v)
    }


def _widget_values(messages: list[dict]) -> list[str]:
    """The live panel's HTML, each time it was drawn (an output updated by its display id)."""
    return [
        m["content"]["data"]["text/html"]
        for m in messages
        if m["msg_type"] in ("display_data", "update_display_data")
        and m["content"].get("transient", {}).get("display_id", "").startswith("nbddp-panel")
        and "nbddp-panel" in m["content"]["data"].get("text/html", "")
    ]


@pytest.mark.e2e
def test_widget_shows_bars_reaching_total_and_averaged_metrics(kernel):
    kernel.run(
        "def train(steps):\n"
        "    for step in nbddp.progress(range(steps), desc='batch'):\n"
        "        nbddp.log(loss=float(nbddp.rank()))\n"
        "        time.sleep(0.02)\n"
        "        print('step', step, flush=True)\n"
    )
    messages: list[dict] = []
    out, reply = kernel.run(
        "nbddp.notebook_launch(train, (80,), num_workers=2, device='cpu')", messages=messages
    )
    assert reply["status"] == "ok", out  # ~1.6 s of steps: several draws at the panel's rate
    shown = [m for m in messages if m["msg_type"] == "display_data"]
    # one HTML output, updated in place: every frontend renders it, no widget manager needed
    assert "nbddp-panel" in shown[0]["content"]["data"]["text/html"]
    assert "application/vnd.jupyter.widget-view+json" not in shown[0]["content"]["data"]
    assert not [m for m in messages if m["msg_type"] == "comm_open"]  # no widget at all
    assert "stop: the kernel&#x27;s interrupt button" in shown[0]["content"]["data"]["text/html"]
    values = _widget_values(messages)
    final = [m for m in messages if m["msg_type"] == "update_display_data"][-1]["content"]
    bars = [v for v in [*values, final["data"]["text/html"]] if "nbddp-bar" in v]
    assert any('value="80" max="80"' in v for v in bars)  # live, or in the final summary
    assert len(_bar_values(messages)) >= 4  # it moved while the run went on, not only at the end
    assert any("nbddp-metrics" in v and ">0.5<" in v for v in bars)
    assert any("step 3" in v for v in values)  # rank 0's output, in the live panel
    assert "step 79" in final["data"]["text/html"]  # and all of it in the summary
    assert "nbddp-summary" in final["data"]["text/html"]
    assert "application/vnd.jupyter.widget-view+json" not in final["data"]


@pytest.mark.e2e
@pytest.mark.smoke
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
    run_notebook(notebook, timeout=120)
    path = tmp_path / "saved.ipynb"
    nbformat.write(notebook, path)
    saved = nbformat.read(path, as_version=4)
    ok_html = saved.cells[1].outputs[0]["data"]["text/html"]
    assert "nbddp-summary" in ok_html and "done" in ok_html and "<svg" in ok_html
    assert "application/vnd.jupyter.widget-view+json" not in saved.cells[1].outputs[0]["data"]
    failed_html = saved.cells[2].outputs[0]["data"]["text/html"]
    assert ">failed<" in failed_html
    assert re.search(r"rank \d raised RuntimeError: diverged", failed_html)


@pytest.mark.e2e
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
        messages=messages,
    )
    assert reply["status"] == "ok", out
    button = next(
        m["content"]["comm_id"]
        for m in messages
        if m["msg_type"] == "comm_open"
        and m["content"]["data"]["state"].get("_model_name") == "ButtonModel"
    )
    assert not next(m for m in messages if m["content"].get("comm_id") == button)["content"][
        "data"
    ]["state"]["disabled"]  # usable: the cell is not busy

    later: list[dict] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_bar_values(later)) < 3:
        seen, reply = kernel.run_seeing_everything("x = 1")  # other cells run meanwhile
        assert reply["status"] == "ok"
        later += seen
        time.sleep(0.5)
    assert len(_bar_values(later)) >= 3  # the panel kept moving between those cells
    launching = messages[0]["parent_header"]["msg_id"]
    panel_updates = [
        m
        for m in later
        if m["msg_type"] == "update_display_data" and "nbddp-panel" in str(m["content"])
    ]
    assert panel_updates and all(  # filed under the cell that launched, not the one running
        m["parent_header"]["msg_id"] == launching for m in panel_updates
    )

    kernel.client.session.send(
        kernel.client.shell_channel.socket,
        "comm_msg",
        {"comm_id": button, "data": {"method": "custom", "content": {"event": "click"}}},
    )
    deadline = time.monotonic() + 20
    status = ""
    while time.monotonic() < deadline and status != "stopped":
        status, _ = kernel.run("print(run.status, end='')")
        time.sleep(0.2)
    assert status == "stopped"
    out, _ = kernel.run(  # gracefully: at one step, with the function's value
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    value = run.result()\n"
        "print(value, any('asked by the Stop button' in str(w.message) for w in caught))"
    )
    assert out.strip() == "None True", out


@pytest.mark.e2e
def test_fallback_shows_the_same_panel(kernel):
    kernel.run(
        "def short():\n    for s in nbddp.progress(range(5)):\n"
        "        nbddp.log(loss=float(s))\n        print('step', s)\n"
    )
    messages: list[dict] = []
    out, reply = kernel.run("nbddp.notebook_launch(short, num_workers=1)", messages=messages)
    assert reply["status"] == "ok", out
    shown = next(m for m in messages if m["msg_type"] == "display_data")["content"]["data"]
    assert "nbddp-panel" in shown["text/html"]
    final = [m for m in messages if m["msg_type"] == "update_display_data"][-1]["content"]
    html = final["data"]["text/html"]
    assert "1 × cpu" in html and "nbddp-metrics" in html and "step 4" in html


@pytest.mark.e2e
def test_rank_output_in_the_panel_behaves_like_a_terminal(kernel):
    kernel.run(
        "def noisy():\n"
        "    import sys, time\n"
        "    from tqdm import tqdm\n"
        "    for _ in tqdm(range(300), mininterval=0):\n"
        "        time.sleep(0.001)\n"
        "    print('\\x1b[1;31mred alert\\x1b[0m \\x1b[2Kplain', flush=True)\n"
        "    for percent in range(0, 101, 5):\n"
        "        sys.stdout.write(f'\\rmanual {percent}%')\n"
        "        sys.stdout.flush()\n"
        "        time.sleep(0.01)\n"
        "    print('\\nafter', flush=True)\n"
    )
    messages: list[dict] = []
    out, reply = kernel.run(
        "nbddp.notebook_launch(noisy, num_workers=2, device='cpu')", messages=messages
    )
    assert reply["status"] == "ok", out
    red = '<span style="font-weight:bold;color:#cd3131">red alert</span> plain'
    live = [v for v in _widget_values(messages) if "nbddp-output" in v]
    assert any(red in v for v in live)  # coloured in the live widget
    assert any('value="300" max="300"' in v for v in _widget_values(messages))  # tqdm's bar
    final = [m for m in messages if m["msg_type"] == "update_display_data"][-1]["content"]
    saved = final["data"]["text/html"]
    output = re.search(r'<pre class="nbddp-output"[^>]*>(.*?)</pre>', saved, re.S).group(1)
    assert red in output and "\x1b" not in saved and "\r" not in saved
    # the user's lines, one line for the redrawn counter, none for tqdm's 300 refreshes
    assert re.sub(r"<[^>]+>", "", output).splitlines() == [
        "red alert plain",
        "manual 100%",
        "after",
    ]
