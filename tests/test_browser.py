"""What a person sees: JupyterLab on loopback, a notebook opened in headless Chromium, a run of
~10 s executed, the live panel read from the page's DOM while it runs: a loop with
``nbddp.progress``/``nbddp.log``, and an unchanged Hugging Face ``Trainer``.

Needs Debian's chromium (``apt-get install chromium``; ``.ci/run`` installs it), Playwright and
JupyterLab (the ``dev`` extra). Without them the test is skipped with the reason, never passed.
Set ``NBDDP_SCREENSHOT=folder`` to keep the mid-run screenshots (the README's pictures).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from nbddp.environment import free_port

# JupyterLab and chromium: one browser at a time on the machine (tests/sharing.py)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("browser")]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CELL = """\
import time
import nbddp

def train(steps=100):
    for epoch in nbddp.progress(range(2), desc="epoch"):
        for step in nbddp.progress(range(steps // 2), desc="batch"):
            time.sleep(0.1)
            nbddp.log(loss=1.0 / (1 + epoch * steps + step) + nbddp.rank(), lr=0.01)
        print(f"epoch {epoch} done", flush=True)
    return "trained"

nbddp.notebook_launch(train, num_workers=2, device="cpu")
"""
HF_CELL = """\
import time
import nbddp
import torch
from transformers import (BertConfig, BertForSequenceClassification, Trainer,
                          TrainerCallback, TrainingArguments)

class Reviews(torch.utils.data.Dataset):  # tokenised text, made up here: no downloads
    def __len__(self):
        return 1600

    def __getitem__(self, i):
        ids = torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(32, dtype=torch.long),
                "labels": int(ids[:4].sum() % 2)}

class Slowly(TrainerCallback):  # so that a person (and the test) can watch it
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.05)

def train():
    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128)
    args = TrainingArguments(output_dir="hf-out", per_device_train_batch_size=16,
                             num_train_epochs=2, logging_steps=5, learning_rate=5e-4,
                             report_to="none", save_strategy="no", use_cpu=True)
    trainer = Trainer(model=BertForSequenceClassification(config), args=args,
                      train_dataset=Reviews(), callbacks=[Slowly()])
    return trainer.train().training_loss

nbddp.notebook_launch(train, num_workers=2, device="cpu")
"""


def _missing() -> str | None:
    if CHROMIUM is None:
        return "Debian's chromium is not installed (apt-get install chromium)"
    for module in ("playwright", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[dev]')"
    return None


def _notebook(cell: str) -> str:
    return json.dumps(
        {
            "cells": [
                {
                    "cell_type": "code",
                    "metadata": {},
                    "source": cell,
                    "outputs": [],
                    "execution_count": None,
                }
            ],
            "metadata": {
                "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
            },
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )


RICH_CELL = """\
import time
import nbddp
from IPython.display import HTML

def train(steps=60):
    import matplotlib.pyplot as plt
    display(HTML("<b class='from-rank'>hello from rank %d</b>" % nbddp.rank()))
    for step in nbddp.progress(range(steps), desc="batch"):
        time.sleep(0.1)
        nbddp.log(loss=1.0 / (1 + step))
    plt.plot([1 / (1 + s) for s in range(steps)])
    plt.title("loss")
    plt.show()
    return "trained"

nbddp.notebook_launch(train, num_workers=2, device="cpu")
"""


STALL_CELL = """\
import time
import nbddp
import torch.distributed as dist

def train():
    t = torch.ones(3)
    if nbddp.rank() != 1:
        dist.all_reduce(t)
    dist.barrier()

import torch
nbddp.notebook_launch(train, num_workers=3, device="cpu", stall_after=3, timeout=20)
"""


@pytest.fixture(params=["with widgets"])
def jupyterlab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    yield from _jupyterlab(tmp_path, widgets=request.param == "with widgets")


@pytest.fixture
def jupyterlab_without_widgets(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """JupyterLab whose widgets extension is off: what a frontend without a widget manager
    (Kaggle's "Loading widget...", VS Code without its renderer) amounts to."""
    yield from _jupyterlab(tmp_path, widgets=False)


def _jupyterlab(tmp_path: Path, widgets: bool) -> Iterator[tuple[str, Path]]:
    port, token = free_port(), secrets.token_hex(16)
    (tmp_path / "live.ipynb").write_text(_notebook(CELL))
    (tmp_path / "hf.ipynb").write_text(_notebook(HF_CELL))
    (tmp_path / "rich.ipynb").write_text(_notebook(RICH_CELL))
    (tmp_path / "stall.ipynb").write_text(_notebook(STALL_CELL))
    if not widgets:
        labconfig = tmp_path / "config" / "labconfig"
        labconfig.mkdir(parents=True)
        (labconfig / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {"@jupyter-widgets/jupyterlab-manager": True}})
        )
    settings = tmp_path / "lab-settings"  # no "get Jupyter news?" prompt over the panel
    notification = settings / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    log = open(tmp_path / "jupyterlab.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={tmp_path}",
            "--LabApp.news_url=",
            "--ServerApp.port_retries=0",
            # Kernels on Unix sockets: no port picked free and taken before the kernel binds it.
            "--KernelManager.transport=ipc",
            f"--KernelManager.ip={tmp_path / 'kernel'}",
            "--allow-root",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env={
            **os.environ,
            "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
            "JUPYTERLAB_SETTINGS_DIR": str(settings),
        },
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        "JupyterLab did not start:\n"
                        + (tmp_path / "jupyterlab.log").read_text()[-3000:]
                    )
                time.sleep(0.3)
        yield f"{base}/lab/tree/{{notebook}}?token={token}", tmp_path
    finally:
        server.terminate()  # shuts its kernels down too
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _open_and_run(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_selector("#jp-main-statusbar >> text=Idle", timeout=90_000)
    page.click(".jp-Cell .cm-content")
    page.keyboard.press("Shift+Enter")


def _progress_rises(page, seconds: float) -> None:
    """The panel's bars, read live: their total takes at least three values, never falling."""
    page.wait_for_selector(".nbddp-panel .nbddp-bar progress", timeout=90_000)
    seen: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(set(seen)) < 3:
        values = page.eval_on_selector_all(
            ".nbddp-panel .nbddp-bar progress", "bars => bars.map(b => b.value)"
        )
        seen.append(sum(int(v) for v in values))
        time.sleep(0.5)
    assert len(set(seen)) >= 3 and seen == sorted(seen), f"progress did not rise: {seen}"


@contextmanager
def _running(jupyterlab: tuple[str, Path], notebook: str) -> Iterator[Any]:
    """A headless Chromium page with ``notebook`` open in JupyterLab and its cell running;
    skips with the reason where the browser test cannot run."""
    reason = _missing()
    if reason:
        pytest.skip(f"browser test cannot run here: {reason}")
    from playwright.sync_api import sync_playwright

    url, _ = jupyterlab
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            _open_and_run(page, url.format(notebook=notebook))
            yield page
        finally:
            browser.close()


def _screenshot(page: Any, folder: Path, name: str) -> None:
    """The cell's output as a picture (kept for the README with ``NBDDP_SCREENSHOT``)."""
    shot = folder / name
    page.locator(".jp-Cell-outputArea").first.screenshot(path=str(shot))
    if os.environ.get("NBDDP_SCREENSHOT"):
        shutil.copy(shot, Path(os.environ["NBDDP_SCREENSHOT"]) / name)


@pytest.mark.slow
def test_the_panel_and_rich_output_without_the_widgets_extension(
    jupyterlab_without_widgets: tuple[str, Path],
) -> None:
    """No widget manager: the panel still updates live (an HTML output updated in place), and
    the ranks' HTML and matplotlib figure render in the cell."""
    with _running(jupyterlab_without_widgets, "rich.ipynb") as page:
        _progress_rises(page, 40)
        assert "averaged over 2 ranks" in page.inner_text(".nbddp-panel")
        assert page.locator("text=Loading widget").count() == 0
        assert page.inner_text(".jp-OutputArea-output b.from-rank") == "hello from rank 0"
        _screenshot(page, jupyterlab_without_widgets[1], "live-panel-no-widgets.png")

        page.wait_for_selector(".nbddp-summary", timeout=60_000)
        figure = page.wait_for_selector(".jp-OutputArea-output img", timeout=30_000)
        assert figure.evaluate("img => img.naturalWidth") > 100  # a decoded PNG
        _screenshot(page, jupyterlab_without_widgets[1], "rich-output.png")


@pytest.mark.slow
def test_live_panel_in_jupyterlab(jupyterlab: tuple[str, Path]) -> None:
    with _running(jupyterlab, "live.ipynb") as page:
        _progress_rises(page, 40)

        page.wait_for_selector(".nbddp-panel .nbddp-metrics", timeout=30_000)
        table = page.inner_text(".nbddp-panel .nbddp-metrics")
        assert "loss" in table and "lr" in table
        assert "averaged over 2 ranks" in page.inner_text(".nbddp-panel")
        _screenshot(page, jupyterlab[1], "live-widget.png")

        page.wait_for_selector(".nbddp-summary", timeout=60_000)  # the static summary
        summary = page.inner_text(".nbddp-summary")
        assert "done" in summary and "epoch 1 done" in summary
        _shown_once(page, "epoch 1 done")


def _shown_once(page: Any, line: str) -> None:
    """The ended run shows its summary once: the panel's output, updated in place; the output
    a text-only frontend reads at the end (``panel.py``) draws nothing here."""
    assert page.locator(".nbddp-summary").count() == 1
    assert page.locator(".nbddp-panel").count() == 0
    assert page.inner_text(".jp-Cell-outputArea").count(line) == 1
    heights = page.eval_on_selector_all(
        ".jp-Cell-outputArea .jp-OutputArea-child",
        "children => children.filter(c => !c.innerText.trim())"
        ".map(c => c.getBoundingClientRect().height)",
    )
    assert heights and all(height < 1 for height in heights), heights  # drawn as nothing


@pytest.mark.slow
def test_an_hf_trainer_shows_its_bar_and_metrics_in_the_panel(jupyterlab: tuple[str, Path]):
    with _running(jupyterlab, "hf.ipynb") as page:
        _progress_rises(page, 60)  # the Trainer's own tqdm bar, as a panel bar
        page.wait_for_selector(".nbddp-panel .nbddp-metrics", timeout=60_000)
        page.wait_for_selector(".nbddp-panel .nbddp-chart", timeout=60_000)
        table = page.inner_text(".nbddp-panel .nbddp-metrics")
        assert "loss" in table and "learning_rate" in table and "grad_norm" in table
        _screenshot(page, jupyterlab[1], "hf-trainer.png")
        page.wait_for_selector(".nbddp-summary", timeout=120_000)
        assert "done" in page.inner_text(".nbddp-summary")


@pytest.mark.slow
def test_the_stall_banner_in_jupyterlab(jupyterlab: tuple[str, Path]) -> None:
    """A rank that skips an all_reduce: the panel shows the roll-call by itself."""
    with _running(jupyterlab, "stall.ipynb") as page:
        page.wait_for_selector(".nbddp-panel .nbddp-stall", timeout=90_000)
        banner = page.inner_text(".nbddp-panel .nbddp-stall")
        assert "rank 1 is the odd one out" in banner, banner
        assert "ranks 0, 2 wait in all_reduce" in banner and "Cell In[1], line 8" in banner
        _screenshot(page, jupyterlab[1], "stall-banner.png")
        page.wait_for_selector(".nbddp-summary .nbddp-stall", timeout=90_000)


PDB_CELL = """\
import nbddp

def train():
    loss = 0.25 * (nbddp.rank() + 1)
    if nbddp.rank() == 1:
        breakpoint()
    return loss

nbddp.notebook_launch(train, num_workers=2, device="cpu")
"""


# The input box that waits for a line. An answered box stays in the DOM for 0.5 s after Enter,
# transparent, where the next prompt's box is drawn (JupyterLab 4's "stdin-hiding"), so a bare
# ".jp-Stdin-input" first matches the answered one: what was typed there went nowhere (#33).
WAITING_BOX = ".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding) .jp-Stdin-input"


def _type_in_the_input_box(page: Any, line: str) -> str:
    """Types ``line`` and Enter as a person does: on the keyboard, into the box that waits,
    which JupyterLab has focused; returns the box's prompt."""
    box = page.wait_for_selector(WAITING_BOX, timeout=90_000)
    page.wait_for_function("box => box === document.activeElement", arg=box, timeout=10_000)
    prompt = str(box.evaluate("box => box.closest('.jp-Stdin-prompt').textContent"))
    page.keyboard.type(line)
    page.keyboard.press("Enter")
    return prompt


@pytest.mark.slow
@pytest.mark.timeout(300)  # a fresh kernel's first launch (cold helper) on a loaded machine
def test_a_ranks_pdb_prompt_is_the_notebooks_input_box(jupyterlab: tuple[str, Path]) -> None:
    """breakpoint() on rank 1: JupyterLab's own input box asks ``(Pdb rank 1)``; what is typed
    there runs in rank 1's pdb, and ``c`` lets the run finish."""
    (jupyterlab[1] / "pdb.ipynb").write_text(_notebook(PDB_CELL))
    with _running(jupyterlab, "pdb.ipynb") as page:
        page.wait_for_selector(WAITING_BOX, timeout=90_000)
        # the panel says it at its next redraw (a few per second), not with the prompt
        page.wait_for_selector(".nbddp-panel >> text=rank 1 in pdb", timeout=30_000)
        assert "(Pdb rank 1)" in _type_in_the_input_box(page, "p loss")
        page.wait_for_selector(".jp-OutputArea-output >> text=0.5", timeout=30_000)
        page.wait_for_selector(WAITING_BOX, timeout=30_000)  # the next prompt
        page.locator(".jp-OutputArea-output").first.hover()  # no cursor in the picture
        _screenshot(page, jupyterlab[1], "pdb-prompt.png")
        assert "(Pdb rank 1)" in _type_in_the_input_box(page, "c")
        page.wait_for_selector(".nbddp-summary", timeout=60_000)
        assert "done" in page.inner_text(".nbddp-summary")
        page.wait_for_selector(".jp-Stdin-input", state="detached", timeout=10_000)
