"""The kernel's side of the ranks' questions, without ranks: which rank the input box serves,
in which order, what it sends back, and that a run's end takes back a question nobody
answered. ``builtins.input`` stands in for the input box; a fake rank files its next
question when it gets its reply, as a rank does."""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from nbddp import NbddpWarning
from nbddp.diagnosis import prompts as prompts_module
from nbddp.diagnosis.prompts import Prompts
from nbddp.wire.prompts import LeftPdb, Prompt, Release, Reply

pytestmark = pytest.mark.unit


def question(rank: int, seq: int, kind: str = "pdb", text: str = "") -> Prompt:
    return Prompt(rank, seq, kind, text, f"(Pdb rank {rank}) ", ("train.py", 7))


class Ranks:
    """Ranks that ask ``asks[rank]`` questions each, then continue (``c``)."""

    def __init__(self, prompts: Prompts, asks: dict[int, int], done: threading.Event) -> None:
        self.prompts = prompts
        self.left = dict(asks)
        self.done = done
        self.sent: list[Any] = []
        prompts.send = self.reply

    def reply(self, message: Any) -> None:
        self.sent.append(message)
        if not isinstance(message, Reply):
            return
        rank = message.rank
        self.left[rank] -= 1
        if self.left[rank]:
            self.prompts.asked(rank, question(rank, message.seq + 1))
        else:
            self.prompts.left(rank, LeftPdb(rank, 0, 0))
            if not any(self.left.values()):
                self.done.set()


def typing(monkeypatch: pytest.MonkeyPatch, answer: Callable[[str], str]) -> list[str]:
    asked: list[str] = []

    def fake_input(prompt: str = "") -> str:
        asked.append(prompt)
        return answer(prompt)

    monkeypatch.setattr(builtins, "input", fake_input)
    return asked


def test_one_ranks_pdb_is_served_until_it_continues_then_the_next(monkeypatch):
    monkeypatch.setattr(prompts_module, "SWITCH_AFTER", 60.0)
    asked = typing(monkeypatch, lambda prompt: "n")
    prompts, done = Prompts(), threading.Event()
    ranks = Ranks(prompts, {1: 3, 0: 2}, done)
    prompts.asked(1, question(1, 1))
    prompts.asked(0, question(0, 1))  # arrives while rank 1 is served: it waits its turn
    started = time.monotonic()
    assert prompts.serve(done, timeout=30)
    # each of rank 1's next questions at once, not after SWITCH_AFTER (on any machine)
    assert time.monotonic() - started < 30
    assert asked == ["(Pdb rank 1) "] * 3 + ["(Pdb rank 0) "] * 2
    assert [m.rank for m in ranks.sent] == [1, 1, 1, 0, 0]
    assert all(m.line == "n" and not m.refused for m in ranks.sent)


def test_a_served_rank_that_runs_on_gives_the_box_to_a_waiting_one(monkeypatch):
    """Rank 0 stepped into a collective (``n``) that waits for rank 1, which sits at its own
    prompt: after ``SWITCH_AFTER`` the box serves rank 1, saying why."""
    monkeypatch.setattr(prompts_module, "SWITCH_AFTER", 0.05)
    prompts, done = Prompts(), threading.Event()
    shown: list[str] = []
    monkeypatch.setattr("sys.stdout.write", shown.append)
    sent: list[Any] = []

    def send(message: Any) -> None:
        sent.append(message)
        if len(sent) == 2:  # rank 1 continued: rank 0's collective completes, it asks again
            prompts.left(1, LeftPdb(1, 0, 0))
            prompts.asked(0, question(0, 2))
        elif len(sent) == 3:
            done.set()

    prompts.send = send
    asked = typing(monkeypatch, lambda prompt: "c" if "1" in prompt else "n")
    prompts.asked(0, question(0, 1))
    prompts.asked(1, question(1, 1))
    assert prompts.serve(done, timeout=10)
    assert asked == ["(Pdb rank 0) ", "(Pdb rank 1) ", "(Pdb rank 0) "]
    assert any("rank 0 runs on without stopping" in text for text in shown)


def test_without_an_input_box_the_loop_answers_at_once_and_warns_once_per_rank():
    prompts, sent = Prompts(), []
    prompts.send = sent.append
    prompts.missing = "no box here"
    prompts.asked(1, question(1, 1))
    prompts.asked(1, question(1, 2))
    prompts.asked(0, question(0, 1, kind="input"))
    assert [m.refused for m in sent] == ["nbddp: no box here."] * 3
    assert all(isinstance(m, Reply) and m.line is None for m in sent)
    with pytest.warns(NbddpWarning) as warned:
        prompts.take_warnings()
    assert len(warned) == 1  # rank 1's breakpoint; input() raises its own EOFError
    assert "rank 1 at train.py, line 7 was skipped" in str(warned[0].message)


def test_a_rank_that_leaves_pdb_releases_the_ranks_it_held():
    prompts, sent = Prompts(), []
    prompts.send = sent.append
    prompts.asked(0, question(0, 1))
    prompts.left(0, LeftPdb(0, 3, 2))
    assert sent == [Release(3, 2)] and not prompts.in_pdb


def test_the_runs_end_takes_back_a_question_nobody_answered(monkeypatch):
    waiting = threading.Event()

    def nobody_answers(prompt: str) -> str:
        waiting.set()
        while True:  # ipykernel polls its stdin socket in Python, as here
            time.sleep(0.01)

    typing(monkeypatch, nobody_answers)
    prompts, done = Prompts(), threading.Event()
    prompts.asked(1, question(1, 1))

    def run_ends() -> None:  # while the box waits for an answer
        if waiting.wait(30):
            done.set()
            prompts.close()

    ender = threading.Thread(target=run_ends)
    ender.start()
    started = time.monotonic()
    assert prompts.serve(done, timeout=60)
    assert waiting.is_set() and time.monotonic() - started < 30  # the end, not the timeout
    ender.join()
