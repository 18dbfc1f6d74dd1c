"""Every test in exactly one tier, and each tier's promise kept (docs/development.md, "Tiers").

* ``unit``: starts no process. Checked while it runs: a ``subprocess``, ``os.fork``,
  ``os.posix_spawn``, ``os.system`` or ``multiprocessing`` start from the test (its fixtures
  included) is refused, and the test fails saying so.
* ``ranks``: real ranks (launches, sessions, the warm helper, detached runs), but no Jupyter
  kernel, browser, docs site or cluster.
* ``e2e``: a Jupyter kernel, nbclient, the browser, the docs site, Ray, Slurm or torchrun.

A test with no tier or with two fails the collection of its file, with what to add; so does
one that asks for a kernel or a Slurm fixture without being ``e2e``. Each tier has its own
per-test timeout (:data:`TIMEOUT`), unless the test names its own with ``timeout``.

Three marks keep tests out of a plain run: ``quarantine`` (known flaky: ``.ci/run`` runs them in
a step of their own that does not fail CI, ``.ci/quarantine.py``), ``catalyst21`` (needs a venv
of its own) and ``gpu_rehearsal`` (``benchmarks/gpu_check.py --cpu-rehearsal``: 70-90 s of a
benchmark's harness, a tenth of the suite's time; ``.ci/run`` runs it in a step
of its own, which fails CI like the suite). Such a test runs only when the ``-m`` expression
names its mark.

Non-goal: deciding tiers by itself. The mark is the author's statement; this module checks it.
"""

from __future__ import annotations

import _posixsubprocess
import os
import re
import subprocess
import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import pytest

TIERS = ("unit", "ranks", "e2e")
# Seconds a test of each tier may take, setup and teardown included, on a machine twice as
# slow as a developer's; a test that needs longer says so with its own timeout mark.
TIMEOUT = {"unit": 30, "ranks": 120, "e2e": 300}
# Fixtures that start a Jupyter kernel or a Slurm, and marks of clusters: such a test is e2e.
E2E_FIXTURES = {"kernel", "kernel_factory", "slurm"}
E2E_MARKS = {"ray", "slurm", "netns"}
# What an e2e test starts, in a started program's command line: seen in a ranks test, it
# fails (the test is e2e). nbddp's ranks, helpers and supervisors match none of these.
E2E_PROGRAMS = re.compile(
    r"ipykernel|jupyter|chrom(e|ium)|playwright|torchrun|torch\.distributed\.run|mkdocs"
    r"|\bray\b|/ray/|sbatch|srun|salloc|scancel|slurm|munge|\bip netns\b"
)
# Marks that keep a test out of every run whose -m expression does not name them.
OPT_IN = {
    "quarantine": "quarantined (.ci/run runs them in a step of their own: .ci/quarantine.py)",
    "catalyst21": "need Catalyst 21.x (.ci/run runs them in a venv of their own)",
    "gpu_rehearsal": "the GPU check's CPU rehearsal (.ci/run runs it in a step of its own)",
}
QUARANTINE_LIMIT = 5  # more quarantined tests than this fail CI (.ci/quarantine.py)
QUARANTINE_LANDINGS = 2  # a quarantined test may stay for this many landings, its first included
LANDING_FILE = Path(__file__).resolve().parent.parent / ".ci" / "LANDING"

HOW = """Mark it with exactly one tier:
  @pytest.mark.unit    starts no process (checked while it runs)
  @pytest.mark.ranks   starts real ranks, but no Jupyter kernel, browser, docs site or cluster
  @pytest.mark.e2e     a Jupyter kernel, nbclient, the browser, the docs site, Ray, Slurm, torchrun
A file whose tests are all of one tier says it once at its top: pytestmark = pytest.mark.<tier>
(docs/development.md, "Tiers")."""


def landing() -> int:
    """The number of the landing this tree is for (``.ci/LANDING``; each submission adds 1)."""
    return int(LANDING_FILE.read_text().split()[0])


def tier_of(item: pytest.Item) -> str:
    [tier] = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
    return tier


def problems(item: pytest.Item) -> list[str]:
    """What is wrong with a test's marks, in words (none: it is fine)."""
    tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
    test = item.nodeid.split("[")[0]  # a parametrized test once, not each of its cases
    found = []
    if not tiers:
        found.append(f"{test} has no tier.")
    elif len(tiers) > 1:
        found.append(f"{test} has {len(tiers)} tiers ({', '.join(tiers)}): keep one.")
    fixtures = sorted(E2E_FIXTURES & set(getattr(item, "fixturenames", ())))
    marks = sorted(m for m in E2E_MARKS if item.get_closest_marker(m) is not None)
    if tiers and tiers != ["e2e"] and (fixtures or marks):
        used = ", ".join([*fixtures, *(f"the mark {m}" for m in marks)])
        found.append(f"{test} uses {used} (a Jupyter kernel or a cluster): its tier is e2e.")
    quarantine = item.get_closest_marker("quarantine")
    if quarantine is not None:
        found += _quarantine_problems(item.nodeid, quarantine)
    return found


def _quarantine_problems(nodeid: str, mark: pytest.Mark) -> list[str]:
    missing = [k for k in ("reason", "known", "since") if not mark.kwargs.get(k)]
    if missing:
        return [
            f"{nodeid} is quarantined without {', '.join(missing)}: "
            "@pytest.mark.quarantine(reason=..., known=..., since=<.ci/LANDING's number>)"
        ]
    since, now = mark.kwargs["since"], landing()
    if not isinstance(since, int) or since > now:
        return [f"{nodeid}: quarantine since={since!r} must be a landing number <= {now}"]
    if now - since >= QUARANTINE_LANDINGS:
        return [
            f"{nodeid} has been quarantined since landing {since} (this is {now}): past "
            f"{QUARANTINE_LANDINGS} landings it must be fixed (or deleted, saying why)"
        ]
    return []


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A file (or class) whose tests break the tier rule fails to collect, with the fix."""
    report = yield
    if not report.passed:
        return report
    found = [p for node in report.result if isinstance(node, pytest.Item) for p in problems(node)]
    found = list(dict.fromkeys(found))  # each once
    if found:
        report.outcome = "failed"
        report.longrepr = "\n".join([*found, "", HOW])
    return report


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each tier's timeout; the opt-in marks out of runs that do not name them."""
    expression = config.getoption("markexpr", "") or ""
    kept, left_out = [], []
    for item in items:
        if any(
            item.get_closest_marker(mark) is not None and not re.search(rf"\b{mark}\b", expression)
            for mark in OPT_IN
        ):
            left_out.append(item)
            continue
        kept.append(item)
        tiers = [mark.name for mark in item.iter_markers() if mark.name in TIERS]
        if tiers and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT[tiers[0]]))
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


# -- unit: no process -------------------------------------------------------------------------

_seen = pytest.StashKey[list[str]]()


class ProcessRefused(RuntimeError):
    """A unit test tried to start a process."""


def _command(name: str, args: tuple[Any, ...]) -> str:
    """The command line a process start was asked for, as far as it says."""
    if name == "fork_exec" and args and isinstance(args[0], (list, tuple)):
        return " ".join(os.fsdecode(a) for a in args[0])
    if name.startswith("os.posix_spawn") and len(args) > 1:
        return " ".join(os.fsdecode(a) for a in args[1])
    if name == "os.system" and args:
        return os.fsdecode(args[0])
    if name.startswith("the warm helper") and len(args) > 1:
        return " ".join(args[1])
    return name


def _patches(seen: list[str], own: Callable[[], bool], refuse: bool) -> list[tuple[Any, str, Any]]:
    """(module, name, replacement) for every way Python starts a process: subprocess and
    multiprocessing's spawn go through ``fork_exec``; fork, forkpty (pty), posix_spawn and
    system are the rest; and nbddp's warm helper, which forks ranks for this process.
    ``refuse``: a unit test's, refused; else a ranks test's, whose e2e programs are noted.
    Calls from threads the test did not start are let through (a background thread of an
    earlier test is not this test's doing)."""

    def watched(real: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if own():
                command = _command(name, args)
                if refuse:
                    seen.append(command[:200])
                    raise ProcessRefused(
                        f"a unit test started {command[:200]!r}: unit tests start no process."
                        " Mark the test ranks or e2e (docs/development.md, 'Tiers')."
                    )
                if E2E_PROGRAMS.search(command):
                    seen.append(command[:200])
            return real(*args, **kwargs)

        return call

    found = [
        (subprocess, "_fork_exec", watched(subprocess._fork_exec, "fork_exec")),  # type: ignore[attr-defined]
        (_posixsubprocess, "fork_exec", watched(_posixsubprocess.fork_exec, "fork_exec")),
    ]
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            found.append((os, name, watched(getattr(os, name), f"os.{name}")))
    # a rank (or a detached run's supervisor) the warm helper, already up, forks on request
    from nbddp.local.helper import Helper

    for name in ("spawn", "spawn_detached"):
        found.append((Helper, name, watched(getattr(Helper, name), f"the warm helper's {name}")))
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterable[None]:
    """A unit test's process starts are refused, a ranks test's e2e programs noted, from its
    first fixture's setup to its last one's teardown."""
    tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
    if tiers not in ({"unit"}, {"ranks"}):
        return (yield)
    before = set(threading.enumerate())
    seen: list[str] = []
    item.stash[_seen] = seen
    patches = _patches(
        seen, lambda: threading.current_thread() not in before or _is_main(), "unit" in tiers
    )
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, replacement in patches:
        setattr(module, name, replacement)
    try:
        return (yield)
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def _is_main() -> bool:
    return threading.current_thread() is threading.main_thread()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A unit test that started a process fails even where the code under test caught the
    refusal, and a ranks test that started a kernel, browser or cluster fails: at its
    teardown, unless it already failed."""
    report = yield
    seen = item.stash.get(_seen, None)
    if call.when == "teardown" and seen and not getattr(item, "_tier_failed", False):
        report.outcome = "failed"
        if item.get_closest_marker("unit") is not None:
            report.longrepr = (
                f"a unit test started {seen}: unit tests start no process. "
                "Mark it ranks or e2e (docs/development.md, 'Tiers')."
            )
        else:
            report.longrepr = (
                f"a ranks test started {seen}: a Jupyter kernel, browser, docs site, "
                "cluster or torchrun is e2e's. Mark it e2e (docs/development.md, 'Tiers')."
            )
    elif report.failed:
        item._tier_failed = True  # type: ignore[attr-defined]
    return report


# -- what each tier cost ---------------------------------------------------------------------


class _Clock:
    """Each tier's tests and seconds, counted where the reports meet (under xdist, in the
    controller); one per session (a pytester run inside a test has its own)."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.tests: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = next((tier for tier in TIERS if tier in report.keywords), None)
        if tier is None:
            return
        self.seconds[tier] += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.tests[tier] += 1

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.tests:
            return
        terminalreporter.section("time per tier")
        for tier in TIERS:
            if self.tests[tier]:
                terminalreporter.write_line(
                    f"{tier:<6} {self.tests[tier]:>4} tests  {self.seconds[tier]:>7.0f} s of test "
                    f"time (setup, call and teardown, summed over the workers; timeout "
                    f"{TIMEOUT[tier]} s)"
                )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Clock())
