#!/usr/bin/env python3
"""The quarantine's rules, and its runs (docs/development.md, "Quarantine").

    .ci/quarantine.py      with the test venv's python (it runs pytest)

1. **The landing count** (``.ci/LANDING``): a submission's number is one more than that of the
   landed tree it was made from (``git merge-base HEAD`` with ``$NBDDP_LANDED_REF``, else
   ``origin/main``, else ``main``). Without a bump a quarantine would never age; where no landed
   tree is known, it says so (loudly, in the summary), and the number is taken as it is.
2. **At most five quarantined tests**, each with ``reason=``, ``known=`` and ``since=`` (a
   landing number), none past two landings: the collection checks each mark
   (``tests/tiers.py``), this script counts them.
3. **Their runs**: each quarantined test three times, each in a fresh process, printed as
   ``quarantined: passed k/3``. Their outcome never fails CI: that is what the quarantine is.

Exit status: 1 when a rule (1 or 2) is broken, else 0, whatever the runs did.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANDING = ROOT / ".ci" / "LANDING"
RUNS = 3
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
sys.path.insert(0, str(ROOT / "tests"))
from tiers import QUARANTINE_LIMIT, TIMEOUT  # noqa: E402  (the rules' one source)


def main() -> int:
    broken = landing_problems()
    tests, collected = quarantined()
    if collected.returncode != 0:
        print(collected.stdout[-4000:] + collected.stderr[-4000:])
        broken.append("the collection of the quarantined tests failed (above)")
    if len(tests) > QUARANTINE_LIMIT:
        broken.append(
            f"{len(tests)} tests are quarantined, more than {QUARANTINE_LIMIT}: fix some first"
        )
    print(f"== quarantined tests: {len(tests)} (at most {QUARANTINE_LIMIT})")
    deadline = float(os.environ.get("NBDDP_DEADLINE", "inf"))
    for test in tests:
        passed = 0
        for run in range(RUNS):
            if time.time() + TIMEOUT["e2e"] > deadline - 60:
                print(f"quarantined: passed {passed}/{run} (out of time): {test}")
                break
            passed += _run_alone(test) == 0
        else:
            print(f"quarantined: passed {passed}/{RUNS}: {test}")
    for problem in broken:
        print(f"== QUARANTINE RULE BROKEN: {problem}")
    return 1 if broken else 0


def landing_problems() -> list[str]:
    """Whether ``.ci/LANDING`` is one more than the landed tree's (see the module's docstring)."""
    number = int(LANDING.read_text().split()[0])
    landed = _landed_number()
    if landed is None:
        print(f"== landing {number}: no landed tree to compare with, taken as it is")
        return []
    commit, before = landed
    if before is None:
        print(f"== landing {number}: .ci/LANDING is new since {commit[:10]}")
        return []
    # the landed tree itself, run again, keeps its number
    expected = before if _git("rev-parse", "HEAD") == commit else before + 1
    print(f"== landing {number}: the landed tree {commit[:10]} is {before}")
    if number != expected:
        return [
            f".ci/LANDING is {number}, the landed tree's is {before}: a submission sets it to "
            f"{before + 1} (docs/development.md, 'Quarantine')"
        ]
    return []


def _landed_number() -> tuple[str, int | None] | None:
    """(the commit this tree was made from on the landed line, its .ci/LANDING number)."""
    for ref in (os.environ.get("NBDDP_LANDED_REF"), "origin/main", "main"):
        if not ref:
            continue
        base = _git("merge-base", "HEAD", ref)
        if base:
            text = _git("show", f"{base}:.ci/LANDING")
            return base, int(text.split()[0]) if text else None
    return None


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def quarantined() -> tuple[list[str], subprocess.CompletedProcess[str]]:
    done = subprocess.run(
        [*PYTEST, "--collect-only", "-q", "-m", "quarantine"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    tests = [line for line in done.stdout.splitlines() if "::" in line and " " not in line]
    ok = done.returncode in (0, 5)  # 5: none quarantined
    return tests, subprocess.CompletedProcess(done.args, 0 if ok else 1, done.stdout, done.stderr)


def _run_alone(test: str) -> int:
    """One run of one quarantined test, in a process of its own."""
    try:
        done = subprocess.run(
            [*PYTEST, "-q", "-m", "quarantine", test],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT["e2e"] + 60,
        )
    except subprocess.TimeoutExpired:
        return 124
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
