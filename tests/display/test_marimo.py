"""marimo shows the live panel: a marimo notebook run headless by marimo itself (``marimo export
ipynb --include-outputs`` runs every cell in marimo's kernel and saves the outputs) with
``notebook_launch`` and ``Session.run`` in its cells. The saved outputs hold the panel's final
content (a summary written from marimo's own thread reached the cell), and the panel was redrawn
in the cell's output while the run went on.

Needs marimo (the ``dev`` extra); without it the test is skipped with the reason."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.display import resolve_mode
from nbddp.display.marimo_panel import in_marimo

pytestmark = pytest.mark.e2e

NOTEBOOK = """\
import marimo

app = marimo.App()


@app.cell
def _():
    import re
    import time

    import nbddp
    return nbddp, re, time


@app.cell
def _(nbddp, time):
    def train(steps=40):
        for step in nbddp.progress(range(steps), desc="batch"):
            time.sleep(0.05)
            nbddp.log(loss=1.0 / (1 + step) + nbddp.rank())
        print("Done!", flush=True)
        return "trained"
    return (train,)


@app.cell
def _(nbddp, train):
    result = nbddp.notebook_launch(train, num_workers=2, device="cpu")
    return (result,)


@app.cell
def _(nbddp, re, train):
    # what this cell's output holds while a run goes on (marimo sends it as it changes)
    from marimo._runtime.context import get_context

    output = get_context().execution_context.output
    run = nbddp.notebook_launch(train, num_workers=2, device="cpu", block=False)
    drawn = []
    while not run.wait(0.05):
        stacked = output.stack()
        drawn.append(stacked.text if stacked is not None else "")
    live = [text for text in drawn if "nbddp-panel" in text]
    print("live draws with progress:",
          len({v for text in live for v in re.findall(r'value="(\\d+)"', text)}))
    return


@app.cell
def _(nbddp, train):
    with nbddp.Session(num_workers=2, device="cpu") as session:
        in_session = session.run(train)
    return (in_session,)


if __name__ == "__main__":
    app.run()
"""


def test_outside_any_notebook_auto_is_text():
    assert not in_marimo() and resolve_mode("auto") == "text"


def test_marimo_shows_the_live_panel_and_its_summary(tmp_path: Path):
    marimo = shutil.which("marimo", path=os.path.dirname(sys.executable))
    if marimo is None:
        pytest.skip("marimo is not installed (pip install -e '.[dev]')")
    (tmp_path / "ddp.py").write_text(NOTEBOOK)
    done = subprocess.run(
        [marimo, "export", "ipynb", "ddp.py", "-o", "ddp.ipynb", "--include-outputs"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    cells = json.loads((tmp_path / "ddp.ipynb").read_text())["cells"]
    html = ["".join(o.get("data", {}).get("text/html", "")) for c in cells for o in c["outputs"]]
    text = "".join("".join(o.get("text", "")) for c in cells for o in c["outputs"])
    summaries = [h for h in html if "nbddp-summary" in h]
    assert len(summaries) == 3, html  # the blocking launch's, the background one's, the session's
    for summary in summaries:
        assert ">done<" in summary and "averaged over 2 ranks" in summary and "Done!" in summary
        assert 'value="40" max="40"' in summary and "nbddp-panel" not in summary
    assert not [h for h in html if "nbddp-panel" in h]  # every panel became its summary
    draws = re.search(r"live draws with progress: (\d+)", text)
    assert draws and int(draws.group(1)) >= 3, text  # redrawn as the bar moved
