"""Where the ranks of a plan run: the one place that picks it, for launches, sessions and a
detached run's supervisor alike (a test holds that sessions reach their ranks through it
alone). Each engine is imported only when a plan names it."""

from __future__ import annotations

from nbddp.backend import Ranks
from nbddp.local.processes import Starter
from nbddp.local.ranks import local_ranks
from nbddp.plan import LaunchPlan
from nbddp.wire.call import Call


def ranks_for(
    plan: LaunchPlan, call: Call, session: bool = False, starter: Starter | None = None
) -> Ranks:
    """Where the ranks of ``plan`` run: processes on this machine, or on the nodes of
    ``plan.cluster`` through its engine (``session``: ranks that stay up and take tasks).
    Nothing starts, and nothing is opened, until their ``start``. ``starter``: how this
    machine's ranks are started (a detached run's supervisor has a helper of its own)."""
    if plan.cluster is None:
        return local_ranks(plan, call, starter, session=session)
    from nbddp.clusters.ranks import cluster_ranks  # Ray or Slurm, imported when named

    return cluster_ranks(plan, call, session)
