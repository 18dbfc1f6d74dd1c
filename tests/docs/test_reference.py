"""The reference lists what the contract lists: a ``::: nbddp.NAME`` entry (rendered from the
docstring by mkdocstrings) for every public name of ``docs/API.md`` that is built, and the
magics page every option the magics accept."""

from __future__ import annotations

import inspect
import re

import pytest
from pages import DOCS
from test_architecture import API_MD, EXTRA, PENDING, contract_names

import nbddp

pytestmark = pytest.mark.unit

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


MEMBERS = re.compile(
    r"^::: nbddp\.(\w+)\n    options:\n      members:\n((?:        - \w+\n)+)", re.M
)


def _listed_members() -> dict[str, set[str]]:
    pages = "".join(page.read_text() for page in sorted(REFERENCE.glob("*.md")))
    return {name: set(re.findall(r"- (\w+)", block)) for name, block in MEMBERS.findall(pages)}


def test_the_reference_shows_every_member_the_contract_names() -> None:
    """``run.X`` and ``session.X`` in the contract: each built one is in the reference's
    member list of ``Run`` / ``Session`` (a member list leaves out the others)."""
    contract = API_MD.read_text()
    listed = _listed_members()
    for variable, cls in (("run", "Run"), ("session", "Session")):
        named = set(re.findall(rf"\b{variable}\.([a-z_]\w*)", contract))
        source = inspect.getsource(getattr(nbddp, cls))  # instance attributes too
        built = {m for m in named if hasattr(getattr(nbddp, cls), m) or f"self.{m} =" in source}
        assert {"status", "close"} & named, "the reading works"
        missing = sorted(built - listed[cls])
        assert not missing, f"add {missing} to the members of nbddp.{cls} in docs/reference/"
