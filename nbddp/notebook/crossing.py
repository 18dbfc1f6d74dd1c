"""What crosses a ``%%ddp`` cell's boundary: the notebook's values of the names the cell reads
(each checked to travel, the first that cannot named with where it fails), and the names it
brings back (one that cannot come back is unbound, never left at a stale value, and the cell
says why).

Non-goal: which names a cell reads and writes (``cell.py``) or running it (``magic.py``).
"""

from __future__ import annotations

from typing import Any

from nbddp.errors import SerializationError
from nbddp.notebook import cell as cells
from nbddp.wire import payload
from nbddp.wire.culprit import locate_unpicklable
from nbddp.worker.rank.cell import CellOutcome


def out_names(
    args: Any,
    names: cells.CellNames,
    filename: str,
    held: frozenset[str],
    default: tuple[str, ...] | None = None,
) -> tuple[str, ...]:
    """What comes back: ``--out`` names, or every name the cell assigns (``default``
    otherwise: nothing, in a session)."""
    if args.no_out:
        return ()
    if args.out is None:
        return names.writes if default is None else default
    out_names = tuple(n.strip() for n in args.out.split(",") if n.strip())
    never = [n for n in out_names if n not in names.writes and n not in held]
    if never:
        cells.warn_in_cell(
            f"--out {', '.join(never)}: the cell never assigns {_them(never)}, so "
            f"{_it_they(never)} cannot come back.",
            filename,
            1,
        )
    return out_names


def inputs(
    user_ns: dict[str, Any],
    names: cells.CellNames,
    held: frozenset[str],
    to: str = "the workers",
) -> dict[str, Any]:
    """The notebook's values of the names the cell reads (those the ranks hold resolve
    there and are not shipped)."""
    inputs = {n: user_ns[n] for n in sorted(names.reads - held) if n in user_ns}
    return _travelling_inputs(inputs, rebound=set(names.writes), to=to)


def bring_back(
    user_ns: dict[str, Any], outcome: CellOutcome, source: str, filename: str, session: bool
) -> Any:
    """Put the cell's names into the notebook. A name that cannot travel is unbound
    there: its value from before the cell would be a stale lie."""
    user_ns.update(outcome.values)
    for name in outcome.deleted:
        user_ns.pop(name, None)
    names = [n for n in outcome.skipped if n.isidentifier()]  # not the last value
    for name in names:
        user_ns.pop(name, None)
    if outcome.skipped:
        cells.warn_in_cell(
            _not_back_message(outcome.skipped, names, session),
            filename,
            cells.binding_line(source, names[0]) if names else 1,
        )
    return outcome.shown


def _not_back_message(skipped: dict[str, tuple[str, str]], names: list[str], session: bool) -> str:
    """``%%ddp could not bring back x: x -> _thread.lock cannot be pickled (...)``, and what
    that means for the notebook's name."""
    parts = "; ".join(f"{path} cannot be pickled ({reason})" for path, reason in skipped.values())
    message = f"%%ddp could not bring back {', '.join(skipped)}: {parts}."
    if names:
        where = (
            f"{_it_they(names)} {'stays' if len(names) == 1 else 'stay'} on the session's ranks"
            if session
            else f"the ranks that held {_them(names)} have ended"
        )
        message += (
            f" {', '.join(names)} {'is' if len(names) == 1 else 'are'} now unbound in the "
            f"notebook (not left at {_its_their(names)} value from before the cell); {where}."
            " Keep such objects inside the cell, or bring back something picklable made "
            "from them."
        )
    return message


def _it_they(names: list[str]) -> str:
    return "it" if len(names) == 1 else "they"


def _them(names: list[str]) -> str:
    return "it" if len(names) == 1 else "them"


def _its_their(names: list[str]) -> str:
    return "its" if len(names) == 1 else "their"


def _travelling_inputs(
    inputs: dict[str, Any], rebound: set[str], to: str = "the workers"
) -> dict[str, Any]:
    """Check every input once; name the first that cannot travel. A name the cell binds
    itself may not need its old value: drop it instead (a real need shows as NameError)."""
    kept = {}
    for name, value in inputs.items():
        failure = payload.check_picklable(value)
        if failure is None:
            kept[name] = value
        elif name not in rebound:
            path, reason = locate_unpicklable(value, name, failure, payload.check_picklable)
            raise SerializationError(f"the %%ddp cell's input {name!r} to {to}", path, reason)
    return kept
