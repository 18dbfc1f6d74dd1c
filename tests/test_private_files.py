"""Every file a run leaves in its directory is the user's alone: files ``0600`` (``0700`` for
an exported script, which runs), directories ``0700``. The directory is walked while the run
is alive, after a roll-call, with a forked child of rank 0 (whose stack dump is a file of its
own), so whatever a launch, a session or a roll-call writes there is checked, named or not;
an export's files and the result its script saves likewise."""

from __future__ import annotations

import glob
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import TWO_CPU_QUIET

import nbddp

DEADLINE = 60.0


def modes(root: str) -> dict[str, int]:
    """Every entry under ``root`` (itself as ".") and its mode (type and permission bits)."""
    found = {".": os.lstat(root).st_mode}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = os.lstat(path).st_mode
    return found


def not_owner_only(found: dict[str, int], executable: str = "") -> dict[str, str]:
    """The entries whose bits are not 0700 (directories, ``executable``) or 0600 (the rest)."""
    wrong = {}
    for name, mode in found.items():
        want = 0o700 if name == executable or stat.S_ISDIR(mode) else 0o600
        if stat.S_IMODE(mode) != want:
            wrong[name] = f"{stat.S_IMODE(mode):o}, want {want:o}"
    return wrong


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + DEADLINE
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def hold_with_a_child(folder: str) -> int:
    """Rank 0 forks a child (as a DataLoader worker would), says it is ready, and holds both
    until the test has looked."""
    import os
    import time

    import nbddp

    done = os.path.join(folder, "done")
    if nbddp.rank() == 0:
        child = os.fork()
        if child == 0:
            while not os.path.exists(done):
                time.sleep(0.02)
            os._exit(0)
        open(os.path.join(folder, "ready"), "w").close()
    while not os.path.exists(done):
        time.sleep(0.02)
    if nbddp.rank() == 0:
        os.waitpid(child, 0)
    return nbddp.rank()


def run_directories() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"nbddp-{os.getpid()}-*"))


def look_while_held(run: nbddp.Run, folder: Path) -> tuple[dict[str, int], str]:
    """The run's directory, after a roll-call with rank 0's child alive; then let it go."""
    try:
        wait_for(folder / "ready")
        roll_call = str(run.stacks(timeout=10))
        assert "rank 0" in roll_call and "rank 1" in roll_call, roll_call
        [directory] = run_directories()
        return modes(directory), directory
    finally:
        (folder / "done").touch()


def check(seen: dict[str, int], directory: str) -> None:
    """``seen``: the walk of ``directory``, taken while the run was alive."""
    # the walk saw the run's directory: its script, both ranks' dumps and rank 0's child's
    assert {"launch.py", "stacks-0.txt", "stacks-1.txt"} <= set(seen), seen
    assert any(name.startswith("stacks-0-") for name in seen), seen
    assert not (wrong := not_owner_only(seen)), f"not owner-only in {directory}: {wrong}"


@pytest.mark.ranks
def test_every_file_of_a_launch_and_its_roll_call_is_owner_only(tmp_path):
    run = nbddp.notebook_launch(
        hold_with_a_child, (str(tmp_path),), block=False, return_all=True, **TWO_CPU_QUIET
    )
    seen, directory = look_while_held(run, tmp_path)
    assert run.result(timeout=DEADLINE) == [0, 1]
    check(seen, directory)


@pytest.mark.ranks
def test_every_file_of_a_session_and_its_roll_call_is_owner_only(tmp_path):
    with nbddp.Session(num_workers=2, device="cpu") as session:
        run = session.run(
            hold_with_a_child, (str(tmp_path),), block=False, return_all=True, display="none"
        )
        seen, directory = look_while_held(run, tmp_path)
        assert run.result(timeout=DEADLINE) == [0, 1]
    check(seen, directory)


def train_a_little() -> float:
    import torch

    return float(torch.ones(2).sum())


@pytest.mark.e2e
def test_every_file_of_an_export_and_of_its_run_is_owner_only(tmp_path):
    script = tmp_path / "train.py"
    nbddp.export(train_a_little, script, num_workers=2, device="cpu", nodes=2)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    seen = modes(str(tmp_path))
    del seen["."]  # pytest's folder, not the export's
    assert {"train.py", "train.pkl", "train.sbatch", "train.result.pkl"} <= set(seen), seen
    assert not (wrong := not_owner_only(seen, "train.py")), wrong
