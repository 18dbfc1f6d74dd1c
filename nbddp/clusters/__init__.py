"""Ranks on a cluster engine: one folder per engine, each reusing ``local``'s rank group on its
nodes."""

from nbddp.errors import NbddpError


class NodeGone(NbddpError):
    """A cluster node's helper is gone (its node lost, or it was killed): what an engine's
    call raises, and what a run reports as the loss of that node's ranks."""
