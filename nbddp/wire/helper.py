"""The kernel and its pre-warmed helper (``local/forkserver.py``, ``worker/helper/server.py``): the
messages of their own wire, beside the ranks' (``messages.py``).

Non-goal: the ranks' messages.
"""

from __future__ import annotations

from typing import NamedTuple


class Spawn(NamedTuple):
    """Kernel -> helper: fork a rank running ``argv`` with ``env``; its stdout and stderr pipe
    ends ride on the frame. ``detached``: a detached run's supervisor instead, outside every
    process tree (its link to the kernel rides third on the frame, as its descriptor 3); the
    reply's pid is then that of the middle child, already reaped."""

    request: int
    argv: list[str]
    env: dict[str, str]
    detached: bool = False


class Preload(NamedTuple):
    """Kernel -> helper: modules the notebook imported (in their import order), to import
    between launches; the notebook's ``sys.path``; packages or modules never to import."""

    modules: list[str]
    sys_path: list[str]
    exclude: list[str]


class Release(NamedTuple):
    """Kernel -> helper: the rank ended and was seen to end; reap it."""

    pid: int


class Ready(NamedTuple):
    """Helper -> kernel: torch is imported, requests are served from now on."""

    pid: int


class Preloading(NamedTuple):
    """Helper -> kernel: it imports ``module`` now (progress while a launch waits, and the
    culprit's name if the helper hangs or dies there)."""

    module: str


class Preloaded(NamedTuple):
    """Helper -> kernel: nothing left to import; ``modules``: how many it holds."""

    modules: int


class Unsafe(NamedTuple):
    """Helper -> kernel: importing ``module`` made forking unsafe (``reason``: a thread, CUDA,
    a process); the helper forks no more, the kernel starts a fresh one without it."""

    module: str
    reason: str


class Handoff(NamedTuple):
    """Helper -> a child it forked: become a rank running ``argv`` with ``env``, after dropping
    the modules in ``drop`` (local ones edited since the helper imported them); the stdout and
    stderr pipe ends ride on the frame."""

    argv: list[str]
    env: dict[str, str]
    drop: list[str]
    detached: bool = False  # a detached run's supervisor (``worker/helper/leaving.py``), not a rank


class Imported(NamedTuple):
    """A rank -> its helper, as it exits: the modules it imported that the helper lacks, and
    its ``sys.path``."""

    modules: list[str]
    sys_path: list[str]


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
