"""A rank's pdb against a scripted input box (no kernel, no rank): ``q`` on a rank sends
``Quit`` and waits for the run's stop, which comes as an interrupt; that interrupt may land at
any instant after the ``Quit`` went out, and it must always leave pdb. pdb's own command loop
catches a ``KeyboardInterrupt`` and asks again, so one that escaped as such put a second
``(Pdb rank 1)`` in the notebook after ``q`` (seen once in a full suite run)."""

from __future__ import annotations

import sys

import pytest

from nbddp.wire.prompts import Reply
from nbddp.worker.debugging.rank_pdb import RankPdb

pytestmark = pytest.mark.unit


class InputBox:
    """Answers each prompt with the next line; the stop's interrupt lands the moment
    ``Quit`` is sent (the kernel was that quick)."""

    def __init__(self, *lines: str) -> None:
        self.rank = 1
        self.refused = ""
        self.lines = list(lines)
        self.prompts = 0

    def ask(self, kind: str, text: str, prompt: str, at: tuple[str, int]) -> Reply:
        self.prompts += 1
        return Reply(self.rank, self.prompts, self.lines.pop(0) if self.lines else "c")

    def quit(self) -> None:
        raise KeyboardInterrupt  # Quit went out; the interrupt that stops the run lands now

    def left_pdb(self, release: int) -> None:
        pass


def test_an_interrupt_that_lands_as_q_sends_quit_leaves_pdb_without_asking_again():
    box = InputBox("q")
    debugger = RankPdb(box, "pdb")  # type: ignore[arg-type]
    debugger.reset()
    try:
        with pytest.raises(KeyboardInterrupt):
            debugger.interaction(sys._getframe(), None)
    finally:
        sys.settrace(None)
    assert box.prompts == 1
