"""How many collectives a session's rank has issued on each of its process groups.

After a task that was cut short (a peer failed, Stop, a timeout, the kernel's interrupt), a rank
can be back at idle having issued a collective its peers never matched: the interrupt landed
between torch issuing it and waiting for it. The group is then out of step, and the next
collective hangs or pairs with the stale one. torch numbers the collectives of each process
group (``ProcessGroup._get_sequence_number_for_group``, counted when a collective is issued,
DDP's own gradient all-reduces included), so each rank reports that number for every group it
is a member of, with the group's members; the kernel keeps the ranks only when every member
of every group reports the same number (``nbddp/rules/in_step.py``). A rank reports after a task
only when its numbers changed (most tasks issue no collective): the kernel keeps the last report.

Non-goals: judging anything here (the kernel compares the ranks), and counting by wrapping
``torch.distributed``'s functions (DDP issues its collectives from C++, past any wrapper).
"""

from __future__ import annotations

import sys

from nbddp.wire.frames import Connection
from nbddp.wire.messages import GroupCount, Issued

_NEVER = object()


def issued() -> tuple[GroupCount, ...] | None:
    """Each process group this rank is a member of, with how many collectives it issued on
    it; None when they cannot be counted (a torch without the sequence numbers)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:  # torch.distributed never imported: no group, nothing issued
        return ()
    try:
        world = c10d._world
        return tuple(
            GroupCount(name, tuple(sorted(world.pg_group_ranks[group])), count(group))
            for group, name in list(world.pg_names.items())
        )
    except Exception:  # torch's internals moved: the kernel then keeps no ranks it cannot judge
        return None


def count(group: object) -> int:
    """The group's sequence number: how many collectives this rank issued on it."""
    return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]


class Reporter:
    """Tells the kernel this rank's numbers after a task, when they changed since it last did."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._last: object = _NEVER

    def report(self, conn: Connection) -> None:
        groups = issued()
        if groups != self._last:
            conn.send(Issued(self._rank, groups))
            self._last = groups
