"""What every frontend sees of a run, read from a real kernel's messages as each frontend reads
them: a text-only frontend (jupyter console, ``execute_interactive``: streams and the
``text/plain`` of displays, updates ignored), a saved notebook read as text (nbclient, then
``nbconvert --to markdown`` or the outputs' ``text/plain``), ``NBDDP_DISPLAY=text``'s live text,
and the rules VS Code and Colab apply to messages (a ``display_id`` in ``transient`` on a first
display, updates only to ids that exist, HTML and text on every panel message, one prompt per
``input_request``, nothing the panel needs by comm, a run stopped from a later cell).

The browser's view (one summary, not two) is ``tests/test_browser.py``'s; marimo's is
``test_marimo.py``'s."""

from __future__ import annotations

import time

import nbformat
import pytest
from conftest import Kernel, run_notebook, starts_nothing

import nbddp

pytestmark = pytest.mark.e2e

# The PyTorch Quickstart's training, unchanged but for its data (tensors made here, no
# download) and one nbddp.log line, as a person moves it into a cell that runs on 2 ranks.
QUICKSTART = """\
%%ddp -n 2 --device cpu
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
X = torch.randn(1280, 28 * 28)
Y = (X[:, 0] > 0).long()
train_data, test_data = TensorDataset(X[:1024], Y[:1024]), TensorDataset(X[1024:], Y[1024:])
train_dataloader = nbddp.prepare_loader(DataLoader(train_data, batch_size=64))
test_dataloader = nbddp.prepare_loader(DataLoader(test_data, batch_size=64))

class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, x):
        return self.linear_relu_stack(self.flatten(x))

model = nbddp.prepare_model(NeuralNetwork())
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)

def train(dataloader, model, loss_fn, optimizer):
    size = len(dataloader.dataset)
    model.train()
    for batch, (x, y) in enumerate(dataloader):
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        nbddp.log(loss=loss)
        if batch % 4 == 0:
            loss, current = loss.item(), (batch + 1) * len(x)
            print(f"loss: {loss:>7f}  [{current:>5d}/{size:>5d}]")

def test(dataloader, model, loss_fn):
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for x, y in dataloader:
            pred = model(x)
            test_loss += loss_fn(pred, y).item()
            correct += (pred.argmax(1) == y).type(torch.float).sum().item()
    print(f"Test Error: \\n Accuracy: {(100*correct/len(dataloader.dataset)):>0.1f}%, "
          f"Avg loss: {test_loss/len(dataloader):>8f} \\n")

epochs = 2
for t in range(epochs):
    print(f"Epoch {t+1}\\n-------------------------------")
    train(train_dataloader, model, loss_fn, optimizer)
    test(test_dataloader, model, loss_fn)
print("Done!")
"""


def as_a_text_frontend_reads(messages: list[dict]) -> str:
    """What jupyter console prints of a cell: streams, and the ``text/plain`` of displays and
    results; display updates are not applied (execute_interactive's default hook alike)."""
    chunks = []
    for message in messages:
        content = message["content"]
        if message["msg_type"] == "stream":
            chunks.append(content["text"])
        elif message["msg_type"] in ("display_data", "execute_result"):
            chunks.append(content["data"].get("text/plain", "") + "\n")
        elif message["msg_type"] == "error":
            chunks.append("\n".join(content["traceback"]))
    return "".join(chunks)


def says_the_run(text: str) -> None:
    """Rank 0's lines (each once: never twice), the final status and the averaged metrics."""
    for line, times in (("Epoch 1\n", 1), ("Epoch 2\n", 1), ("Done!", 1), ("[   64/ 1024]", 2)):
        assert text.count(line) == times, (line, text)
    assert "nbddp run succeeded" in text, text
    assert "metrics, averaged over 2 ranks" in text and "loss" in text, text


@pytest.fixture(scope="module")
def notebook(kernel: Kernel) -> Kernel:
    out, reply = kernel.run("%load_ext nbddp")
    assert reply["status"] == "ok", out
    return kernel


def test_a_text_only_frontend_sees_rank_0s_output_and_the_final_metrics_once(notebook):
    messages: list[dict] = []
    out, reply = notebook.run(QUICKSTART, messages=messages)
    assert reply["status"] == "ok", out
    says_the_run(as_a_text_frontend_reads(messages))
    # and a frontend that applies updates sees one summary: the panel's, in place
    shown = [m for m in messages if m["msg_type"] == "display_data"]
    assert shown[0]["content"]["transient"]["display_id"].startswith("nbddp-panel")
    final = _applied(messages)
    assert sum("Done!" in bundle.get("text/plain", "") for bundle in final) == 1
    assert sum("Done!" in bundle.get("text/html", "") for bundle in final) == 1


def _applied(messages: list[dict]) -> list[dict]:
    """The cell's outputs as a frontend that applies updates keeps them (JupyterLab, VS Code,
    nbclient): each display, last updated by its display id."""
    outputs: list[dict] = []
    where: dict[str, list[int]] = {}
    for message in messages:
        content, kind = message["content"], message["msg_type"]
        display_id = content.get("transient", {}).get("display_id")
        if kind == "display_data":
            if display_id:
                where.setdefault(display_id, []).append(len(outputs))
            outputs.append(content["data"])
        elif kind == "update_display_data":
            for index in where.get(display_id, []):
                outputs[index] = content["data"]
    return outputs


def test_a_saved_notebook_read_as_text_holds_rank_0s_output_and_the_metrics(tmp_path):
    from nbconvert import MarkdownExporter

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import nbddp\n%load_ext nbddp"),
        nbformat.v4.new_code_cell(QUICKSTART),
    ]
    run_notebook(notebook, timeout=300)
    nbformat.write(notebook, tmp_path / "quickstart.ipynb")
    saved = nbformat.read(tmp_path / "quickstart.ipynb", as_version=4)
    outputs = saved.cells[1].outputs
    says_the_run("".join(o.get("data", {}).get("text/plain", "") + "\n" for o in outputs))
    markdown, _ = MarkdownExporter().from_notebook_node(saved)
    for line, times in (("Epoch 2", 1), ("Done!", 1), ("[   64/ 1024]", 2)):  # not the source's
        assert markdown.count(line) - QUICKSTART.count(line) == times, (line, markdown)
    assert "averaged over 2 ranks" in markdown and "loss" in markdown


def test_nbddp_display_in_the_kernels_environment_gives_live_text(monkeypatch):
    monkeypatch.setenv("NBDDP_DISPLAY", "text")
    kernel = Kernel()  # the kernel inherits this environment, as one started by a person's
    try:
        messages: list[dict] = []
        out, reply = kernel.run(
            "import time, nbddp\n"
            "def train():\n"
            "    for step in nbddp.progress(range(60), desc='batch'):\n"
            "        nbddp.log(loss=1.0 / (1 + step))\n"
            "        time.sleep(0.05)\n"
            "    print('Done!', flush=True)\n"
            "nbddp.notebook_launch(train, num_workers=2, device='cpu')\n",
            messages=messages,
        )
    finally:
        kernel.shutdown()
    assert reply["status"] == "ok", out
    assert not [m for m in messages if m["msg_type"] in ("display_data", "update_display_data")]
    streams = [m["content"]["text"] for m in messages if m["msg_type"] == "stream"]
    live = next(i for i, text in enumerate(streams) if "[nbddp running]" in text)
    done = next(i for i, text in enumerate(streams) if "Done!" in text)
    assert live < done, streams  # a line while it ran, before rank 0's last one
    assert "nbddp: succeeded after" in "".join(streams[done:]) and "loss=" in "".join(streams)


def test_a_bad_nbddp_display_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("NBDDP_DISPLAY", "fancy")
    with starts_nothing(), pytest.raises(ValueError, match="NBDDP_DISPLAY='fancy'"):
        nbddp.notebook_launch(print, num_workers=2, device="cpu")
    with pytest.raises(ValueError, match="NBDDP_DISPLAY='fancy'"):
        nbddp.Session(num_workers=2, device="cpu").run(print)
    monkeypatch.setenv("NBDDP_DISPLAY", "none")  # a choice only fills display="auto"
    from nbddp.planning import make_plan

    assert make_plan(num_workers=2, device="cpu").display == "none"
    assert make_plan(num_workers=2, device="cpu", display="text").display == "text"


# -- the rules VS Code and Colab apply ----------------------------------------------------------


def follows_the_rules(messages: list[dict]) -> None:
    """Each display of the run has a display id in ``transient`` when it is ever updated; each
    update names an id a display made earlier (VS Code and Colab drop others: vscode-jupyter
    #1710, colabtools #2020); the panel's messages all carry HTML and text."""
    displayed: set[str] = set()
    for message in messages:
        content, kind = message["content"], message["msg_type"]
        display_id = content.get("transient", {}).get("display_id")
        if kind == "display_data" and display_id:
            displayed.add(display_id)
        elif kind == "update_display_data":
            assert display_id in displayed, f"an update to an id never displayed: {display_id}"
        if kind in ("display_data", "update_display_data") and str(display_id).startswith(
            "nbddp-panel"
        ):
            assert {"text/html", "text/plain"} <= set(content["data"]), content["data"].keys()
    updated = {
        m["content"]["transient"]["display_id"]
        for m in messages
        if m["msg_type"] == "update_display_data"
    }
    assert updated <= displayed


def test_a_blocking_run_follows_the_rules_and_needs_no_comm(notebook):
    messages: list[dict] = []
    out, reply = notebook.run(
        "def short():\n"
        "    for step in nbddp.progress(range(20)):\n"
        "        nbddp.log(loss=float(step))\n"
        "        print('step', step, flush=True)\n"
        "    from IPython.display import HTML, display\n"
        "    handle = display(HTML('<b>from a rank</b>'), display_id=True)\n"
        "    handle.update(HTML('<b>updated by a rank</b>'))\n"
        "nbddp.notebook_launch(short, num_workers=2, device='cpu')\n",
        messages=messages,
    )
    assert reply["status"] == "ok", out
    follows_the_rules(messages)
    assert not [m for m in messages if m["msg_type"].startswith("comm_")]
    panels = [m for m in messages if "nbddp-panel" in str(m["content"].get("transient"))]
    assert panels[0]["msg_type"] == "display_data" and len(panels) >= 2
    texts = [m["content"]["data"]["text/plain"] for m in panels]
    assert all(text.startswith("nbddp run ") for text in texts if text)  # each draw's text
    assert any("loss" in text and "rank 0 output:\nstep 0" in text for text in texts), texts


def test_a_ranks_pdb_asks_one_prompt_per_input_request(notebook):
    """VS Code asks each ``input_request`` in a box at the top of its window: each is one
    question, the prompt is not also printed in the cell, and the panel goes on meanwhile."""
    prompts: list[str] = []
    answers = iter(["p 6 * 7", "c"])

    def person(prompt: str) -> str:
        prompts.append(prompt)
        return next(answers)

    messages: list[dict] = []
    out, reply = notebook.run_answering(
        "def held():\n"
        "    if nbddp.rank() == 1:\n"
        "        breakpoint()\n"
        "    return nbddp.rank()\n"
        "nbddp.notebook_launch(held, num_workers=2, device='cpu')\n",
        person,
        messages=messages,
    )
    assert reply["status"] == "ok", out
    assert prompts == ["(Pdb rank 1) "] * 2
    streams = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert "42" in streams and "(Pdb rank 1)" not in streams
    follows_the_rules(messages)


def test_a_background_run_is_stopped_from_a_later_cell_with_no_comm_message(notebook):
    """Colab's outputs of a later cell never reach an earlier cell's widgets: the panel names
    ``nbddp.last_run().stop()``, which a later cell runs; this client sends no comm message."""
    notebook.run(
        "def slow():\n"
        "    for step in nbddp.progress(range(100_000), desc='slow'):\n"
        "        nbddp.log(loss=float(step))\n"
        "        time.sleep(0.02)\n"
        "    return 'stopped at a step'\n"
    )
    messages: list[dict] = []
    out, reply = notebook.run(
        "nbddp.notebook_launch(slow, num_workers=2, device='cpu', block=False)", messages=messages
    )
    assert reply["status"] == "ok", out
    deadline = time.monotonic() + 120
    while True:  # later cells run while it trains, as a person's would
        out, reply = notebook.run("print(len(nbddp.last_run().history), end='')")
        if int(out or 0) >= 3:
            break
        assert time.monotonic() < deadline, out
    out, reply = notebook.run(
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    nbddp.last_run().stop(graceful=True)\n"
        "    print(nbddp.last_run().status, repr(nbddp.last_run().result()))\n"
        "print(any('asked by run.stop(graceful=True)' in str(w.message) for w in caught))"
    )
    assert reply["status"] == "ok", out
    assert out.splitlines() == ["stopped 'stopped at a step'", "True"], out
    first = next(m for m in messages if m["msg_type"] == "display_data")["content"]["data"]
    assert "nbddp.last_run().stop()" in first["text/plain"]  # what the panel says to do
    assert "nbddp.last_run().stop()" in first["text/html"]

    notebook.run("run = nbddp.notebook_launch(slow, num_workers=2, device='cpu', block=False)")
    out, reply = notebook.run("run.stop()\nprint(run.status)")  # at once, the other way
    assert reply["status"] == "ok" and out.strip() == "stopped", out
