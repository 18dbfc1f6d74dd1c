"""The test machinery's own rules, in this process (``pytester``'s in-process runs): a test
without a tier or with two fails its file's collection with what to add, a unit test that
starts a process fails, quarantined and Catalyst 21 tests run only where named, a quarantine
says why and ages out; and CI's scripts: the README's test command is the one ``.ci/run``
runs, the search for a culprit release stops at the run's deadline, and pip is tried once more
only when the package index failed it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import ModuleType

import pytest
import sharing
import tiers
import tomllib
from conftest import kernel_config, wait_until

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
INI = """
[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    unit: a tier
    ranks: a tier
    e2e: a tier
    alone: alone
    quarantine: quarantined
    catalyst21: catalyst 21
    xdist_group: a group
"""


def run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    """A scratch test file run by pytest in this process, with the tier and sharing plugins,
    outside this run's locks (an xdist worker's: the inner tests would wait for themselves)."""
    pytester.makefile(".ini", pytest=INI)
    pytester.makepyfile(test_scratch=textwrap.dedent(source))
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
        return pytester.runpytest_inprocess(*args, plugins=[tiers, sharing])


def test_a_test_without_a_tier_or_with_two_fails_its_files_collection_saying_what_to_add(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
        import pytest

        def test_none():
            pass

        @pytest.mark.unit
        @pytest.mark.e2e
        def test_two():
            pass

        @pytest.mark.ranks
        def test_kernel(kernel):
            pass

        @pytest.fixture
        def kernel():
            return None
        """,
    )
    assert result.ret == pytest.ExitCode.INTERRUPTED  # nothing ran
    text = result.stdout.str()
    assert "test_scratch.py::test_none has no tier." in text
    assert "test_scratch.py::test_two has 2 tiers (e2e, unit): keep one." in text
    assert "test_scratch.py::test_kernel uses kernel" in text and "its tier is e2e" in text
    assert "@pytest.mark.unit    starts no process" in text
    assert "pytestmark = pytest.mark.<tier>" in text


def test_a_unit_test_that_starts_a_process_fails_and_the_process_never_starts(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    result = run(
        pytester,
        f"""
        import contextlib, os, subprocess
        import pytest

        pytestmark = pytest.mark.unit

        def test_starts():
            subprocess.run(["touch", {str(marker)!r}])

        def test_hides_it():
            with contextlib.suppress(Exception):
                os.system("touch {marker}")

        def test_starts_nothing():
            assert True
        """,
    )
    result.assert_outcomes(passed=2, failed=1, errors=1)  # test_hides_it fails at teardown
    text = result.stdout.str()
    assert "a unit test started 'touch" in text and "Mark the test ranks or e2e" in text
    assert "a unit test started ['touch" in text  # the hidden one, at its teardown
    assert not marker.exists()


def test_quarantined_and_catalyst21_tests_run_only_where_named(pytester: pytest.Pytester) -> None:
    source = f"""
        import pytest

        pytestmark = pytest.mark.unit

        @pytest.mark.quarantine(reason="flaky", known="a race", since={tiers.landing()})
        def test_quarantined():
            pass

        @pytest.mark.catalyst21
        def test_legacy():
            pass

        def test_plain():
            pass
        """
    run(pytester, source).assert_outcomes(passed=1, deselected=2)
    run(pytester, source, "-m", "unit").assert_outcomes(passed=1, deselected=2)
    run(pytester, source, "-m", "quarantine").assert_outcomes(passed=1, deselected=2)
    run(pytester, source, "-m", "catalyst21").assert_outcomes(passed=1, deselected=2)


@pytest.mark.parametrize(
    ("mark", "problem"),
    [
        ('quarantine(since={now}, known="x")', "without reason"),
        ('quarantine(reason="x", known="x", since={now} + 1)', "must be a landing number"),
        ('quarantine(reason="x", known="x", since={now} - 2)', "past 2 landings"),
    ],
)
def test_a_quarantine_says_why_and_since_when_and_ages_out(
    pytester: pytest.Pytester, mark: str, problem: str
) -> None:
    result = run(
        pytester,
        f"""
        import pytest

        @pytest.mark.unit
        @pytest.mark.{mark.format(now=tiers.landing())}
        def test_quarantined():
            pass
        """,
        "-m",
        "quarantine",
    )
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert problem in result.stdout.str()


def test_each_tier_has_its_timeout_unless_the_test_names_one(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.unit
        def test_default(request):
            assert request.node.get_closest_marker("timeout").args == (30,)

        @pytest.mark.e2e
        @pytest.mark.timeout(900)
        def test_own(request):
            assert request.node.get_closest_marker("timeout").args == (900,)
        """,
    )
    result.assert_outcomes(passed=2)


def waiting_on(path: Path) -> int:
    """How many flock calls wait for the lock of ``path`` (Linux's /proc/locks)."""
    if not path.exists():
        return 0
    inode = f":{os.stat(path).st_ino} "
    with open("/proc/locks") as locks:
        return sum("->" in line and inode in line for line in locks)


def test_an_alone_test_waits_for_the_running_ones_and_goes_before_later_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The lock the workers share (threads stand for them here): an ``alone`` test waits
    until the test running beside it ends, and a test asking after it waits for it."""
    monkeypatch.setattr(sharing.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "scratch")
    order: list[str] = []
    running, alone_waits, later_waits = threading.Event(), threading.Event(), threading.Event()
    release = threading.Event()

    def ordinary() -> None:
        with sharing.turn(alone=False):
            running.set()
            assert release.wait(30)
            order.append("ordinary ends")

    def alone() -> None:
        alone_waits.set()
        with sharing.turn(alone=True):
            order.append("alone runs")

    def later() -> None:
        later_waits.set()
        with sharing.turn(alone=False):
            order.append("later runs")

    threads = [threading.Thread(target=ordinary)]
    threads[0].start()
    assert running.wait(30)
    shared = tmp_path / "nbddp-pytest-scratch"
    threads.append(threading.Thread(target=alone))
    threads[1].start()
    assert alone_waits.wait(30) and wait_until(lambda: waiting_on(shared / "running.lock") == 1)
    threads.append(threading.Thread(target=later))
    threads[2].start()
    assert later_waits.wait(30) and wait_until(lambda: waiting_on(shared / "turnstile.lock") == 1)
    assert order == []  # the alone test waits for the ordinary one, the later one for both
    release.set()
    for thread in threads:
        thread.join(30)
    assert order == ["ordinary ends", "alone runs", "later runs"]


def test_a_run_whose_groups_xdist_would_ignore_stops_saying_which_versions_to_install(
    pytester: pytest.Pytester,
) -> None:
    """pytest 9.2 with pytest-xdist 3.8 (xdist#1386) silently drops every ``xdist_group``: a
    worker of ``--dist loadgroup`` whose grouped tests lack their ``@group`` stops the run,
    saying so, instead of running the Ray, browser and port tests side by side."""
    pytester.makeconftest(
        "def pytest_configure(config):\n    config.option.loadgroup = True  # as a worker's\n"
    )
    source = """
        import pytest

        @pytest.mark.unit
        @pytest.mark.xdist_group("port-12355")
        def test_grouped():
            pass
    """
    result = run(pytester, source)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ignored the groups of 1 tests*xdist#1386*constraints.txt*"])
    pytester.makeconftest("")  # no loadgroup (a run without xdist): nothing to check
    assert run(pytester, source).ret == pytest.ExitCode.OK


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    [command] = re.findall(r"^python3 -m venv .venv && .*pytest.*$", readme, re.MULTILINE)
    pytest_part = command.rpartition(" && ")[2]
    assert " -n 3 " in f"{pytest_part} "  # the whole suite, in parallel
    assert command in (ROOT / "docs" / "development.md").read_text()
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    assert re.search(re.escape(pytest_part) + r"\s", re.sub(r"\s+", " ", script)), pytest_part


def smoke() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_smoke", ROOT / ".ci" / "smoke.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_oldest_run_pins_every_declared_floor_capped_ones_too() -> None:
    """Stop 48's CI failed its oldest run at once: ``pytest>=8,<9.2`` read as no floor."""
    ci = smoke()
    pins = ci.oldest_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["smoke"]
    pinned = {pin.split("==")[0] for pin in pins if "==" in pin}
    assert pinned == {re.split(r"[\[>=<!, ]", line)[0] for line in declared}
    assert f"pytest=={ci._locked()['pytest']}" in pins  # the harness at its locked version
    [torch] = [line for line in declared if line.startswith("torch>=")]
    assert torch.replace(">=", "==") in pins  # a package under test at its floor


def test_the_culprit_search_is_capped_by_the_time_the_run_has_left() -> None:
    ci = smoke()
    assert ci.culprit_budget(1000.0, None) == ci.CULPRIT_BUDGET  # no deadline: its own cap
    assert ci.culprit_budget(1000.0, str(1000 + 10 * 60)) == 9 * 60  # a minute kept
    assert ci.culprit_budget(1000.0, str(1000 + 3600)) == ci.CULPRIT_BUDGET
    assert ci.culprit_budget(1000.0, "1030") == 0  # past it: no search


def test_pip_is_tried_once_more_only_when_the_index_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ci = smoke()
    monkeypatch.setattr(ci, "INDEX_RETRY_AFTER", 0)
    answers: list[tuple[int, str]] = []
    calls: list[list[str]] = []

    def fake_run(command: list[str], **options: object) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        code, err = answers.pop(0)
        return subprocess.CompletedProcess(command, code, "", err)

    monkeypatch.setattr(ci.subprocess, "run", fake_run)
    trouble = "WARNING: Retrying ... ReadTimeoutError: Read timed out.\nERROR: No matching"
    answers[:] = [(1, trouble), (0, "")]
    ci._pip(sys.executable, {}, "install", "torch")
    assert len(calls) == 2
    assert "== infrastructure: pip could not reach the package index" in capsys.readouterr().out

    calls.clear()
    answers[:] = [(1, trouble), (1, trouble)]
    with pytest.raises(subprocess.CalledProcessError):
        ci._pip(sys.executable, {}, "install", "torch")
    assert len(calls) == 2  # once more, not again and again

    calls.clear()
    answers[:] = [(1, "ERROR: ResolutionImpossible: torch==9 conflicts with numpy<2")]
    with pytest.raises(subprocess.CalledProcessError):
        ci._pip(sys.executable, {}, "install", "torch==9")
    assert len(calls) == 1  # a request that cannot be met is no infrastructure error


def test_a_module_that_failed_to_import_blames_no_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pytest writes a module that failed to import as a case without a class, and runs nothing
    else: a round of the search that ends so learns nothing (stop 47 blamed numpy for a torch
    2.2 failure, after numpy 2 broke torch 2.2's import of a test module)."""
    ci = smoke()
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="" name="tests.rules.test_sync_check">'
        '<error message="collection failure">ImportError</error></testcase>'
        '<testcase classname="tests.test_launch" name="test_a[x y]"><failure/></testcase>'
        '<testcase classname="tests.test_launch" name="test_b"/>'
        "</testsuite></testsuites>"
    )
    assert ci.failed_in(report) == [
        "tests/rules/test_sync_check.py",
        "tests/test_launch.py::test_a[x y]",
    ]

    failing = ["tests/test_launch.py::test_a[x y]"]
    rounds = [["tests/rules/test_sync_check.py"], None]  # numpy: import broke; torch: passes
    monkeypatch.setattr(ci, "_pip", lambda *args: None)
    monkeypatch.setattr(ci, "_run_smoke", lambda python, report, tests: rounds.pop(0))
    installed, locked = {"numpy": "1.26.4", "torch": "2.2.0"}, {"numpy": "2.4.6", "torch": "2.14.1"}
    ci._name_the_culprit(sys.executable, {}, failing, installed, locked, tmp_path)
    out = capsys.readouterr().out
    assert "BROKEN BY numpy" not in out
    assert "nothing learnt with numpy 2.4.6: tests/rules/test_sync_check.py did not run" in out
    assert "== BROKEN BY torch 2.2.0 (passes with 2.14.1): tests/test_launch.py::test_a[x y]" in out


def test_a_run_started_with_sigint_ignored_gets_ctrl_c_back() -> None:
    """A background job of a shell without job control (``nohup pytest &`` in a script)
    starts with SIGINT ignored, and Python keeps it so: the tests that interrupt a run would
    hang (five did, in a run started so). The suite puts Python's own handler back."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sharing.interruptible()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_test_kernels_talk_over_unix_sockets_of_their_own() -> None:
    """A port asked of the system and bound later by the kernel can be taken in between by
    another test's process (stop 48's CI lost a kernel so): the kernels use Unix sockets, each
    under its own prefix in a directory of this process. Nothing is started here."""
    from jupyter_client.manager import KernelManager

    first, second = (KernelManager(config=kernel_config()) for _ in range(2))
    assert first.transport == second.transport == "ipc"
    assert first.ip != second.ip
    assert os.path.dirname(first.ip) == os.path.dirname(second.ip)
    assert os.path.isdir(os.path.dirname(first.ip))
    assert len(f"{first.ip}-99999") < 100  # under a Unix socket path's limit (108)
