"""The documentation site builds with every warning an error (``mkdocs build --strict``: a
broken link, anchor or cross-reference, a page missing from the nav), and a person opening it
in a browser sees the getting-started page and the generated reference of ``notebook_launch``.

The browser test drives Debian's chromium (``apt-get install chromium``; ``.ci/run`` installs
it) through Playwright; without them it is skipped with the reason, never passed.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pages import ROOT

# chromium, and the site built once for these tests: one worker (tests/sharing.py)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("browser")]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _build(site: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built with ``--strict``: the one ``.ci/run`` built from this tree just before
    the tests (``NBDDP_DOCS_SITE`` names it; its build is one of CI's gates), or built here."""
    pytest.importorskip(
        "mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')"
    )
    if os.environ.get("NBDDP_DOCS_SITE"):
        return Path(os.environ["NBDDP_DOCS_SITE"])
    folder = tmp_path_factory.mktemp("site")
    built = _build(folder)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr[-6000:]}"
    return folder


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").exists()
    assert (site / "getting-started" / "index.html").exists()
    assert (site / "reference" / "launching" / "index.html").exists()
    notebook = (site / "notebooks" / "01_quickstart" / "index.html").read_text()
    assert "nbddp-summary" in notebook, "the quickstart notebook is shown without its outputs"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """--strict is what keeps the links honest: a page linking nowhere must fail it (built
    from a copy of the site's sources)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", symlinks=False)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "limitations.md"
    page.write_text(page.read_text() + "\n[nowhere](guides/no-such-page.md)\n")
    built = _build(tmp_path / "site", cwd=tmp_path)
    assert built.returncode != 0
    assert "no-such-page.md" in built.stderr


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on loopback, from a thread of this process."""
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def page(served: str) -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("browser test cannot run here: Debian's chromium is not installed")
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900})
        finally:
            browser.close()


@pytest.mark.slow
def test_the_getting_started_page_in_a_browser(page: Any, served: str, tmp_path: Path) -> None:
    page.goto(f"{served}/getting-started/")
    assert page.title().startswith("Getting started")
    article = page.locator("article")
    headings = article.locator("h2").all_inner_texts()
    for heading in (
        "Install",
        "Your first launch",
        "Your first %%ddp cell",
        "On a laptop, and on GPUs",
    ):
        assert any(h.startswith(heading) for h in headings), (heading, headings)
    code = article.locator("pre code").all_inner_texts()
    assert any("nbddp.notebook_launch(train, num_workers=2" in c for c in code)
    assert any(c.startswith("%%ddp -n 2 --device cpu") for c in code)
    nav = page.locator("nav.md-nav--primary").inner_text()
    for entry in ("Guides", "Reference", "How it works", "When it hangs"):
        assert entry in nav, f"{entry!r} is not in the navigation"
    link = article.get_by_role("link", name="Watch a run").first
    link.click()
    page.wait_for_url("**/guides/live-view/")
    assert page.locator("article h1").inner_text().startswith("Watch a run")
    page.screenshot(path=str(tmp_path / "getting-started.png"))


@pytest.mark.slow
def test_the_reference_of_notebook_launch_in_a_browser(page: Any, served: str) -> None:
    page.goto(f"{served}/reference/launching/#nbddp.notebook_launch")
    entry = page.locator("[id='nbddp.notebook_launch']")
    assert entry.is_visible()
    assert "nbddp.notebook_launch" in entry.inner_text()
    body = page.locator("article").inner_text()
    signature = page.locator(".doc-signature").first.inner_text()
    for option in ("num_workers", "device", "block", "cluster", "stall_after"):
        assert option in signature, f"{option} is not in the signature"
    assert "on every rank of a DDP job started from the notebook" in body  # its docstring
    assert "Rank 0's return value" in body  # its Returns section, one entry:
    assert "(a list of every rank's with return_all=True" in " ".join(body.split())
    parameters = page.locator("table").first.inner_text()
    for option in ("num_workers", "return_all", "timeout"):
        assert option in parameters, f"{option} has no row in the parameters table"
    assert ":class:" not in body and ":func:" not in body, "a Sphinx role leaked into the page"
    page.get_by_role("link", name="WorkerError").first.click()  # a cross-reference
    page.wait_for_url("**/reference/errors/#nbddp.WorkerError")
