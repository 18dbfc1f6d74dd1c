"""The kernel and its pre-warmed helper (``local/forkserver.py``, ``worker/forkserver.py``): the
messages of their own wire, beside the ranks' (``messages.py``).

Non-goal: the ranks' messages.
"""

from __future__ import annotations

from typing import NamedTuple


class Spawn(NamedTuple):
    """Kernel -> helper: fork a rank running ``argv`` with ``env``; its stdout and stderr pipe
    ends ride on the frame."""

    request: int
    argv: list[str]
    env: dict[str, str]


class Release(NamedTuple):
    """Kernel -> helper: the rank ended and was seen to end; reap it."""

    pid: int


class Ready(NamedTuple):
    """Helper -> kernel: torch is imported, requests are served from now on."""

    pid: int


class Spawned(NamedTuple):
    request: int
    pid: int


class SpawnFailed(NamedTuple):
    request: int
    reason: str


class Exited(NamedTuple):
    """Helper -> kernel: a rank ended (negative code: the signal); it stays unreaped until
    released, so its pid stays the kernel's to signal."""

    pid: int
    code: int
