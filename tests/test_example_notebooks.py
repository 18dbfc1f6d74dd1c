"""Every notebook in notebooks/ runs end to end in a real kernel, as CI proves."""

from pathlib import Path

import nbformat
import pytest
from conftest import run_notebook

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    run_notebook(notebook, timeout=600, path=path.parent)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    summaries = [
        o
        for o in outputs
        if "text/html" in o.get("data", {}) and "nbddp-summary" in o["data"]["text/html"]
    ]
    assert summaries, "no nbddp run summary in the outputs"


@pytest.mark.unit
def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 1
