"""What travels for a graceful stop and for checkpoints (``nbddp.stopping``,
``nbddp.checkpoint``), kernel <-> rank. Both sides import this module; it imports nothing.

The agreement, in messages (``worker/recovery/stopping.py`` says why it is safe):

    StopAsked()                   kernel -> every rank: a graceful stop is asked
    Checks(rank, checks)          rank -> kernel, from its listener thread, at once: how many
                                  checks (``stopping()`` calls, ``progress`` steps, trainer
                                  steps) the rank had passed when it heard; 0: it never checked
    StopAt(check)                 kernel -> every rank: the agreed check, one past the largest
                                  count; every rank's check number ``check`` is True
    StoppedAt(rank, step, where)  rank -> kernel, once: the rank's first True check, with the
                                  step its caller counts (a bar's position, a trainer's step)

    StopRequested(rank, why)      rank -> kernel: a signal asked this rank for a graceful stop
                                  (Slurm's before the time limit: ``--signal=USR1@T``)

    Checkpointed(rank, step, path, seconds, restored, by)   rank 0 -> kernel: a complete
                                  checkpoint (``restored``: the one ``restore`` loaded); ``by``
                                  names the library that saved it ("": ``nbddp.checkpoint``)
"""

from __future__ import annotations

from typing import NamedTuple


class StopAsked(NamedTuple):
    pass


class Checks(NamedTuple):
    rank: int
    checks: int  # 0: it never checked


class StopAt(NamedTuple):
    check: int


class StoppedAt(NamedTuple):
    rank: int
    step: int
    where: str  # what checked: "nbddp.stopping()", "nbddp.progress", "the HF Trainer", ...


class StopRequested(NamedTuple):
    rank: int
    why: str


class Checkpointed(NamedTuple):
    rank: int
    step: int
    path: str
    seconds: float
    restored: bool = False
    by: str = ""  # a library's own save ("the Hugging Face Trainer"...): "" nbddp.checkpoint
