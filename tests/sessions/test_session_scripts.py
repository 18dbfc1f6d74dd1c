"""``Session.run_script``: a script on a session's ranks, run after run: its module state is
fresh each time (a module beside it that keeps state, or was edited, is imported anew; one of
the same name that an earlier task imported from elsewhere does not shadow it), its
``sys.exit()`` ends the task, never the rank, and the rank's own ``__main__``, ``sys.argv``
and namespace are as they were (real rank processes, 2 CPU ranks)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import nbddp
from nbddp import WorkerError

pytestmark = pytest.mark.ranks
QUIET = {"display": "none"}

SCRIPT = """\
import os, sys
import torch
import torch.distributed as dist
import state, utils

dist.init_process_group("gloo")  # the session's group answers
total = torch.ones(1)
dist.all_reduce(total)
state.RUNS.append(sys.argv[1:])
print(f"rank {dist.get_rank()}: runs {len(state.RUNS)} {state.NOTE} {utils.WHERE} "
      f"sum {total.item():.0f}", flush=True)
if sys.argv[1:] == ["--fail"] and dist.get_rank() == 1:
    sys.exit(4)
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# notebook code (module ``__main__``): it travels by value and runs in the ranks' namespace
NOTEBOOK: dict = {"__name__": "__main__"}
exec(
    textwrap.dedent(
        """\
        import sys

        def the_ranks_own():
            main = sys.modules["__main__"]
            return sys.argv, getattr(main, "__file__", None), sys.path[:2]

        def keeps(value):
            global kept
            kept = value

        def held():
            return kept

        def imports_utils_from_the_working_directory():
            import utils
            return utils.WHERE
        """
    ),
    NOTEBOOK,
)


def test_runs_of_a_script_on_a_session_each_start_afresh(tmp_path, monkeypatch, capfd):
    script = write(tmp_path / "proj" / "train.py", SCRIPT)
    write(tmp_path / "proj" / "state.py", "RUNS = []\nNOTE = 'first'\n")
    write(tmp_path / "proj" / "utils.py", "WHERE = 'beside'\n")
    write(tmp_path / "work" / "utils.py", "WHERE = 'the working directory'\n")
    monkeypatch.chdir(tmp_path / "work")
    with nbddp.Session(num_workers=2, device="cpu") as session:
        session.run(NOTEBOOK["keeps"], (7,), **QUIET)
        before = session.run(NOTEBOOK["the_ranks_own"], **QUIET)
        # an earlier task imported another ``utils``, from the working directory
        where = session.run(NOTEBOOK["imports_utils_from_the_working_directory"], **QUIET)
        assert where == "the working directory"
        assert session.run_script(script, ["--a"], **QUIET) == 0
        assert "rank 0: runs 1 first beside sum 2" in capfd.readouterr().out
        write(tmp_path / "proj" / "state.py", "RUNS = []\nNOTE = 'second, edited'\n")
        assert session.run_script(script, ["--b"], **QUIET) == 0  # not "runs 2": fresh state
        assert "rank 0: runs 1 second, edited beside sum 2" in capfd.readouterr().out
        with pytest.raises(WorkerError) as info:
            session.run_script(script, ["--fail"], **QUIET)
        assert (info.value.rank, info.value.exitcode) == (1, 4)
        assert (
            f'File "{script}", line 13, in <module>\n    sys.exit(4)' in info.value.remote_traceback
        )
        # the ranks are the same, idle, with what they held
        assert session.alive and session.run(NOTEBOOK["the_ranks_own"], **QUIET) == before
        assert session.run(NOTEBOOK["held"], **QUIET) == 7
