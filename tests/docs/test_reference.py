"""The reference lists what the contract lists: a ``::: nbddp.NAME`` entry (rendered from the
docstring by mkdocstrings) for every public name of ``docs/API.md`` that is built, and the
magics page every option the magics accept."""

from __future__ import annotations

import re

from pages import DOCS
from test_architecture import EXTRA, PENDING, contract_names

import nbddp

REFERENCE = DOCS / "reference"
ENTRY = re.compile(r"^::: nbddp\.(\w+)\s*$", re.MULTILINE)


def reference_names() -> list[str]:
    return [n for page in sorted(REFERENCE.glob("*.md")) for n in ENTRY.findall(page.read_text())]


def test_the_reference_and_the_contract_list_the_same_names() -> None:
    listed = reference_names()
    assert len(listed) == len(set(listed)), "a name has two entries in the reference"
    contract = (contract_names() - PENDING) | EXTRA
    missing = sorted(contract - set(listed))
    assert not missing, (
        f"add `::: nbddp.NAME` for {missing} to a page of docs/reference/ (the one of its "
        "topic; a new topic is a new page in mkdocs.yml's nav)"
    )
    extra = sorted(set(listed) - contract)
    assert not extra, f"the reference lists names the contract does not: {extra}"
    assert set(listed) == set(nbddp.__all__)


def test_every_public_name_has_a_docstring() -> None:
    bare = [n for n in nbddp.__all__ if not (getattr(nbddp, n).__doc__ or "").strip()]
    assert not bare, f"give these a docstring (the reference shows it): {bare}"


def _option_strings(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s != "-h"}


def test_the_magics_page_names_every_option() -> None:
    from nbddp.notebook.magic import DDPMagics
    from nbddp.notebook.session_magic import _start_parser

    page = (REFERENCE / "magics.md").read_text()
    ddp = _option_strings(DDPMagics.ddp.parser) - {"--help"}
    session = _option_strings(_start_parser())
    assert ddp >= {"--num-workers", "--device", "--out"}  # the reading works
    missing = sorted(o for o in ddp | session if f"`{o}" not in page and f" {o}" not in page)
    assert not missing, f"docs/reference/magics.md does not say what {missing} do"
    for command in ("start", "stop", "restart", "status", "pull"):
        assert f"`{command}" in page, f"%ddp_session {command} is not on the magics page"
