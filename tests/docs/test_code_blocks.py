"""Every Python code block of the documentation site runs, so the guides cannot drift from
the code: the blocks of a page run in order in one fresh Jupyter kernel (``%%ddp`` cells and
``%load_ext`` as in a notebook), in a temporary directory. A block marked ``skip`` (or ``gpu``
where there is no CUDA) is reported as skipped with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from pages import DOCS, FENCE, MARKER, blocks, pages

# A page whose every block is marked skip has nothing to run anywhere: no test (its markers'
# reasons are checked below). One whose blocks that run all need CUDA is marked gpu, the one
# kind of test CI (no GPU) lets skip (tests/skips.py).
# A page whose blocks ask for the tutorials' fixed MASTER_PORT shares a worker with the other
# tests that do (tests/sharing.py).
TUTORIAL_PORT = "12355"


def _marks(page: Path) -> list[pytest.MarkDecorator]:
    found = blocks(page)
    marks = [pytest.mark.gpu] if all(b.marker in ("skip", "gpu") for b in found) else []
    if any(b.marker == "gpu" for b in found):
        marks.append(pytest.mark.gpu_blocks)  # benchmarks/gpu_check.py runs these on a GPU
    if TUTORIAL_PORT in page.read_text():
        marks.append(pytest.mark.xdist_group(f"port-{TUTORIAL_PORT}"))
    return marks


PAGES = [
    pytest.param(p, marks=_marks(p)) for p in pages() if any(b.marker != "skip" for b in blocks(p))
]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    PAGES,
    ids=[p.values[0].relative_to(DOCS).as_posix() for p in PAGES],
)
def test_the_code_blocks_of_a_page_run(
    page: Path, kernel_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    found = blocks(page)
    skipped = [b for b in found if b.marker == "skip" or (b.marker == "gpu" and not _cuda())]
    to_run = [b for b in found if b not in skipped]
    if not to_run:
        pytest.skip("; ".join(f"line {b.line}: {b.reason}" for b in skipped))
    kernel = kernel_factory()
    try:
        for block in to_run:
            # a page takes 25 s at most here: a block that hangs fails within e2e's 300 s,
            # naming itself
            output, reply = kernel.run(block.code, timeout=240)
            assert reply["status"] == "ok", (
                f"{block.page}, the block at line {block.line} failed:\n{block.code}\n"
                f"--- its output ---\n{output}"
            )
    finally:
        kernel.shutdown()
    for block in skipped:  # shown by pytest -rA; the run above passed without them
        print(f"{block.page}:{block.line} skipped: {block.reason}")


@pytest.mark.unit
def test_every_marker_names_its_reason_and_stands_above_a_python_block() -> None:
    for page in pages():
        lines = page.read_text().splitlines()
        fenced = False  # a marker shown inside a code block (as on the Development page)
        for number, line in enumerate(lines, start=1):
            if FENCE.match(line):
                fenced = not fenced
            if fenced or "docs-test:" not in line:
                continue
            where = f"{page.relative_to(DOCS)}:{number}"
            assert MARKER.match(line), f"{where}: write <!-- docs-test: skip|gpu REASON -->"
            following = lines[number].strip() if number < len(lines) else ""
            assert following.startswith("```python"), f"{where}: no ```python block below"


@pytest.mark.unit
def test_the_blocks_are_found() -> None:
    """The reading itself: a guide's blocks are seen, with their markers."""
    tutorial = blocks(DOCS / "guides" / "tutorial-code.md")
    assert len(tutorial) >= 3
    assert [b.marker for b in tutorial][:3] == ["gpu", None, "skip"]
    assert "nbddp.spawn(demo_basic" in tutorial[1].code
