"""The documentation site's pages and the Python code blocks in them, as the docs tests read
them: a fenced ```` ```python ```` block (at any indentation), and the marker just above a
block that cannot run everywhere: ``<!-- docs-test: skip REASON -->`` (never run here), or
``<!-- docs-test: gpu REASON -->`` (run where CUDA is, skipped with the reason elsewhere)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Not the site's own prose: the contract (signatures, not runnable code) and the benchmark
# results (a link to benchmarks/RESULTS.md).
NOT_RUN = {"API.md", "results.md"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\n]*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>skip|gpu)\s+(?P<reason>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    line: int  # of the opening fence, 1-based
    code: str
    marker: str | None  # "skip" or "gpu", or None: runs everywhere
    reason: str | None  # why it is marked


def pages() -> list[Path]:
    """Every Markdown page of the site (symlinked folders such as notebooks/ hold none)."""
    return sorted(
        p
        for p in DOCS.rglob("*.md")
        if not p.is_symlink() and p.relative_to(DOCS).as_posix() not in NOT_RUN
    )


def blocks(path: Path) -> list[Block]:
    """The page's ``python`` blocks, in order, with the skip marker of each."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = opening["info"].strip().split(" ")[0].lower()
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence) and lines[end].strip().strip(fence[0]) == ""
        ):
            end += 1
        if language in ("python", "py"):
            body = [
                line[len(indent) :] if line.startswith(indent) else line
                for line in lines[i + 1 : end]
            ]
            marker = MARKER.match(lines[i - 1]) if i > 0 else None
            found.append(
                Block(
                    page=path.relative_to(DOCS).as_posix(),
                    line=i + 1,
                    code="\n".join(body) + "\n",
                    marker=marker["kind"] if marker else None,
                    reason=marker["reason"] if marker else None,
                )
            )
        i = end + 1
    return found
