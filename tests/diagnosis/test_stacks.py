"""Why is it stuck? Where every rank is, on demand (``run.stacks()``) and when progress stops
(the stall banner), in a real kernel with gloo on the CPU: the roll-call names the odd rank
and the cell lines the user wrote."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import starts_nothing, wait_until

# Which collective a rank waits in comes from torch's flight recorder (for gloo: torch >= 2.8).
FLIGHT_RECORDER = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")

# Waits until the roll-call says all of ``until`` (the ranks reached their places), then prints it;
# ``run`` is a running launch.
ROLLCALL = (
    "deadline = time.time() + 90\n"
    "while True:\n"
    "    s = run.stacks()\n"
    "    if all(u in str(s) for u in {until!r}) or time.time() > deadline:\n"
    "        break\n"
    "    time.sleep(0.3)\n"
    "print(s)\n"
    "print('status:', run.status)\n"
    "run.stop()\n"
    "if run.status == 'failed':\n"
    "    try:\n"
    "        run.result()\n"
    "    except Exception as error:\n"
    "        print('error:', error)\n"
)


def define(kernel, source: str) -> int:
    """Run a cell that defines functions; its ``In[n]``."""
    out, reply = kernel.run(source)
    assert reply["status"] == "ok", out
    return reply["execution_count"]


def rollcall_of(kernel, fn: str, until: list[str], n: int = 2, extra: str = "") -> str:
    out, reply = kernel.run(
        f"run = nbddp.notebook_launch({fn}, num_workers={n}, device='cpu', block=False, "
        f"display='none'{extra})\n" + ROLLCALL.format(until=until),
        timeout=150,
    )
    assert reply["status"] == "ok", out
    return out


@pytest.mark.e2e
@pytest.mark.smoke
def test_a_rank_that_skips_an_all_reduce_is_named_with_both_lines(kernel):
    """Rank 1 takes another branch and waits there; ranks 0 and 2 wait for it in all_reduce.
    (A rank that meets a different collective instead is the next test's: gloo may abort on
    the mismatched messages rather than wait, so it is not used with three ranks here.)"""
    n = define(
        kernel,
        "import torch.distributed as dist\n"
        "def skipping():\n"
        "    t = torch.ones(3)\n"
        "    if nbddp.rank() != 1:\n"
        "        dist.all_reduce(t)\n"
        "    else:\n"
        "        time.sleep(600)\n",
    )
    if not FLIGHT_RECORDER:  # where each waits is known, not which collective: it says so
        out = rollcall_of(kernel, "skipping", ["time.sleep", "in all_reduce()"], n=3)
        assert f"ranks 0, 2 are at Cell In[{n}], line 5 in all_reduce()" in out, out
        assert "no flight recorder for this backend (torch >= 2.8 has one)" in out, out
    else:
        out = rollcall_of(kernel, "skipping", ["time.sleep", "wait in all_reduce"], n=3)
        assert re.search(
            rf"ranks 0, 2 wait in all_reduce \(#\d+, \[3\]\) at Cell In\[{n}\], line 5", out
        ), out
        assert re.search(r"rank 1 never entered all_reduce #\d+", out), out
    assert f"rank 1 is at Cell In[{n}], line 7 in time.sleep(600)" in out, out
    assert "rank 1 is the odd one out" in out
    assert "nbddp/" not in out  # nbddp's own frames are hidden


@pytest.mark.e2e
def test_ranks_calling_collectives_in_a_different_order(kernel):
    n = define(
        kernel,
        "import torch.distributed as dist\n"
        "def reordered():\n"
        "    t = torch.ones(2)\n"
        "    if nbddp.rank() == 0:\n"
        "        dist.all_reduce(t)\n"
        "        dist.broadcast(t, 0)\n"
        "    else:\n"
        "        dist.broadcast(t, 0)\n"
        "        dist.all_reduce(t)\n",
    )
    out = rollcall_of(kernel, "reordered", ["is not the same"])
    assert re.search(
        rf"rank 0 waits in all_reduce \(#\d+, \[2\]\) at Cell In\[{n}\], line 5", out
    ), out
    assert re.search(
        rf"rank 1 waits in broadcast \(#\d+, \[2\]\) at Cell In\[{n}\], line 8", out
    ), out
    assert re.search(r"collective #\d+ is not the same on every rank", out), out


@pytest.mark.e2e
def test_a_rank_asleep_or_blocked_on_a_lock(kernel):
    n = define(
        kernel,
        "import threading\n"
        "import torch.distributed as dist\n"
        "def blocked(how):\n"
        "    lock = threading.Lock()\n"
        "    lock.acquire()\n"
        "    if nbddp.rank() == 1:\n"
        "        if how == 'lock':\n"
        "            lock.acquire()\n"
        "        else:\n"
        "            time.sleep(600)\n"
        "    dist.barrier()\n",
    )
    out = rollcall_of(kernel, "blocked", ["lock.acquire()", "waits in"], extra=", args=('lock',)")
    assert f"rank 1 is at Cell In[{n}], line 8 in lock.acquire()" in out, out
    assert re.search(rf"rank 0 waits in barrier \(#\d+\) at Cell In\[{n}\], line 11", out), out
    assert "rank 1 is the odd one out" in out
    assert re.search(r"rank 1 never entered barrier #\d+", out), out
    out = rollcall_of(kernel, "blocked", ["time.sleep", "waits in"], extra=", args=('sleep',)")
    assert f"rank 1 is at Cell In[{n}], line 10 in time.sleep(600)" in out, out


@pytest.mark.e2e
def test_a_rank_holding_the_gil_is_dumped_by_the_signal(kernel):
    """A regex that backtracks for minutes never lets the rank's listener thread run."""
    n = define(
        kernel,
        "import re\n"
        "import torch.distributed as dist\n"
        "def hogging():\n"
        "    if nbddp.rank() == 1:\n"
        "        re.match(r'(a+)+$', 'a' * 40 + 'b')\n"
        "    dist.barrier()\n",
    )
    out = rollcall_of(kernel, "hogging", ["in match()", "waits in"])
    assert f"rank 1 is at Cell In[{n}], line 5 in match()" in out, out
    assert "faulthandler" in out
    assert "rank 1 is the odd one out" in out


@pytest.mark.e2e
def test_a_deadlocked_dataloader_worker_is_shown_under_its_rank(kernel):
    n = define(
        kernel,
        "import torch.distributed as dist\n"
        "class Stuck(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 4\n"
        "    def __getitem__(self, i):\n"
        "        if nbddp.rank() == 1:\n"
        "            time.sleep(600)\n"
        "        return torch.ones(2)\n"
        "def loading():\n"
        "    loader = torch.utils.data.DataLoader(Stuck(), num_workers=1)\n"
        "    for batch in loader:\n"
        "        dist.all_reduce(batch)\n",
    )
    out = rollcall_of(kernel, "loading", ["__getitem__", "waits in"])
    assert re.search(
        rf"rank 0 waits in all_reduce \(#\d+, \[1, 2\]\) at Cell In\[{n}\], line 12", out
    ), out
    assert f"rank 1 is at Cell In[{n}], line 11 in __next__()" in out, out
    worker = out[out.index("rank 1:") :]
    assert "DataLoader worker (pid" in worker, out
    assert f"Cell In[{n}], line 7 in __getitem__: time.sleep(600)" in worker


@pytest.mark.e2e
def test_the_banner_shows_after_stall_after_and_the_timeout_carries_the_rollcall(kernel):
    kernel.run("%load_ext nbddp")
    out, reply = kernel.run(
        "%%ddp -n 2 --device cpu --display text --stall-after 2 --timeout 9\n"
        "import torch.distributed as dist\n"
        "if nbddp.rank() == 1:\n"
        "    time.sleep(600)\n"
        "dist.barrier()\n",
        timeout=60,
    )
    n = reply["execution_count"]
    assert reply["status"] == "error"
    banner = out[out.index("no rank made progress since") :]
    assert f"rank 1 is at Cell In[{n}], line 4 in time.sleep(600)" in banner, out
    assert "nothing was stopped" in banner
    error = out[out.index("LaunchTimeout") :]
    assert "Where the ranks were:" in error, out
    assert f"rank 1 is at Cell In[{n}], line 4 in time.sleep(600)" in error


@pytest.mark.e2e
def test_no_banner_for_a_run_that_progresses_slowly(kernel):
    kernel.run("%load_ext nbddp")
    out, reply = kernel.run(
        # each step 1 s, twice as long as stall_after in all: progress, not the run's length,
        # keeps the banner away (4 s of slack at each step for a slow machine)
        "%%ddp -n 2 --device cpu --display text --stall-after 5\n"
        "for step in range(10):\n"
        "    time.sleep(1.0)\n"
        "    nbddp.log(step=step)\n",
        timeout=60,
    )
    assert reply["status"] == "ok", out
    assert "no rank made progress" not in out


@pytest.mark.e2e
def test_an_interrupt_of_a_stalled_run_carries_the_rollcall(kernel):
    n = define(
        kernel,
        "import os, signal, threading\n"
        "import torch.distributed as dist\n"
        "def stalling():\n"
        "    if nbddp.rank() == 0:\n"
        "        time.sleep(600)\n"
        "    dist.barrier()\n",
    )
    out, reply = kernel.run(
        "before = nbddp.last_run()  # an earlier test's run, stalled or not, is not this one\n"
        "def interrupt_once_stalled():\n"
        "    deadline = time.time() + 60\n"
        "    while time.time() < deadline:\n"
        "        run = nbddp.last_run()\n"
        "        if run is not before and run._rollcalls.watch and run._rollcalls.watch.stalled:\n"
        "            break\n"
        "        time.sleep(0.1)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "threading.Thread(target=interrupt_once_stalled, daemon=True).start()\n"
        "try:\n"
        "    nbddp.notebook_launch(stalling, num_workers=2, device='cpu', display='none',\n"
        "                          stall_after=1.5)\n"
        "except KeyboardInterrupt as e:\n"
        "    print('interrupted;', e.stacks.rollcall())\n",
        timeout=60,
    )
    assert reply["status"] == "ok", out
    assert f"interrupted; rank 0 is at Cell In[{n}], line 5 in time.sleep(600)" in out, out


@pytest.mark.e2e
def test_a_stalled_session_task_in_status(kernel):
    n = define(
        kernel,
        "import torch.distributed as dist\n"
        "from nbddp.notebook.session_magic import status_table\n"
        "def waiting():\n"
        "    if nbddp.rank() == 1:\n"
        "        time.sleep(600)\n"
        "    dist.barrier()\n",
    )
    out, reply = kernel.run(
        "sess = nbddp.Session(2, device='cpu')\n"
        "run = sess.run(waiting, block=False, display='none')\n"
        "deadline = time.time() + 90\n"
        "while True:\n"
        "    status = sess.status()\n"
        "    places = status.stacks.place(0) + status.stacks.place(1)\n"
        "    if 'sleep' in places and '(#' in places or time.time() > deadline:\n"
        "        break\n"
        "print([row['where'] for row in status])\n"
        "print(status_table(sess))\n"
        "run.stop()\n"
        "sess.close()\n",
        timeout=90,
    )
    assert reply["status"] == "ok", out
    assert re.search(rf"'waits in barrier \(#\d+\) at Cell In\[{n}\], line 6'", out), out
    assert f"'at Cell In[{n}], line 5 in time.sleep(600)'" in out
    assert "The running task:" in out
    assert "rank 1 is the odd one out" in out


@pytest.mark.e2e
def test_the_panel_shows_the_banner_and_keeps_it_in_the_summary(kernel):
    import html
    import json

    n = define(
        kernel,
        "import torch.distributed as dist\n"
        "def stalls_quietly():\n"
        "    if nbddp.rank() == 1:\n"
        "        time.sleep(600)\n"
        "    dist.barrier()\n",
    )
    messages, reply = kernel.run_seeing_everything(
        "run = nbddp.notebook_launch(stalls_quietly, num_workers=2, device='cpu', "
        "block=False, stall_after=1.5)\n"
        "import threading\n"  # the panel's own drawing tells when it showed the banner
        "drawn, render = threading.Event(), run._display._view.render\n"
        "def spied(snapshot):\n"
        "    render(snapshot)\n"
        "    if snapshot.stalled_since is not None:\n"
        "        drawn.set()\n"
        "run._display._view.render = spied\n"
        "assert drawn.wait(60), 'the panel never drew the stall banner'\n"
        "run.stop()\n",
        timeout=90,
    )
    assert reply["status"] == "ok"
    sent = [json.dumps(m["content"]) for m in messages]
    line = f"rank 1 is at Cell In[{n}], line 4 in time.sleep(600)"
    assert any("Where?" in t for t in sent if '"comm_id"' in t)  # the button is in the panel
    panels = [
        m["content"]["data"].get("text/html", "")
        for m in messages
        if m["msg_type"] == "update_display_data"
    ]
    live = [p for p in panels if "nbddp-stall" in p and "nbddp-panel" in p]
    assert live and line in html.unescape(live[-1]), panels[-3:]
    summary = [p for p in panels if "nbddp-summary" in p]
    assert "nbddp-stall" in summary[-1]


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -1, "10", True, float("inf")])
def test_a_bad_stall_after_is_refused_before_anything_starts(bad):
    import nbddp

    with starts_nothing(), pytest.raises(ValueError, match="stall_after="):
        nbddp.notebook_launch(print, num_workers=2, device="cpu", stall_after=bad)


# -- the roll-call and the watch, from made-up answers (no process) ---------------------------


def _report(line: int, collective=None, cpu: float = 0.0, how: str = "asked"):
    from nbddp.wire.stacks import StackFrame, StackReport, ThreadStack

    own = StackFrame("/x/nbddp/worker/entry.py", 1, "_run", "", True)
    user = StackFrame("/home/u/train.py", line, "train", "", False)
    frames = [own, user]
    if collective is not None:
        frames.append(
            StackFrame("/v/site-packages/torch/distributed/distributed_c10d.py", 9, "x", "", False)
        )
    collectives = (collective,) if collective is not None else ()
    return StackReport(
        how, (ThreadStack("MainThread", True, tuple(frames)),), collectives, (), cpu, "", ()
    )


@pytest.mark.unit
def test_the_rollcall_of_ranks_with_different_shapes_names_the_minority():
    from nbddp.diagnosis.stacks import Stacks
    from nbddp.wire.stacks import Collective

    def reduce(shape):
        return Collective(7, "all_reduce", (shape,), ("Float",), "default_pg", None)

    stacks = Stacks(
        3,
        {0: _report(12, reduce((3,))), 1: _report(12, reduce((5,))), 2: _report(12, reduce((3,)))},
    )
    text = stacks.rollcall()
    assert "ranks 0, 2 wait in all_reduce (#7, [3]) at /home/u/train.py:12" in text
    assert "rank 1 waits in all_reduce (#7, [5]) at /home/u/train.py:12" in text
    assert "rank 1 is the odd one out" in text
    assert stacks.odd_ones == (1,)
    assert "different order, or with different shapes" in text


@pytest.mark.unit
def test_a_rank_that_did_not_answer_is_named():
    from nbddp.diagnosis.stacks import Stacks

    stacks = Stacks(2, {0: _report(3)})
    assert "rank 1 did not answer" in stacks.rollcall()
    assert stacks.place(1) == "did not answer"


@pytest.mark.unit
def test_faulthandlers_text_is_read_back():
    from nbddp.wire.stacks import parse_faulthandler

    text = (
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        '  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap\n'
        "\n"
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/x/nbddp/worker/entry.py", line 5 in inner\n'
        '  File "<ipython-input>", line 3 in train\n'
    )
    threads = parse_faulthandler(text, 0x7F0000000001, "/x/nbddp/")
    assert [t.main for t in threads] == [True, False]
    main = threads[0]
    assert [(f.function, f.own) for f in main.frames] == [("train", False), ("inner", True)]


@pytest.mark.unit
def test_the_watch_waits_while_a_rank_burns_cpu_or_starts_and_shows_the_banner_when_none_does():
    import time

    from nbddp.diagnosis.stacks import Stacks
    from nbddp.diagnosis.stall import StallWatch

    for case in ("busy", "starting", "stalled"):
        cpu = [0.0]
        shown = []
        takes = [0]

        def take(timeout, case=case, cpu=cpu, takes=takes):
            takes[0] += 1
            cpu[0] += 10.0 if case == "busy" else 0.001
            answers = {0: _report(1, cpu=cpu[0]), 1: _report(2, cpu=cpu[0])}
            if case == "starting":
                del answers[1]  # not connected yet
            return Stacks(2, answers)

        start = time.monotonic()
        watch = StallWatch(
            0.4, lambda start=start: start, take, lambda s, q, shown=shown: shown.append(s)
        )
        # two judgements made (the fifth roll-call begins after the second's verdict), or
        # the banner shown, whichever first
        assert wait_until(lambda shown=shown, takes=takes: shown or takes[0] >= 5, 30), case
        watch.cancel()
        assert bool(shown) is (case == "stalled"), case


@pytest.mark.e2e
def test_a_bad_stall_after_in_the_magic_is_a_usage_error(kernel):
    kernel.run("%load_ext nbddp")
    out, reply = kernel.run("%%ddp -n 2 --device cpu --stall-after soon\npass\n")
    assert reply["status"] == "error"
    assert "--stall-after" in out and "soon" in out, out
    out, reply = kernel.run("%%ddp -n 2 --device cpu --stall-after -3\npass\n")
    assert reply["status"] == "error"
    assert "stall_after=-3.0 must be a positive number" in out, out


def sleeps_then_returns_its_rank(seconds: float) -> int:
    import time

    import nbddp

    time.sleep(seconds)
    return nbddp.rank()


@pytest.mark.ranks
def test_a_rollcall_while_the_ranks_start_leaves_them_running():
    """Asked at once, before some rank has its job: that rank waits for the job (it used to
    take the roll-call for its job and exit with code 1, without a word)."""
    import time

    import nbddp

    for _ in range(8):
        run = nbddp.notebook_launch(
            sleeps_then_returns_its_rank,
            (0.5,),
            num_workers=3,
            device="cpu",
            block=False,
            display="none",
            return_all=True,
        )
        asked = time.monotonic()
        while time.monotonic() - asked < 0.4:
            run.stacks(timeout=2)
        assert run.result(timeout=60) == [0, 1, 2]
