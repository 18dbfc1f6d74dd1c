"""A script's rank side without a process: its exit status as Python's own exit computes it,
the ``__main__`` it runs in (and what a session's rank gets back), and which of the user's
modules a run imports anew (edited since, imported by an earlier run, shadowed by a file
beside the script), while the interpreter's libraries are never touched."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbddp.worker.rank import report, script_modules
from nbddp.worker.rank.scripts import ScriptMain, exit_status, run

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("code", "status"), [(None, 0), (0, 0), (3, 3), (256, 0), (-1, 255), (True, 1), ("no", 1)]
)
def test_the_exit_status_is_pythons(code, status, capsys):
    assert exit_status(code) == status
    assert capsys.readouterr().err == ("no\n" if code == "no" else "")


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """A place for the user's modules, on the path, forgotten afterwards. The process "starts"
    with the test: a test file of this suite edited while it runs (loaded by pytest: a user's
    module to ``forget_for``) is not taken as edited since, nor dropped from pytest's modules."""
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    started = time.time() - 1  # a file's time is the kernel's coarse clock: it may lag a little
    monkeypatch.setattr(script_modules, "_started_at", lambda: started)
    made: list[str] = []

    def make(where: str, name: str, text: str) -> Path:
        path = tmp_path / where / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        made.append(name)
        return path

    yield make
    for name in made:
        sys.modules.pop(name, None)


def test_a_run_forgets_modules_edited_since_the_process_started_and_no_library(modules):
    old = modules("lib", "nbddp_test_old", "VALUE = 1\n")
    edited = modules("lib", "nbddp_test_edited", "VALUE = 1\n")
    before = time.time() - 3600
    os.utime(old, (before, before))  # last changed before this process started
    import nbddp_test_edited  # noqa: F401
    import nbddp_test_old  # noqa: F401

    edited.write_text("VALUE = 2\n")  # now: after this process started
    dropped = script_modules.forget_for(str(old.parent.parent / "elsewhere"))
    assert "nbddp_test_edited" in dropped and "nbddp_test_old" not in dropped
    assert "json" not in dropped and "torch" in sys.modules  # libraries stay


def test_a_module_beside_the_script_wins_over_one_of_the_same_name_elsewhere(modules):
    elsewhere = modules("lib", "nbddp_test_utils", "WHERE = 'lib'\n")
    beside = modules("proj", "nbddp_test_utils", "WHERE = 'beside'\n")
    before = time.time() - 3600
    os.utime(elsewhere, (before, before))
    import nbddp_test_utils

    assert nbddp_test_utils.WHERE == "lib"
    assert script_modules.forget_for(str(beside.parent)) == ["nbddp_test_utils"]


def test_what_an_earlier_run_imported_is_imported_anew(modules):
    path = modules("lib", "nbddp_test_state", "RUNS = []\n")
    before = time.time() - 3600
    os.utime(path, (before, before))
    known = set(sys.modules)
    import nbddp_test_state  # noqa: F401

    script_modules.remember_imports(known)
    assert script_modules.forget_for(str(path.parent)) == ["nbddp_test_state"]
    assert script_modules.forget_for(str(path.parent)) == []  # once


def test_a_sessions_rank_gets_its_main_argv_and_path_back_and_the_exit_code_is_noted(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text(
        textwrap.dedent(
            """\
            import sys
            assert __name__ == "__main__" and sys.argv == ["exits.py", "7"]
            assert __file__.endswith("/exits.py") and sys.path[0] == __file__.rpartition("/")[0]
            sys.exit(int(sys.argv[1]))
            """
        )
    )
    script = ScriptMain("exits.py", ("7",), str(tmp_path), str(path), path.read_bytes(), "", True)
    main, argv, where, cwd = sys.modules["__main__"], sys.argv, list(sys.path), os.getcwd()
    try:
        with pytest.raises(SystemExit) as info:
            run(script)
        assert sys.modules["__main__"] is main and sys.argv is argv and sys.path == where
        assert report.error_report(info.value).exitcode == 7
        assert report.error_report(SystemExit(7)).exitcode is None  # not the script's
    finally:
        os.chdir(cwd)
