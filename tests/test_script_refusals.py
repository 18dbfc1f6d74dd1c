"""``nbddp.run_script`` refuses what cannot work before anything starts (no process, no run
directory), each time saying what to do instead: a missing script or module, a directory, a
script that does not compile, arguments that are not strings, options a script has no use
for, options that contradict each other."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import starts_nothing

import nbddp

pytestmark = pytest.mark.unit
TWO = {"num_workers": 2, "device": "cpu", "display": "none"}


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


def refused(*args, **options) -> str:
    with starts_nothing(), pytest.raises(ValueError) as info:
        nbddp.run_script(*args, **{**TWO, **options})
    return str(info.value)


def test_a_missing_script_is_named_with_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = refused("nowhere/train.py")
    assert message.startswith("no script nowhere/train.py")
    assert str(tmp_path / "nowhere" / "train.py") in message


def test_a_module_named_as_a_script_is_pointed_to_module_true(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = refused("json.tool")
    assert "json.tool is a module: pass module=True (%ddp_run -m json.tool)" in message


def test_a_directory_and_a_script_that_does_not_compile(tmp_path, script):
    assert "is a directory" in refused(tmp_path)
    script.write_text("def broken(:\n    pass\n")
    with starts_nothing(), pytest.raises(SyntaxError) as info:
        nbddp.run_script(script, **TWO)
    assert (info.value.filename, info.value.lineno) == (str(script), 1)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ("--lr 0.1", "shlex.split('--lr 0.1') splits a command line"),
        (["--lr", 0.1], "args[1]=0.1 is not a string (float)"),
        (["--data", Path("data")], "Pass 'data'"),
        (None, "must be a list of strings"),
    ],
)
def test_arguments_must_be_strings(script, args, says):
    assert says in refused(script, args)


def test_a_module_must_exist_and_be_runnable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "no module named 'no_such_module_here'" in refused("no_such_module_here", module=True)
    assert "no module named 'json.no_such'" in refused("json.no_such", module=True)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "__init__.py").write_text("")
    assert "bare is a package without a __main__.py" in refused("bare", module=True)
    assert "file's path: drop module=True" in refused("pkg/train.py", module=True)
    assert "module='yes' must be True" in refused("json.tool", module="yes")


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"return_all": True}, "run_script takes no return_all=: a script's ranks return no"),
        ({"kwargs": {}}, "in args= (sys.argv[1:])"),
        ({"nprocs": 2}, "unknown option nprocs=. It takes script, args=, module= and"),
        ({"detach": True, "block": True}, "drop block=True (run.wait() waits"),
        ({"num_workers": 0}, "num_workers=0 must be at least 1"),
        ({"nodes": 2}, "place ranks on a cluster"),
    ],
)
def test_options_a_script_cannot_use_or_that_contradict_are_refused(script, options, says):
    assert says in refused(script, **options)
