"""``benchmarks/gpu_check.py``, the one prepared check for a GPU machine (#44): without a GPU
it prints its plan and exits 0 (CI runs this), and its CPU rehearsal runs every section's
harness with the GPU parts stubbed, so that the one run on a GPU does not die of a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.unit
def test_without_a_gpu_it_prints_its_numbered_plan_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "has_gpu", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    plan = capsys.readouterr().out
    for number, name, seconds, _ in gpu_check.SECTIONS:
        assert f"{number:>3}. {name} ({seconds} s): " in plan
    assert "carry=['.whl']" in plan and "--out $OUT" in plan
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


@pytest.mark.unit
def test_the_sections_fit_the_nine_minutes_and_are_numbered_in_order():
    numbers = [number for number, *_ in gpu_check.SECTIONS]
    assert numbers == list(range(len(numbers)))
    assert sum(seconds for _, _, seconds, _ in gpu_check.SECTIONS) <= gpu_check.TOTAL <= 540
    from gpu_check_sections import SECTIONS

    assert sorted(SECTIONS) == numbers
    assert [SECTIONS[n].__name__ for n in numbers] == [name for _, name, *_ in gpu_check.SECTIONS]


@pytest.mark.unit
def test_the_report_says_what_failed_and_what_could_not_be_checked():
    results = [
        {"number": 0, "name": "environment", "status": "ran", "seconds": 2.0, "budget": 20,
         "checks": [{"what": "a", "expected": "1", "got": "1", "ok": True},
                    {"what": "b", "expected": "1", "got": "2", "ok": False},
                    {"what": "c", "expected": "x", "got": "y", "ok": None}],
         "facts": {"gpu": "NVIDIA H100"}, "log_tail": ""},
        {"number": 1, "name": "gpu_tests", "status": "timed out after 110 s", "seconds": 110,
         "budget": 110, "log_tail": "stuck here"},
    ]  # fmt: skip
    meta = {"rehearsal": False, "when": "now", "seconds": 112.0, "card": "NVIDIA H100"}
    text = gpu_check.report_md(results, meta)
    assert "| 0 | environment | ran | 2 (20) | 1 of 3 checks FAILED |" in text
    assert "- **FAILED**: b (expected 1; got 2)" in text and "- n/a: c" in text
    assert "| 1 | gpu_tests | timed out after 110 s | 110 (110) | ERROR |" in text
    assert "stuck here" in text


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.gpu_rehearsal  # out of the README's run: .ci/run gives it a step of its own
@pytest.mark.timeout(600)
def test_the_cpu_rehearsal_runs_every_section_without_an_error(tmp_path):
    """Every section's harness on the CPU, IPython hidden as on the device machine (but for
    the %%ddp section, which uses this machine's kernel): no section errs, no check fails."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-rehearsal",
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=580,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    sections = report["sections"]
    assert [s["number"] for s in sections] == list(range(len(gpu_check.SECTIONS)))
    errors = {s["name"]: s.get("error") or s["status"] for s in sections
              if s["status"] != "ran" or s.get("error")}  # fmt: skip
    assert not errors, errors
    failed = [(s["name"], c) for s in sections for c in s.get("checks", []) if c["ok"] is False]
    assert not failed, failed
    assert (tmp_path / "gpu-check.md").read_text().startswith("## GPU check")
    # the device tool brings back 8 files at most: the sections' own travel in one bundle
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu-check.json", "gpu-check.md", "sections.tar.gz"]  # fmt: skip
    with tarfile.open(tmp_path / "sections.tar.gz") as bundle:
        names = set(bundle.getnames())
    assert {f"sections/section-{n}.{kind}" for n in (0, 11) for kind in ("json", "log")} <= names
    assert "sections/gpu-tests.xml" in names
