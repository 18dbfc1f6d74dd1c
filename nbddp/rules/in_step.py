"""Whether a session's process groups are in step, from the collectives each rank issued.

A task cut short can leave one rank having issued a collective that its peers never matched
(``nbddp/worker/diagnosis/collectives.py``). The ranks are idle, but the next collective would hang
or silently pair with the stale one, so a session keeps its ranks after such a task only when every
member of every process group issued the same number of collectives on it. The check asks nothing
of the ranks beyond what they reported with their answers: no collective, so it can neither hang
nor pair with a stale one.

A rank that did not report, or could not count, cannot be proven in step. Point-to-point
sends and receives count too (gloo numbers them with the collectives): within a group of more
than two ranks, a send between two of them leaves the third behind, so after an interrupted
task such a group counts as out of step and the ranks are restarted, the cautious side.
"""

from __future__ import annotations

from collections.abc import Mapping

from nbddp.wire.messages import GroupCount

Reports = Mapping[int, tuple[GroupCount, ...] | None]


def out_of_step(reports: Reports, world_size: int) -> str | None:
    """None when every group is in step; else what differs, for the user."""
    missing = [rank for rank in range(world_size) if reports.get(rank) is None]
    if missing:
        who = ", ".join(map(str, missing))
        return f"rank {who} could not count its collectives"
    seen: dict[tuple[str, tuple[int, ...]], dict[int, int]] = {}
    for rank, groups in sorted(reports.items()):
        for group in groups or ():
            seen.setdefault((group.name, group.members), {})[rank] = group.issued
    for (name, members), issued in seen.items():
        default = name == "0" and len(members) == world_size  # torch's name for it
        label = "the default process group" if default else f"process group {name!r}"
        absent = [m for m in members if m not in issued]
        if absent:
            who = ", ".join(map(str, absent))
            return f"rank {who} does not have {label} (ranks {_ranks(members)}) that its peers made"
        if len(set(issued.values())) > 1:
            counts = ", ".join(f"rank {r} {n}" for r, n in sorted(issued.items()))
            return f"the ranks issued different numbers of collectives on {label}: {counts}"
    return None


def _ranks(members: tuple[int, ...]) -> str:
    return ", ".join(map(str, members))
