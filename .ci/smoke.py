#!/usr/bin/env python3
"""The smoke subset (tests marked ``smoke``) against the newest or the oldest releases nbddp
declares, so that an upstream release that breaks us is seen the day it ships, not when a user
finds it (cloudpickle 3.1.3 renamed every shipped code object's file while CI stayed green).

    .ci/smoke.py newest    a fresh venv with the newest release of every dependency (the
                        machine's pip caps lifted)
    .ci/smoke.py oldest    a fresh venv with the oldest release pyproject.toml declares for each
                        package nbddp and the smoke tests use

It prints the versions it tested beside the locked set's (.ci/constraints.txt) and how many
smoke tests ran, passed and skipped, and when the subset fails it names the package that broke
it: each package that differs from the locked set is put back to its locked version in turn,
and the failed tests are run again; the first whose return makes them pass is named. That
search stops at CULPRIT_BUDGET or at the run's deadline (``NBDDP_DEADLINE``, seconds since the
epoch, which .ci/run sets), whichever comes first, saying what it did not try.

A pip call that fails on the package index (a connection, a timeout, a 5xx: not a version that
cannot be resolved) is an infrastructure error: it is said so and tried once more, a minute
later. Exit status: 0 when the subset passed, 1 otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / ".ci" / "constraints.txt"
# What a user's notebook meets first; the order is the order of the search for a culprit
# (torch last: the heaviest to reinstall).
WATCHED = [
    "cloudpickle",
    "ipython",
    "ipykernel",
    "jupyter_client",
    "nbclient",
    "nbformat",
    "ipywidgets",
    "transformers",
    "accelerate",
    "lightning",
    "numpy",
    "torch",
]
# Our test harness, not something a user's notebook runs: the locked version in both sets.
HARNESS = {"pytest", "pytest_timeout", "psutil"}
CULPRIT_BUDGET = 20 * 60  # seconds the search for a culprit may take, at most
ROUND = 3 * 60  # seconds one round of the search takes, about: none starts with less left
# What pip prints when the index, not the request, failed.
INDEX_TROUBLE = re.compile(
    r"ConnectionError|ConnectTimeout|ReadTimeout|Read timed out|Max retries exceeded|"
    r"Temporary failure in name resolution|Connection (?:reset|refused|aborted)|"
    r"IncompleteRead|ProtocolError|HTTP error 5\d\d|Could not fetch URL",
    re.IGNORECASE,
)
INDEX_RETRY_AFTER = 60  # seconds before the one retry


def main() -> int:
    which = sys.argv[1] if len(sys.argv) == 2 else ""
    if which not in ("newest", "oldest"):
        print(__doc__)
        return 2
    started = time.monotonic()
    venv = ROOT / ".ci" / "venvs" / which
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = _pip_env(which)
    if which == "newest":
        _pip(python, env, "install", "-U", "pip")
        _pip(python, env, "install", "-e", ".[smoke]")
    else:
        constraints = venv / "oldest.txt"
        constraints.write_text("\n".join(oldest_pins()) + "\n")
        _pip(python, env, "install", "-e", ".[smoke]", "-c", str(constraints))
    installed = _versions(python)
    locked = _locked()
    print(f"\n== smoke on the {which} releases (installed in {time.monotonic() - started:.0f} s)")
    print(f"{'package':<16} {'locked':<14} {which}")
    for name in WATCHED:
        mark = "" if installed.get(name) == locked.get(name) else "  *"
        print(f"{name:<16} {locked.get(name, '-'):<14} {installed.get(name, '-')}{mark}")
    failed = _run_smoke(python, venv / "smoke.xml")
    print(f"== smoke on the {which} releases: {_counts(venv / 'smoke.xml')}")
    took = time.monotonic() - started
    if failed is None:
        print(f"== smoke on the {which} releases passed ({took:.0f} s in all)")
        return 0
    print(f"== smoke on the {which} releases FAILED: {len(failed)} test(s)")
    for test in failed:
        print(f"   {test}")
    _name_the_culprit(python, env, failed, installed, locked, venv)
    return 1


def oldest_pins() -> list[str]:
    """``name==floor`` for every package nbddp and its smoke extra declare (``>=floor``), the
    test harness at its locked version, and what an old torch needs to import at all."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["smoke"]
    locked = _locked()
    pins = []
    for requirement in declared:
        # A floor, and maybe a cap after it (``pytest>=8,<9.2``): the oldest run installs the floor.
        match = re.fullmatch(
            r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*>=\s*([^,;\s]+)(?:\s*,\s*(?:<|<=|!=)\s*[^,;\s]+)*",
            requirement,
        )
        if match is None:
            raise SystemExit(f"pyproject.toml: {requirement!r} has no '>=' floor to test")
        name, floor = match.groups()
        version = locked[_key(name)] if _key(name) in HARNESS else floor
        pins.append(f"{name}=={version}")
    torch_floor = next(p.split("==")[1] for p in pins if p.startswith("torch=="))
    if tuple(int(x) for x in torch_floor.split(".")[:2]) < (2, 3):
        pins.append("numpy<2  # torch < 2.3 was built against numpy 1.x")
    return pins


def _run_smoke(python: str, report: Path, tests: list[str] | None = None) -> list[str] | None:
    """The failed tests' ids, or None when every selected test passed."""
    selection = tests if tests else ["-m", "smoke"]
    # CI's rule that only GPU tests skip is the main run's: here the packages of other tests'
    # modules (Ray, Catalyst, the browser's) are not installed, so those modules skip.
    env = {k: v for k, v in os.environ.items() if k not in ("NBDDP_CI", "NBDDP_SKIP_SUMMARY")}
    done = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", *selection],
        cwd=ROOT,
        env=env,
    )
    if done.returncode == 0:
        return None
    return failed_in(report) or ["(the run failed before any test: see above)"]


def failed_in(report: Path) -> list[str]:
    """The ids of the tests that failed or erred in a JUnit report; a module that failed to
    import (pytest then runs nothing) as its path, ``tests/rules/test_x.py``: pytest writes it
    as a test case without a class whose name is the module's dotted name."""
    if not report.exists():
        return []
    failed = []
    for case in ET.parse(report).iter("testcase"):
        if case.find("failure") is None and case.find("error") is None:
            continue
        classname, name = case.get("classname", ""), case.get("name", "")
        if classname:
            failed.append(f"{classname.replace('.', '/')}.py::{name}")
        else:
            failed.append(f"{name.replace('.', '/')}.py")
    return failed


def _name_the_culprit(
    python: str,
    env: dict[str, str],
    failed: list[str],
    installed: dict[str, str],
    locked: dict[str, str],
    venv: Path,
) -> None:
    """Put the watched packages back to their locked versions one at a time, cumulatively, and
    run what still fails after each: a test that passes from then on is blamed on the package
    just put back. Bounded by ``CULPRIT_BUDGET`` seconds."""
    tests = [t for t in failed if t.endswith(".py") or "::" in t]
    moved = [n for n in WATCHED if installed.get(n) and locked.get(n) and installed[n] != locked[n]]
    if not tests or not moved:
        print("   no package to blame: nothing watched differs from the locked set")
        return
    budget = culprit_budget(time.time(), os.environ.get("NBDDP_DEADLINE"))
    print(f"   searching for the culprit for at most {budget:.0f} s")
    deadline = time.monotonic() + budget
    for index, name in enumerate(moved):
        if not tests:
            break
        if time.monotonic() + ROUND > deadline:
            print(f"== out of time for the search: {', '.join(moved[index:])} not put back")
            break
        print(f"-- {name} {installed[name]} -> {locked[name]} (the locked one), then {len(tests)}")
        _pip(python, env, "install", f"{name}=={locked[name]}")
        still = _run_smoke(python, venv / "culprit.xml", tests) or []
        broken = [t for t in still if "::" not in t]  # a module that failed to import, or none ran
        if broken:
            print(f"-- nothing learnt with {name} {locked[name]}: {', '.join(broken)} did not run")
            still = tests
        for test in tests:
            if test not in still:
                print(f"== BROKEN BY {name} {installed[name]} (passes with {locked[name]}): {test}")
        tests = [t for t in tests if t in still]
    for test in tests:
        print(f"== no culprit found among {', '.join(moved)}: {test}")


def culprit_budget(now: float, deadline: str | None) -> float:
    """Seconds the culprit search may take: CULPRIT_BUDGET, or less when the run's deadline
    (seconds since the epoch) comes sooner; a minute is kept for the run's summary."""
    if not deadline:
        return CULPRIT_BUDGET
    return max(0.0, min(CULPRIT_BUDGET, float(deadline) - now - 60))


def _counts(report: Path) -> str:
    """How many smoke tests ran, from the run's JUnit report."""
    if not report.exists():
        return "no report: the run failed before any test"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return f"{total} ran: {total - skipped - failed} passed, {failed} failed, {skipped} skipped"


def _pip_env(which: str) -> dict[str, str]:
    env = dict(os.environ)
    if which == "newest":
        env["PIP_CONSTRAINT"] = os.devnull  # a machine's cap (/etc/xdg/pip) is not "newest"
    return env


def _pip(python: str, env: dict[str, str], *args: str) -> None:
    """pip, tried once more when the package index failed it (said so)."""
    command = [python, "-m", "pip", "-q", *args]
    for attempt in (1, 2):
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        if done.returncode == 0:
            return
        trouble = INDEX_TROUBLE.search(done.stdout + done.stderr)
        if attempt == 2 or trouble is None:
            raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
        print(
            f"== infrastructure: pip could not reach the package index ({trouble.group(0)}); "
            f"once more in {INDEX_RETRY_AFTER} s: pip {' '.join(args)}"
        )
        time.sleep(INDEX_RETRY_AFTER)


def _versions(python: str) -> dict[str, str]:
    out = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout
    return {_key(n): v for n, _, v in (line.partition("==") for line in out.split()) if v}


def _locked() -> dict[str, str]:
    pins = (line.partition("==") for line in LOCK.read_text().splitlines() if "==" in line)
    return {_key(name): version.strip() for name, _, version in pins}


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


if __name__ == "__main__":
    sys.exit(main())
