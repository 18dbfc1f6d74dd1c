"""``Session.status()``: each rank's process, memory and answer, and where the running task is.

Non-goal: the table ``%ddp_session status`` prints (``notebook/session_magic.py``).
"""

from __future__ import annotations

from typing import Any

from nbddp.diagnosis.stacks import Stacks
from nbddp.run import Run
from nbddp.sessions.ranks import PROBE_WAIT, SessionRanks


class SessionStatus(list[dict[str, Any]]):
    """A row per rank, and the running task's roll-call (``stacks``; None when idle)."""

    stacks: Stacks | None = None


def session_status(
    world_size: int, ranks: SessionRanks | None, active: Run | None, restarted: str | None
) -> SessionStatus:
    rows = SessionStatus()
    if ranks is None:
        return rows
    alive = ranks.alive
    answers = ranks.probe() if alive else {}
    if alive and active is not None and active.status == "running":
        rows.stacks = active.stacks(timeout=PROBE_WAIT)
    for rank in range(world_size):
        answer = answers.get(rank)
        rows.append(
            {
                "rank": rank,
                "pid": ranks.pids.get(rank),
                "alive": alive,
                "busy": answer.busy if answer is not None else None,
                "memory": answer.memory if answer is not None else None,
                "device_memory": answer.device_memory if answer is not None else None,
                "restarted": restarted,
                "where": rows.stacks.place(rank) if rows.stacks is not None else None,
            }
        )
    return rows
