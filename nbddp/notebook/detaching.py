"""``%%ddp --detach``, the cell's side: what the magic checks, keeps and says for a cell whose
run outlives the kernel.

Non-goal: attaching later (``detached_magic.py``).
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError


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
