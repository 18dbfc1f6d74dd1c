"""%%ddp in a real kernel: the namespace in and out, errors, options, the in-kernel fallback."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.e2e

TWO = "%%ddp -n 2 --device cpu --display none"


@pytest.fixture(scope="module")
def magic_kernel(kernel):
    out, reply = kernel.run("%load_ext nbddp\nimport threading\nimport torch.nn as nn")
    assert reply["status"] == "ok", out
    return kernel


@pytest.mark.smoke
def test_names_go_in_and_come_back(magic_kernel):
    k = magic_kernel
    k.run(
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(2, 1)\n"
        "def make():\n    return Net()\n"
        "base, victim, counter = 10, 'bye', 0"
    )
    out, reply = k.run(
        f"{TWO}\n"
        "model = nbddp.prepare_model(make())\n"
        "squares = [i * base for i in range(3)]\n"
        "def bump():\n    global counter\n    counter = counter + 1\n"
        "for _ in range(2):\n    bump()\n"
        "del victim\n"
        "rank_seen = nbddp.rank()\n"
        "counter * 100"
    )
    assert reply["status"] == "ok", out
    assert "200" in out  # the last expression, displayed like a normal cell's
    out, _ = k.run(
        "print(type(model) is Net, squares, counter, rank_seen, 'victim' in dir(),"
        " bump.__name__, sep=',')"
    )
    assert out.strip() == "True,[0, 10, 20],2,0,False,bump"


def test_out_and_no_out_select_what_comes_back(magic_kernel):
    k = magic_kernel
    k.run("a = b = c = 'before'")
    k.run(f"{TWO} --out a,c\na = 'A'\nb = 'B'\nc = 'C'")
    assert k.run("print(a, b, c)")[0].strip() == "A before C"
    k.run(f"{TWO} --no-out\na = 'again'")
    assert k.run("print(a)")[0].strip() == "A"


def test_errors_point_at_the_cell_line(magic_kernel):
    out, reply = magic_kernel.run(f"{TWO}\nx = 1\ny = 2\nraise ValueError(f'bad {{x + y}}')\n")
    assert reply["status"] == "error" and reply["ename"] == "WorkerError"
    assert "line 4, in <module>" in out and "raise ValueError(f'bad {x + y}')" in out
    out, reply = magic_kernel.run(f"{TWO}\nvalue = never_defined + 1")
    assert "NameError" in out and "line 2" in out and "value = never_defined + 1" in out


def _long_cell(failing: str) -> tuple[str, list[str]]:
    """A 300-line %%ddp cell whose line 151 (the %%ddp line is line 1) is ``failing``."""
    lines = [f"step_{i} = {i}" for i in range(2, 301)]
    lines[149] = failing
    return f"{TWO}\n" + "\n".join(lines), [line for line in lines if line != failing]


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # IPython's colours


def test_a_failing_long_cell_shows_its_failing_line_and_no_other(magic_kernel):
    """Not IPython's ``run_cell_magic('ddp', ..., '<the whole cell>')`` frame: the rank's
    traceback, naming the cell's line as IPython names a cell's own."""
    cell, others = _long_cell("raise ValueError(f'stopped at {step_149}')")
    out, reply = magic_kernel.run(cell)
    out = _plain(out)
    assert reply["status"] == "error" and reply["ename"] == "WorkerError", out
    assert f"Cell In[{reply['execution_count']}], line 151, in <module>" in out, out
    assert "raise ValueError(f'stopped at {step_149}')" in out
    assert "ValueError: stopped at 149" in out
    assert not [line for line in others if line in out], out
    assert "run_cell_magic" not in out and "/nbddp/" not in out
    assert len(out) < 1000, out


def test_a_long_cell_that_does_not_parse_shows_its_line_as_a_cell_would(magic_kernel):
    cell, others = _long_cell("oops = (1,")
    out, reply = magic_kernel.run(cell)
    out = _plain(out)
    assert reply["status"] == "error", out
    assert f"Cell In[{reply['execution_count']}], line 151" in out, out
    assert "oops = (1," in out and "SyntaxError: '(' was never closed" in out
    assert not [line for line in others if line in out], out
    assert "run_cell_magic" not in out and "/nbddp/" not in out and "Traceback" not in out


def test_an_interrupted_cell_is_a_keyboard_interrupt_without_its_cell_echoed(magic_kernel):
    chunks: list[str] = []

    def interrupt_once_started(msg: dict) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream" and "started" in content["text"] and not chunks:
            chunks.append(content["text"])
            magic_kernel.manager.interrupt_kernel()
        elif msg["msg_type"] == "error":
            chunks.append(_plain("\n".join(content["traceback"])))

    cell, others = _long_cell("print('started', flush=True); time.sleep(600)")
    reply = magic_kernel.client.execute_interactive(
        cell.replace("--display none", "--display text"),
        timeout=60,
        output_hook=interrupt_once_started,
    )
    shown = "".join(chunks[1:])
    assert reply["content"]["ename"] == "KeyboardInterrupt", shown
    assert "KeyboardInterrupt" in shown
    assert not [line for line in others if line in shown], shown
    assert "run_cell_magic" not in shown and "/nbddp/" not in shown


def test_an_input_that_cannot_travel_is_named(magic_kernel):
    magic_kernel.run("guard = threading.Lock()")
    out, reply = magic_kernel.run(f"{TWO}\nwith guard:\n    pass")
    assert reply["ename"] == "SerializationError"
    assert "'guard'" in out and "guard -> _thread.lock" in out


def test_an_output_that_cannot_travel_back_is_skipped_with_a_warning(magic_kernel):
    out, reply = magic_kernel.run(f"{TWO}\nkept = 5\nlock_made = threading.Lock()")
    assert reply["status"] == "ok", out
    # shown against the user's cell and line, naming the path to the part that cannot travel
    assert (
        "<%%ddp cell" in out and ":3: NbddpWarning: %%ddp could not bring back lock_made: " in out
    )
    assert "lock_made -> _thread.lock cannot be pickled (TypeError: " in out
    assert "the ranks that held it have ended" in out and "held them" not in out
    assert "lock_made = threading.Lock()" in out and "nbddp/notebook/magic.py" not in out
    assert magic_kernel.run("print(kept, 'lock_made' in dir())")[0].strip() == "5 False"


def test_a_name_that_cannot_come_back_is_unbound_not_left_stale(magic_kernel):
    k = magic_kernel
    k.run("x, holder, fine = 'old', 'old holder', 'old fine'")
    out, reply = k.run(
        f"{TWO}\nx = threading.Lock()\nholder = {{'cfg': [1, 2], 'guard': threading.Lock()}}"
        "\nfine = 'new'"
    )
    assert reply["status"] == "ok", out
    assert "could not bring back x, holder" in out
    assert "x -> _thread.lock cannot be pickled" in out
    assert "holder -> ['guard'] -> _thread.lock cannot be pickled" in out, out
    assert "x, holder are now unbound in the notebook" in out
    # neither keeps its value from before the cell; what could travel did
    printed = k.run("print('x' in dir(), 'holder' in dir(), fine)")[0].strip()
    assert printed == "False False new"
    out, reply = k.run("x")
    assert reply["status"] == "error" and reply["ename"] == "NameError"


def test_out_names_the_cell_never_assigns_are_warned_about_before_the_run(magic_kernel):
    out, reply = magic_kernel.run(f"{TWO} --out made,never_assigned,nor_this\nmade = 1")
    assert reply["status"] == "ok", out
    assert "--out never_assigned, nor_this: the cell never assigns them" in out
    assert magic_kernel.run("print(made)")[0].strip() == "1"


def test_a_name_left_unbound_by_a_branch_is_kept_and_a_deleted_one_goes(magic_kernel):
    k = magic_kernel
    k.run("maybe, doomed = 'notebook value', 'bye'")
    out, reply = k.run(f"{TWO}\nif nbddp.world_size() > 99:\n    maybe = 'ranks'\ndel doomed")
    assert reply["status"] == "ok", out
    assert k.run("print(maybe, 'doomed' in dir())")[0].strip() == "notebook value False"


def test_ipython_syntax_in_a_ddp_cell_is_a_usage_error(magic_kernel):
    out, reply = magic_kernel.run(f"{TWO}\n!echo hi\nx = 1")
    assert reply["ename"] == "UsageError" and "IPython syntax" in out


def test_one_worker_runs_in_the_kernel_namespace_like_a_normal_cell(magic_kernel):
    k = magic_kernel
    k.run("shared = []")
    out, reply = k.run(
        "%%ddp -n 1 --display none\nshared.append(nbddp.world_size())\n"
        "local_only = threading.Lock()\n41 + 1"
    )
    assert reply["status"] == "ok", out
    assert "42" in out
    # the very same list object was mutated, and an unpicklable name stays: no pickling at all
    assert k.run("print(shared, type(local_only).__name__)")[0].strip() == "[1] lock"
    out, reply = k.run("%%ddp -n 1 --display none\n1 / 0")
    assert reply["status"] == "error" and "ZeroDivisionError" in out
    assert out.count("ZeroDivisionError") == 2  # IPython's own traceback, once (name + line)


def test_misuse_is_a_usage_error(magic_kernel):
    for line in ("%%ddp --out a --no-out", "%%ddp -n 0", "%%ddp --device tpu"):
        out, reply = magic_kernel.run(f"{line}\nx = 1")
        assert reply["ename"] == "UsageError", (line, out)
    out, _ = magic_kernel.run("print(get_ipython().find_cell_magic('ddp').__doc__)")
    assert "--num-workers" in out and "--no-out" in out


def test_large_inputs_reach_the_ranks_through_shared_memory(magic_kernel):
    k = magic_kernel
    k.run("import numpy as np\nbig_input = np.ones(5_000_000)")
    out, reply = k.run(
        f"{TWO}\nwith open('/proc/self/maps') as maps:\n"
        "    shared = 'memfd:nbddp-data' in maps.read()\n"
        "total = float(big_input.sum())"
    )
    assert reply["status"] == "ok", out
    assert k.run("print(shared, total)")[0].strip() == "True 5000000.0"
