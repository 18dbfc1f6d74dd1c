"""``%%ddp``'s options of stopping well (``--checkpoint-dir``, ``--keep``,
``--max-restarts``, ``--stop-grace``), and a cell's own checkpoint directory: the same at its
next run, so that ``nbddp.restore`` in the cell resumes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from nbddp.recovery import KEEP, STOP_GRACE, default_checkpoint_dir

_ARGUMENTS = (  # IPython's argument() is untyped
    argument(  # type: ignore[no-untyped-call]
        "--checkpoint-dir",
        type=str,
        default=None,
        metavar="DIR",
        help="where nbddp.checkpoint saves (default: one for this cell under "
        "./nbddp-checkpoints/, the same at its next run)",
    ),
    argument("--keep", type=int, default=KEEP, help="complete checkpoints kept"),  # type: ignore[no-untyped-call]
    argument(  # type: ignore[no-untyped-call]
        "--max-restarts",
        type=int,
        default=0,
        help="restart every rank after a failure, up to N times (nbddp.restore resumes)",
    ),
    argument(  # type: ignore[no-untyped-call]
        "--stop-grace",
        type=float,
        default=STOP_GRACE,
        help="seconds a graceful stop may take before the ranks are ended",
    ),
)


def stopping_arguments(magic: Callable[..., Any]) -> Callable[..., Any]:
    """Add the options to a magic's ``@magic_arguments`` (listed as if written there)."""
    for add in reversed(_ARGUMENTS):
        magic = add(magic)
    return magic


def stopping_options(args: Any, shell: Any, cell: str) -> dict[str, Any]:
    """``notebook_launch``'s options from the parsed ones; the cell's own directory."""
    directory = args.checkpoint_dir
    if directory is None:
        directory = default_checkpoint_dir(checkpoint_name(shell, cell))
    return {
        "checkpoint_dir": directory,
        "keep": args.keep,
        "max_restarts": args.max_restarts,
        "stop_grace": args.stop_grace,
    }


def refuse_launch_only(args: Any) -> None:
    """A ``--session`` cell takes ``--stop-grace``; the other options are a launch's."""
    given = {
        "--checkpoint-dir": args.checkpoint_dir is not None,
        "--keep": args.keep != KEEP,
        "--max-restarts": args.max_restarts != 0,
    }
    launch_only = [flag for flag, there in given.items() if there]
    if launch_only:
        raise UsageError(
            f"%%ddp --session: {', '.join(launch_only)} belong to a launch (a session's tasks "
            "checkpoint into ./nbddp-checkpoints/session, and a session replaces the ranks a "
            "task lost by itself). Drop them, or run the cell without --session."
        )


def checkpoint_name(shell: Any, cell: str) -> str:
    """A ``%%ddp`` cell's checkpoint directory name, the same at its next run: from the id
    the front end gives the cell (JupyterLab, VS Code: kept in the notebook, so edits keep
    it), else from its text."""
    import contextlib
    import hashlib

    kernel = getattr(shell, "kernel", None)
    cell_id = None
    with contextlib.suppress(Exception):  # no kernel (a plain IPython), an older one
        cell_id = kernel.get_parent().get("metadata", {}).get("cellId")  # type: ignore[union-attr]
    key = f"id:{cell_id}" if isinstance(cell_id, str) and cell_id else f"text:{cell.strip()}"
    return "cell-" + hashlib.sha1(key.encode()).hexdigest()[:10]
