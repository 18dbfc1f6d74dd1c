"""What skipped and why, and CI's rule that only GPU tests may skip.

Every run ends its summary with one line per skip reason. Under ``.ci/run`` (``NBDDP_CI=1``: a
fresh Debian machine, root, no GPU, where everything a test needs is installed) a skip of any
test not marked ``gpu`` is a failure: a missing browser, Slurm, ``ip`` or package must fail CI
instead of passing it with a whole area unrun. ``NBDDP_SKIP_SUMMARY`` names a file the summary
is also written to, which ``.ci/run`` prints last."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Generator

import pytest

ON_CI = os.environ.get("NBDDP_CI") == "1"
ALLOWED = "gpu: may skip"
REFUSED = "failed: only gpu tests may skip on CI" if ON_CI else "not gpu: would fail on CI"
_skips: Counter[tuple[str, str]] = Counter()  # (ALLOWED or REFUSED, reason) -> tests
REFUSED_SKIP = "nbddp: a skip refused on CI"  # a report property: its reason


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if not report.skipped or hasattr(report, "wasxfail"):
        return report
    if ON_CI and item.get_closest_marker("gpu") is None:
        reason = _reason(report)
        report.outcome = "failed"
        report.longrepr = f"skipped on CI, where only gpu-marked tests may skip: {reason}"
        report.user_properties.append((REFUSED_SKIP, reason))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Counted where the reports meet: under xdist, in the process that prints the summary
    (each worker makes its reports, above, and sends them there)."""
    refused = [value for name, value in report.user_properties if name == REFUSED_SKIP]
    if refused:
        _skips[REFUSED, refused[0]] += 1
    elif report.skipped and not hasattr(report, "wasxfail"):
        _skips[ALLOWED if "gpu" in report.keywords else REFUSED, _reason(report)] += 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A whole module skipped (``importorskip`` of a package the dev extra installs). It
    cannot be turned into a failed test (a failed collection would stop the run), so on CI it
    fails the session at its end instead (``pytest_sessionfinish``)."""
    if report.skipped:
        _skips[REFUSED, f"{report.nodeid}: {_reason(report)}"] += 1


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if ON_CI and any(kind == REFUSED for kind, _ in _skips) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def summary_lines() -> list[str]:
    if not _skips:
        return ["skipped: none"]
    return [
        f"skipped {count} ({kind}): {reason}"
        for (kind, reason), count in sorted(_skips.items(), key=lambda kv: (kv[0][0], -kv[1]))
    ]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.section("skips by reason")
    for line in summary_lines():
        terminalreporter.write_line(line)
    path = os.environ.get("NBDDP_SKIP_SUMMARY")
    if path:
        with open(path, "w") as out:
            out.write("".join(line + "\n" for line in summary_lines()))
