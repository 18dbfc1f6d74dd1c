"""How tests share one machine when pytest-xdist runs them three at a time on two cores
(``-n 3 --dist loadgroup``, the README's command; docs/development.md, "Running in parallel":
with two, a fifth of the machine idled while tests waited on Slurm's clock, a stall threshold
or a kernel).

* **Groups.** What cannot run beside itself goes to one worker, in order: every test marked
  ``ray`` in the group ``ray`` (one Ray per machine: ``/tmp/ray``'s current cluster, a fixed
  node address); a file can name its own (``port-12355``, ``browser``) with
  ``pytest.mark.xdist_group``. The tests of a file that share its module's Jupyter kernel or
  Slurm (the ``kernel`` and ``slurm`` fixtures) stay together too, so that one serves them all.
  Two files' Slurms can run at once (their namespaces are named per process) and mostly wait
  on Slurm's clock, so they overlap with the other workers' work.
* **Alone.** A test marked ``alone`` measures time or memory: it runs with no other test
  running. Every other test holds a shared lock while it runs, an ``alone`` one holds it
  exclusively; a turnstile makes a waiting ``alone`` test go next, so it is never starved. The
  wait comes before the test's timeout starts.
* **Infrastructure retries.** A test that fails with an error of the machine, not of nbddp
  (:data:`INFRASTRUCTURE`: an address already in use), is run once more, and the summary
  names it. Nothing else is ever run again (a flaky test is quarantined instead).
* **Ctrl-C.** A run started with SIGINT ignored (a script's background job) gets Python's
  handler back in every worker (:func:`interruptible`): the tests that interrupt a run need it.
* **Speed.** :func:`slowness` is how much slower than a quiet developer's machine this one is,
  measured once per run; bounds that are the point of a test scale by it.

Without xdist every test runs in turn and the locks are not taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

# Resource marks whose tests share one worker (see the module's docstring).
GROUP_OF_MARK = {"ray": "ray"}
# Module-scoped fixtures that start something slow: the tests of a file that use one share a
# worker, in the group "<fixture>-<file>".
MODULE_FIXTURES = ("kernel", "slurm")
# Errors of the machine, not of nbddp: such a failure is retried once, and reported. Ray's
# own start waits a fixed 30 s for its raylet to register, which a loaded machine can outlast.
INFRASTRUCTURE = [
    r"[Aa]ddress already in use",
    r"EADDRINUSE",
    r"The current node timed out during startup",
]
# A warm two-rank launch of a trivial function on a quiet machine (docs/results.md, #26).
QUIET_LAUNCH = 0.05


def _run_dir() -> Path | None:
    """A directory the workers of this run share (None without xdist)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID") or _controller_uid
    if uid is None:
        return None
    path = Path(tempfile.gettempdir()) / f"nbddp-pytest-{uid}"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def _held(path: Path, how: int) -> Iterator[None]:
    with open(path, "a") as file:
        fcntl.flock(file, how)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


@contextlib.contextmanager
def turn(alone: bool) -> Iterator[None]:
    """A test's turn: shared with the other workers' tests, or ``alone``."""
    shared = _run_dir()
    if shared is None:
        yield
        return
    with open(shared / "running.lock", "a") as running:
        with _held(shared / "turnstile.lock", fcntl.LOCK_EX):  # no test passes a waiting one
            fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The groups of resource marks (before xdist names each test's group in its id), and
    the one retry of an infrastructure error where pytest-rerunfailures is installed."""
    retries = config.pluginmanager.hasplugin("rerunfailures")
    for item in items:
        groups = [group for mark, group in GROUP_OF_MARK.items() if item.get_closest_marker(mark)]
        shared = [f for f in MODULE_FIXTURES if f in getattr(item, "fixturenames", ())]
        if not groups and shared and item.get_closest_marker("xdist_group") is None:
            groups = [f"{shared[0]}-{item.nodeid.split('::')[0]}"]
        for group in groups:
            item.add_marker(pytest.mark.xdist_group(group))
        if retries and item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=INFRASTRUCTURE))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker under ``--dist loadgroup``: every grouped test's id must carry its
    group (xdist's side channel to its scheduler), or the groups are silently ignored and tests
    that must not share the machine run side by side. pytest 9.2 with pytest-xdist 3.8 does
    exactly that (pytest-dev/pytest-xdist#1386), so the run stops here, saying so."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid
    ]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup ignored the groups of {len(lost)} tests (first: "
            f"{lost[0]}): this pytest ({pytest.__version__}) and pytest-xdist do not work "
            "together (pytest-dev/pytest-xdist#1386). Install the tested versions: "
            '.venv/bin/pip install -e ".[dev]" -c .ci/constraints.txt'
        )


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Outermost: the wait for a turn is not part of the test (nor of its timeout)."""
    with turn(alone=item.get_closest_marker("alone") is not None):
        return (yield)


class _Retries:
    """The tests run again after an infrastructure error, named in the summary; one per
    session (a pytester run inside a test has its own)."""

    def __init__(self) -> None:
        self.retried: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.outcome == "rerun":
            self.retried[report.nodeid] += 1

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.retried:
            terminalreporter.section("run again after an infrastructure error")
            for nodeid, times in sorted(self.retried.items()):
                terminalreporter.write_line(f"retried {times}x: {nodeid}")
            terminalreporter.write_line(f"(the errors retried: {', '.join(INFRASTRUCTURE)})")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    shared = _run_dir()
    facts = _speed
    if shared is not None and (shared / "speed.json").exists():
        facts = json.loads((shared / "speed.json").read_text())
    if facts is not None:
        terminalreporter.write_line(
            f"machine speed: a warm 2-rank launch took {facts['launch']:.3f} s (quiet: "
            f"{QUIET_LAUNCH} s): bounds that are a test's point were scaled "
            f"{facts['factor']:.1f}x"
        )
    if shared is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        with contextlib.suppress(OSError):
            for path in shared.iterdir():
                path.unlink()
            shared.rmdir()


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a notebook has it, and xdist's controller: the run's id, which its workers
    get as PYTEST_XDIST_TESTRUNUID, made here so that the controller knows the directory they
    share."""
    global _controller_uid
    interruptible()
    config.pluginmanager.register(_Retries())
    numprocesses = getattr(config.option, "numprocesses", None)
    if numprocesses and not hasattr(config, "workerinput"):
        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex
        _controller_uid = config.option.testrunuid


def interruptible() -> None:
    """SIGINT raises KeyboardInterrupt in this process, as in a kernel. A shell without job
    control starts a background job (``cmd &`` in a script, ``nohup``) with SIGINT ignored,
    and Python then keeps ignoring it: every test that interrupts a run (they send SIGINT to
    their own main thread, or to a kernel they start) would hang instead, in every worker."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_controller_uid: str | None = None
_speed: dict[str, float] | None = None


def slowness() -> float:
    """How many times slower than a quiet developer's machine this one runs a warm two-rank
    launch of a trivial function (at least 1): measured once per test run (the workers share
    it), the first time a test asks, as the median of three launches after one that warms
    the helper."""
    global _speed
    if _speed is not None:
        return _speed["factor"]
    shared = _run_dir()
    with _held(shared / "speed.lock", fcntl.LOCK_EX) if shared else contextlib.nullcontext():
        if shared is not None and (shared / "speed.json").exists():
            _speed = json.loads((shared / "speed.json").read_text())
            return _speed["factor"]
        import nbddp
        from nbddp import run

        took = []
        # nbddp's defaults, whatever the asking test set (a cold start, a short exit bound),
        # and the asking test's last_run() left as it was
        ours = {k: v for k, v in os.environ.items() if not k.startswith("NBDDP_")}
        last = nbddp.last_run()
        with mock.patch.dict(os.environ, ours, clear=True):
            for _ in range(4):
                started = time.monotonic()
                nbddp.notebook_launch(abs, (1,), num_workers=2, device="cpu", display="none")
                took.append(time.monotonic() - started)
        run._last = last
        launch = statistics.median(took[1:])
        _speed = {"launch": launch, "factor": max(1.0, launch / QUIET_LAUNCH)}
        if shared is not None:
            (shared / "speed.json").write_text(json.dumps(_speed))
    return _speed["factor"]


def within(seconds: float) -> float:
    """A bound of ``seconds`` on a quiet machine, scaled to this one (:func:`slowness`)."""
    return seconds * slowness()
