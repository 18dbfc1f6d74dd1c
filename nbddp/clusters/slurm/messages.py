"""The kernel and a Slurm node's helper: the messages of their connection (``link.py`` on the
kernel's side, ``node.py`` on the node's), framed and authenticated by ``wire/transport.py``.

Non-goal: the ranks' messages, which ride inside as the values of calls.
"""

from __future__ import annotations

from typing import Any, NamedTuple

ADDRESS_VARIABLE = "NBDDP_HELPER_ADDRESS"  # tcp:host:port of the kernel's listener
KEY_VARIABLE = "NBDDP_HELPER_KEY"  # hex of the handshake's key (never on a command line)
NODES_VARIABLE = "NBDDP_HELPER_NODES"  # name=address,... : each node's address, as Slurm has it


class NodeHello(NamedTuple):
    """Node -> kernel, first: which node this helper serves."""

    node: str
    pid: int


class NodeCall(NamedTuple):
    """Kernel -> node: call ``method`` of the node's ``NodeCore``. Where an argument is
    :data:`OUT_OF_BAND`, the frame's buffers go (the call's bytes, sent as they are)."""

    request: int
    method: str
    args: tuple[Any, ...]


class NodeReply(NamedTuple):
    """Node -> kernel: a call's value, or the exception it raised."""

    request: int
    value: Any
    error: BaseException | None


OUT_OF_BAND = "nbddp:out-of-band-buffers"
