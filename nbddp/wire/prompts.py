"""A rank that waits for a line typed in the notebook: pdb's prompt, ``input()``, and the other
ranks held at ``nbddp.breakpoint()`` while one is debugged.

A rank has no terminal; the kernel is the one process that can ask the frontend for input (its
input box, an ``input_request`` on the stdin channel). So a rank asks the kernel, which asks
the person and sends the line back:

    Prompt(rank, seq, kind, text, prompt, at)     rank -> kernel: ``text`` (what pdb wrote
                                                  since its last prompt) is shown, then the
                                                  input box asks ``prompt``
    Reply(rank, seq, line, refused)               kernel -> every rank (the one asked takes
                                                  it): the line typed; None at the end of
                                                  input, or with ``refused`` (why) where no
                                                  input box exists
    LeftPdb(rank, task, release)                  rank -> kernel: pdb continued; ``release``:
                                                  the ``nbddp.breakpoint()`` call the other
                                                  ranks wait at, if any
    Release(task, call)                           kernel -> every rank: whoever waits at its
                                                  ``call``-th ``nbddp.breakpoint()`` goes on
    Quit(rank)                                    rank -> kernel: ``q`` in pdb: stop the run

A reply carries the prompt's number (``seq``), so a late reply to a question that an interrupt
cut short is never taken for the next one's; ``task`` keeps a session's tasks apart (0 in a
launch).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

PromptKind = Literal["pdb", "post-mortem", "input"]


class Prompt(NamedTuple):
    rank: int
    seq: int  # this rank's question number
    kind: str  # a PromptKind
    text: str  # shown before the prompt: pdb's output since its last prompt
    prompt: str  # what the input box says: "(Pdb rank 1) ", or input()'s argument
    at: tuple[str, int]  # (file, line) the rank stopped at, for warnings and the panel


class Reply(NamedTuple):
    rank: int
    seq: int
    line: str | None  # None: end of input (Ctrl-D), or no input box (``refused``)
    refused: str = ""  # why nobody can answer: the rank skips its breakpoints, input() raises


class LeftPdb(NamedTuple):
    rank: int
    task: int
    release: int  # the nbddp.breakpoint() call this rank held the others at; 0: none


class Release(NamedTuple):
    task: int
    call: int


class Quit(NamedTuple):
    rank: int
