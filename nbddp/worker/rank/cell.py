"""A ``%%ddp`` cell on a rank: run its source like a notebook cell, hand back its names.

The kernel's half (which names go in and out) is ``nbddp/cell.py``; this function travels to
every rank by reference and runs there.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from typing import Any

from nbddp.wire import payload
from nbddp.wire.culprit import locate_unpicklable
from nbddp.worker.context import is_main
from nbddp.worker.output import rich

_MISSING = object()
_SHOWN = "__nbddp_shown__"  # the cell's last value, while the cell runs


@dataclass
class CellOutcome:
    """What rank 0 sends back into the notebook namespace."""

    values: dict[str, Any] = field(default_factory=dict)  # names that travel back
    # names that cannot travel, each with the path to the part that cannot be pickled and why
    # (``lock_made -> _thread.lock``, ``TypeError: ...``), as SerializationError names them
    skipped: dict[str, tuple[str, str]] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)  # names the cell deleted
    shown: Any = None  # the cell's last expression, displayed like a normal cell's


def run_cell(
    source: str,
    filename: str,
    inputs: dict[str, Any],
    out_names: tuple[str, ...],
    show_last: bool,
    deletes: frozenset[str] = frozenset(),
    namespace: dict[str, Any] | None = None,
) -> CellOutcome | None:
    """Run on every rank; rank 0 returns what goes back into the notebook namespace.

    In a session, ``namespace`` is the rank's own, kept between cells: a name the cell reads
    resolves there first, then in ``inputs`` (shipped from the notebook, visible during this
    cell only, as the notebook may change them); a name the cell assigns stays."""
    shipped: dict[str, Any] = {}
    if namespace is None:
        namespace = {"__name__": "__main__", "__builtins__": builtins, **inputs}
    else:
        shipped = {name: value for name, value in inputs.items() if name not in namespace}
        namespace.update(shipped)
    tree = ast.parse(source, filename)
    last = tree.body[-1] if show_last and tree.body else None
    if isinstance(last, ast.Expr):  # kept in the cell's code: pdb steps onto it like any line
        tree.body[-1] = ast.copy_location(
            ast.Assign([ast.Name(_SHOWN, ast.Store())], last.value), last
        )
        ast.fix_missing_locations(tree)
    try:
        exec(compile(tree, filename, "exec"), namespace)
    finally:
        shown = namespace.pop(_SHOWN, None)
        for name, value in shipped.items():
            if namespace.get(name, _MISSING) is value:  # read, not rebound: the notebook's
                del namespace[name]
    if not is_main():
        return None
    outcome = CellOutcome()
    for name in out_names:
        if name not in namespace:  # deleted by the cell, or never bound (a branch not taken)
            if name in deletes:
                outcome.deleted.append(name)
            continue
        value = namespace[name]
        failure = payload.check_picklable(value)
        if failure is None:
            outcome.values[name] = value
        else:
            outcome.skipped[name] = locate_unpicklable(
                value, name, failure, payload.check_picklable
            )
    if shown is not None and payload.check_picklable(shown) is not None:
        rich.show_value(shown)  # shown from here, as its MIME bundle, since it cannot travel
        shown = None
    outcome.shown = shown
    return outcome
