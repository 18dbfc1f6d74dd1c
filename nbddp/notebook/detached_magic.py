"""Detached runs in a notebook: what ``%%ddp --detach`` checks, keeps and says for a cell whose
run outlives the kernel (``magic.py`` calls them), and ``%ddp_attach`` and ``%ddp_runs``.

    %%ddp --detach -n 2 --device cpu      # prints the run's id; the run outlives the kernel
    ...
    %ddp_runs                             # the table of nbddp.runs()
    %ddp_attach 3f9a2c1b                  # its live view, then the cell's names come back

An interrupt while ``%ddp_attach`` waits stops following the run, never the run itself.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from nbddp.detached.attached import attach
from nbddp.detached.info import runs
from nbddp.detached.store import find
from nbddp.notebook import cell as cells
from nbddp.notebook import crossing
from nbddp.plan import DISPLAYS

_USAGE = "%ddp_attach RUN_ID [--display auto|widget|text|none]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # a UsageError in the cell, not SystemExit
        raise UsageError(f"%ddp_attach: {message}. Usage: {_USAGE}")


@magics_class
class DetachedMagics(Magics):
    @line_magic
    def ddp_attach(self, line: str) -> Any:
        """Follow a detached run (``%%ddp --detach``, ``detach=True``) in this cell: its live
        view from the start, until it ends; then a cell's names come back into the notebook
        (a function's value is the cell's value). Interrupting stops following, not the run."""
        parser = _Parser(prog="%ddp_attach", add_help=False)
        parser.add_argument("run_id")
        parser.add_argument("--display", choices=DISPLAYS, default="auto")
        args = parser.parse_args(shlex.split(line))
        try:
            run = attach(args.run_id, display=args.display)
        except ValueError as exc:
            raise UsageError(f"%ddp_attach: {exc}") from None
        try:
            run.wait()
        except KeyboardInterrupt:
            print(
                f"Stopped following run {run.id}; it goes on. %ddp_attach {run.id} follows it "
                f"again, nbddp.attach({run.id!r}).stop() ends it."
            )
            raise
        info = find(run.id).info
        if info.get("kind") != "cell":
            return run.result()
        filename = str(info["filename"])
        cell = str(info["cell"])
        cells.register_source(filename, f"%%ddp {info.get('line', '')}\n" + cell)
        outcome = run.result()
        assert self.shell is not None
        return crossing.bring_back(self.shell.user_ns, outcome, "\n" + cell, filename, False)

    @line_magic
    def ddp_runs(self, line: str) -> Any:
        """The table of your detached runs (``nbddp.runs()``): id, name, status, progress."""
        if line.strip():
            raise UsageError("%ddp_runs takes no arguments.")
        from IPython.display import display

        display(runs())  # type: ignore[no-untyped-call]


# -- %%ddp --detach, the cell's side ----------------------------------------------------------


def check_detach(args: Any) -> None:
    """``--detach`` with an option it cannot go with: a UsageError before anything starts."""
    if args.detach and (args.session or args.export is not None):
        raise UsageError(
            "%%ddp --detach starts ranks of its own outside this kernel; it cannot run "
            f"{'on the session' if args.session else 'as an export'}. Drop one of them."
        )


def kept_cell(shell: Any, line: str, cell: str, filename: str) -> dict[str, Any]:
    """What a later kernel needs to bring the cell's names back (``%ddp_attach``)."""
    label = f"In[{shell.execution_count}]"
    return {
        "name": f"%%ddp {label}",
        "kind": "cell",
        "line": line,
        "cell": cell,
        "filename": filename,
    }


def announce(run: Any) -> None:
    """The cell's output: the run's id and how to come back to it."""
    print(
        f"Detached run {run.id}: it goes on if this kernel stops. "
        f"%ddp_attach {run.id} shows it and brings its names back."
    )
