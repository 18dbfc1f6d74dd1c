"""Rich output from the ranks, in a real kernel: display(), DataFrames, matplotlib and plotly
figures, update_display and clear_output, a %%ddp cell's last value, in the launching cell as
MIME bundles, in order with the text, labelled per rank with output="all", and bounded."""

from __future__ import annotations

import importlib.util

import pytest

from nbddp.wire.messages import MAX_DISPLAYS

pytestmark = pytest.mark.e2e

TWO = "%%ddp -n 2 --device cpu --display none"


@pytest.fixture(scope="module")
def rich_kernel(kernel):
    out, reply = kernel.run(
        "%load_ext nbddp\nimport matplotlib.pyplot as plt\nimport pandas as pd\n"
        "from IPython.display import HTML, display, update_display, clear_output"
    )
    assert reply["status"] == "ok", out
    return kernel


def outputs(kernel, code: str) -> list[tuple[str, dict]]:
    """The cell's outputs in order, each (kind, content): stream text, display data."""
    messages: list[dict] = []
    out, reply = kernel.run(code, messages=messages)
    assert reply["status"] == "ok", out
    cell = messages[0]["parent_header"]["msg_id"] if messages else None
    shown = []
    for msg in messages:
        kind = msg["msg_type"]
        if kind in ("stream", "display_data", "update_display_data", "execute_result"):
            assert msg["parent_header"]["msg_id"] == cell  # in this cell
            shown.append((kind, msg["content"]))
    return shown


def texts(shown: list[tuple[str, dict]]) -> list[str]:
    """Streams joined, each display as ``<mime types>``: the order a reader sees."""
    seen: list[str] = []
    for kind, content in shown:
        if kind == "stream":
            if seen and not seen[-1].startswith("<"):
                seen[-1] += content["text"]
            else:
                seen.append(content["text"])
        else:
            seen.append(f"<{kind}: {' '.join(sorted(content['data']))}>")
    return seen


def test_a_ddp_cell_shows_html_a_dataframe_and_a_figure_in_order(rich_kernel):
    shown = outputs(
        rich_kernel,
        f"{TWO}\n"
        "print('before')\n"
        "display(HTML('<b>bold</b>'))\n"
        "print('between')\n"
        "display(pd.DataFrame({'loss': [0.5, 0.25]}))\n"
        "plt.plot([1, 2, 3])\n"
        "plt.show()\n"
        "print('after')\n",
    )
    assert texts(shown) == [
        "before\n",
        "<display_data: text/html text/plain>",
        "between\n",
        "<display_data: text/html text/plain>",
        "<display_data: image/png text/plain>",
        "after\n",
    ]
    html, frame, figure = (content["data"] for kind, content in shown if kind == "display_data")
    assert html["text/html"] == "<b>bold</b>"
    assert "<table" in frame["text/html"] and "loss" in frame["text/html"]
    assert figure["image/png"].startswith("iVBORw0KGgo")  # a PNG, base64 as Jupyter keeps it


def test_figures_left_open_are_shown_when_the_cell_ends(rich_kernel):
    shown = outputs(rich_kernel, f"{TWO}\nfig, ax = plt.subplots()\nax.plot([3, 1, 2])\nNone")
    assert texts(shown) == ["<display_data: image/png text/plain>"]
    # and closed: the next cell starts with no figure
    shown = outputs(rich_kernel, f"{TWO}\nprint(len(plt.get_fignums()))")
    assert texts(shown) == ["0\n"]


def test_update_display_and_clear_output_update_in_place(rich_kernel):
    shown = outputs(
        rich_kernel,
        f"{TWO}\n"
        "handle = display(HTML('<i>step 0</i>'), display_id=True)\n"
        "for step in range(1, 4):\n"
        "    handle.update(HTML(f'<i>step {step}</i>'))\n"
        "update_display(HTML('<i>done</i>'), display_id=handle.display_id)\n"
        "for step in range(3):\n"  # the live-plot idiom
        "    clear_output(wait=True)\n"
        "    display(HTML(f'<u>frame {step}</u>'))\n"
        "del handle\n",
    )
    kinds = [kind for kind, _ in shown]
    assert kinds == ["display_data"] + ["update_display_data"] * 7
    first_id = shown[0][1]["transient"]["display_id"]
    assert all(c["transient"]["display_id"] == first_id for _, c in shown)
    assert shown[4][1]["data"]["text/html"] == "<i>done</i>"
    # clear_output(wait=True) cleared the rank's outputs: each frame replaces what was there
    assert [c["data"]["text/html"] for _, c in shown[5:]] == [
        "<u>frame 0</u>",
        "<u>frame 1</u>",
        "<u>frame 2</u>",
    ]


def test_a_last_value_that_cannot_travel_back_is_shown_from_the_rank(rich_kernel):
    shown = outputs(
        rich_kernel,
        f"{TWO}\nimport threading\n"
        "class Report:\n"
        "    lock = threading.Lock()\n"
        "    def __init__(self):\n        self.guard = threading.Lock()\n"
        "    def _repr_html_(self):\n        return '<h3>report</h3>'\n"
        "Report()",
    )
    displays = [c["data"] for kind, c in shown if kind != "stream"]
    assert len(displays) == 1 and displays[0]["text/html"] == "<h3>report</h3>"
    # a picklable one comes back as the cell's value, formatted by the kernel
    shown = outputs(rich_kernel, f"{TWO}\npd.DataFrame({{'x': [1]}})")
    assert shown[0][0] == "execute_result" and "<table" in shown[0][1]["data"]["text/html"]


def test_notebook_launch_shows_rank_output_and_labels_every_rank_with_output_all(rich_kernel):
    rich_kernel.run(
        "def train():\n"
        "    print('training', nbddp.rank())\n"
        "    display(HTML(f'<b>rank {nbddp.rank()}</b>'))\n"
        "    plt.figure(); plt.plot([1, 2]); plt.show()\n"
        "    return 'done'\n"
    )
    shown = outputs(
        rich_kernel, "nbddp.notebook_launch(train, num_workers=2, device='cpu', display='none')"
    )
    assert texts(shown) == [
        "training 0\n",
        "<display_data: text/html text/plain>",
        "<display_data: image/png text/plain>",
        "<execute_result: text/plain>",
    ]
    shown = outputs(
        rich_kernel,
        "nbddp.notebook_launch(train, num_workers=2, device='cpu', display='none', output='all')",
    )
    displays = [c["data"] for kind, c in shown if kind == "display_data"]
    labels = [d["text/plain"] for d in displays if d["text/plain"].startswith("[rank")]
    assert sorted(labels) == ["[rank 0]"] * 2 + ["[rank 1]"] * 2
    for index, data in enumerate(displays):  # each label comes right before its output
        if data["text/plain"] == "[rank 1]":
            assert displays[index + 1].get("text/html") in ("<b>rank 1</b>", None)
    assert {d.get("text/html") for d in displays} >= {"<b>rank 0</b>", "<b>rank 1</b>"}


def test_a_flood_of_outputs_is_cut_with_a_note(rich_kernel):
    shown = outputs(
        rich_kernel,
        f"{TWO}\nfor i in range({MAX_DISPLAYS + 50}):\n    display(i)\nprint('still running')",
    )
    displays = [c["data"]["text/plain"] for kind, c in shown if kind == "display_data"]
    assert displays[:MAX_DISPLAYS] == [str(i) for i in range(MAX_DISPLAYS)]
    assert len(displays) == MAX_DISPLAYS + 1
    assert f"rank 0 showed {MAX_DISPLAYS} rich outputs, the most one run shows" in displays[-1]
    assert texts(shown)[-1] == "still running\n", shown[-3:]


@pytest.mark.skipif(importlib.util.find_spec("plotly") is None, reason="plotly not installed")
def test_a_plotly_figure_shows_as_plotly_output(rich_kernel):
    shown = outputs(
        rich_kernel,
        f"{TWO}\nimport plotly.graph_objects as go\n"
        "go.Figure(go.Scatter(x=[1, 2, 3], y=[1, 4, 9])).show()",
    )
    bundles = [c["data"] for kind, c in shown if kind == "display_data"]
    figure = next(b for b in bundles if "application/vnd.plotly.v1+json" in b)
    assert figure["application/vnd.plotly.v1+json"]["data"][0]["y"] == [1, 4, 9]
    assert "text/html" in figure  # for frontends without plotly's renderer


def test_a_background_run_shows_its_output_in_the_cell_that_started_it(rich_kernel):
    k = rich_kernel
    k.run("def slow():\n    import time\n    time.sleep(1.5)\n    display(HTML('<b>late</b>'))\n")
    messages, _ = k.run_seeing_everything(
        "run = nbddp.notebook_launch(slow, num_workers=2, device='cpu', display='none', "
        "block=False)"
    )
    starter = messages[0]["parent_header"]["msg_id"]
    later, _ = k.run_seeing_everything("run.wait(30); print(run.status)")
    late = [
        m
        for m in messages + later
        if m["msg_type"] == "display_data"
        and m["content"]["data"].get("text/html") == "<b>late</b>"
    ]
    assert len(late) == 1 and late[0]["parent_header"]["msg_id"] == starter


def test_output_none_shows_no_rank_output(rich_kernel):
    shown = outputs(
        rich_kernel,
        "%%ddp -n 2 --device cpu --display none --output none\n"
        "print('hidden')\ndisplay(HTML('<b>hidden</b>'))\nplt.plot([1]); plt.show()",
    )
    assert shown == []
