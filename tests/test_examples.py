"""The example scripts run as a user runs them: a plain ``python examples/...`` command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=110,
    )


def test_quickstart_trains_and_reports():
    done = run_example("quickstart.py")
    assert done.returncode == 0, done.stderr
    assert "succeeded" in done.stdout
    # rank 0's report of each epoch, and a model that learned y = sum(x) (whose variance is
    # 10) back in this process
    losses = [
        float(x) for x in re.findall(r"epoch \d: loss ([\d.]+) \(2 ranks on cpu\)", done.stdout)
    ]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], done.stdout
    mse = re.search(r"trained TinyNet back in the parent process: eval mse ([\d.]+)", done.stdout)
    assert mse is not None and float(mse[1]) < 0.5, done.stdout


def test_train_cnn_trains_two_ranks_and_rejects_bad_arguments():
    done = run_example("train_cnn.py", "--epochs", "1", "--size", "128", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "epoch 0: loss" in done.stdout and "trained on 2 × cpu" in done.stdout
    bad = run_example("train_cnn.py", "--workers", "0")
    assert bad.returncode == 2 and "--workers: must be 1 or more" in bad.stderr
