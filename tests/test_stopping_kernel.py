"""Stopping well from a real kernel: the first interrupt of a run that checks stops it
gracefully (a %%ddp cell's names come back, with the warning), a second interrupt ends it at
once, and the one-rank run in the kernel and a session's cell do the same."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.e2e

LOOP = """\
import time
import nbddp
steps = 0
for step in nbddp.progress(range(1_000_000)):
    if step == 20:
        print('training', flush=True)
    time.sleep(0.01)
    steps += 1
stopped = nbddp.stopping()
"""


def interrupt_when(kernel, code: str, marker: str, again_after: str | None = None):
    """Run ``code``, interrupt the kernel when ``marker`` is printed (and once more when
    ``again_after`` is); the output, the reply and how long it took after the interrupt."""
    chunks: list[str] = []
    sent: list[float] = []

    def hook(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            chunks.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            chunks.append("\n".join(msg["content"]["traceback"]))
        text = "".join(chunks)
        first = marker in text and not sent
        second = again_after is not None and again_after in text and len(sent) == 1
        if first or second:
            sent.append(time.monotonic())
            kernel.manager.interrupt_kernel()

    reply = kernel.client.execute_interactive(code, timeout=120, output_hook=hook)
    assert sent, "".join(chunks)
    return "".join(chunks), reply["content"], time.monotonic() - sent[0]


@pytest.mark.parametrize("workers", [2, 1])
def test_the_first_interrupt_stops_a_ddp_cell_gracefully_and_its_names_come_back(kernel, workers):
    kernel.run("%load_ext nbddp")
    stops_gracefully_and_names_come_back(kernel, f"%%ddp -n {workers} --device cpu --display text")


def stops_gracefully_and_names_come_back(kernel, magic: str) -> None:
    """The LOOP cell under ``magic``, interrupted once it trains: it stops gracefully, soon,
    and its names come back."""
    out, reply, took = interrupt_when(kernel, f"{magic}\n{LOOP}", "training")
    assert reply["status"] == "ok", out
    assert "stopped gracefully at step" in out and "asked by the interrupt" in out, out
    assert took < 20
    names, _ = kernel.run("print(steps >= 20, stopped)")
    assert names.strip() == "True True", names


def test_the_first_interrupt_stops_a_session_cell_gracefully_and_its_ranks_stay(kernel):
    kernel.run("%load_ext nbddp\n%ddp_session start -n 2 --device cpu")
    try:
        out, reply = kernel.run("%%ddp --session --max-restarts 1\npass")
        assert reply["status"] == "error" and "--max-restarts belong to a launch" in out, out
        stops_gracefully_and_names_come_back(
            kernel, "%%ddp --session --out steps,stopped --display text"
        )
        # the ranks kept the cell's names: the next cell reads them there
        again, reply = kernel.run("%%ddp --session --out seen\nseen = steps")
        assert reply["status"] == "ok", again
        same, _ = kernel.run("print(seen == steps)")
        assert same.strip() == "True", same
    finally:
        kernel.run("%ddp_session stop")


SLOW_SAVE = """\
import time
def slow_to_save():
    for step in nbddp.progress(range(1_000_000)):
        if step == 20:
            print('training', flush=True)
        time.sleep(0.01)
    print('saving', flush=True)
    time.sleep(120)
"""


def test_a_second_interrupt_ends_the_ranks_at_once(kernel):
    kernel.run("import nbddp\n" + SLOW_SAVE)
    code = "nbddp.notebook_launch(slow_to_save, num_workers=2, device='cpu', display='text')"
    out, reply, took = interrupt_when(kernel, code, "training", again_after="saving")
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", out
    assert took < 30  # not the 120 s of "saving", nor stop_grace's 60
    out, reply = kernel.run("print(nbddp.last_run().status)")
    assert out.strip() == "stopped"
