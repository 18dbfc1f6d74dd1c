"""``%ddp_run`` in a real kernel: rank 0's output in the cell, a module with ``-m`` and
``--env``, a failing script shown with its own lines, an edit to a module the kernel itself
imported (so the warm helper holds it too) seen by the next run, a ``breakpoint()`` in a
script answered in the cell's input box and ``--debug``'s post-mortem, an interrupt (a
graceful stop of a script that checks, SIGTERM for one that does not), ``--session``, and
misuse as ``UsageError``."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from test_stopping_kernel import interrupt_when

pytestmark = pytest.mark.e2e
TWO = "%ddp_run -n 2 --device cpu --display none"


@pytest.fixture(scope="module")
def notebook(kernel, tmp_path_factory):
    where = tmp_path_factory.mktemp("scripts")
    out, reply = kernel.run(f"%load_ext nbddp\nimport os, sys\nos.chdir({str(where)!r})")
    assert reply["status"] == "ok", out
    return kernel, where


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_rank_0s_output_reaches_the_cell_and_a_module_takes_its_env(notebook):
    kernel, where = notebook
    write(
        where / "hello.py",
        """\
        import os, sys
        print("hello from rank", os.environ["RANK"], "args", sys.argv[1:], flush=True)
        """,
    )
    write(where / "greet" / "__init__.py", "")
    write(
        where / "greet" / "__main__.py",
        "import os\nprint('greeting', os.environ['GREETING'], __name__, flush=True)\n",
    )
    out, reply = kernel.run(f"{TWO} hello.py --name 'two words' {{1 + 1}}")
    assert reply["status"] == "ok", out
    assert "hello from rank 0 args ['--name', 'two words', '2']" in out  # shell-split, {expr}
    assert "hello from rank 1" not in out
    assert "Out[" not in out and "\n0\n" not in out  # nothing shown for a success
    out, reply = kernel.run(f"{TWO} --env GREETING=hi -m greet")
    assert reply["status"] == "ok", out
    assert "greeting hi __main__" in out


def test_a_failing_script_shows_its_own_lines(notebook):
    kernel, where = notebook
    script = write(
        where / "fails.py",
        """\
        import os, sys

        def check(rank):
            if rank == "1":
                sys.exit(5)

        check(os.environ["RANK"])
        """,
    )
    out, reply = kernel.run(f"{TWO} fails.py")
    assert reply["status"] == "error" and reply["ename"] == "WorkerError", out
    out = plain(out)
    assert "rank 1 exited with code 5 (sys.exit(5))" in out
    assert f'File "{script}", line 5, in check' in out and "sys.exit(5)" in out
    out, _ = kernel.run("e = nbddp.last_run()\nprint(e.status)")
    assert "failed" in out


def test_an_edit_to_a_module_the_kernel_imported_is_seen_by_the_next_run(notebook):
    kernel, where = notebook
    write(where / "shared_helper.py", "VALUE = 'as first written'\n")
    write(where / "uses.py", "import shared_helper\nprint('uses', shared_helper.VALUE)\n")
    out, reply = kernel.run(
        "import shared_helper\n"  # the kernel holds it: mirrored into the warm helper
        f"{TWO} uses.py"
    )
    assert reply["status"] == "ok", out
    assert "uses as first written" in out
    write(where / "shared_helper.py", "VALUE = 'edited since, and longer'\n")
    out, reply = kernel.run(f"{TWO} uses.py")
    assert reply["status"] == "ok", out
    assert "uses edited since, and longer" in out


def test_a_breakpoint_in_a_script_is_answered_in_the_cell(notebook):
    kernel, where = notebook
    script = write(
        where / "stops.py",
        """\
        import os
        x = 41 + int(os.environ["RANK"])
        if os.environ["RANK"] == "1":
            breakpoint()
        print("after", x, flush=True)
        """,
    )
    prompts: list[str] = []
    lines = ["p x", "c"]

    def person(prompt: str) -> str:
        prompts.append(prompt)
        return lines.pop(0)

    out, reply = kernel.run_answering(f"{TWO} --output all stops.py", person)
    out = plain(out)
    assert reply["status"] == "ok", out
    assert prompts == ["(Pdb rank 1) "] * 2
    assert f"> {script}(5)<module>()" in out and "42" in out
    assert "[rank 1] after 42" in out and "[rank 0] after 41" in out


def test_debug_opens_post_mortem_pdb_at_the_scripts_failing_frame(notebook):
    kernel, where = notebook
    write(
        where / "divides.py",
        """\
        import os

        def share(total):
            parts = int(os.environ["RANK"])  # 0 on rank 0
            return total / parts

        share(10)
        """,
    )
    answers = ["p parts, total", "c"]
    prompts: list[str] = []

    def person(prompt: str) -> str:
        prompts.append(prompt)
        return answers.pop(0)

    out, reply = kernel.run_answering(f"{TWO} --debug divides.py", person)
    out = plain(out)
    assert reply["status"] == "error" and reply["ename"] == "WorkerError", out
    assert prompts == ["(Pdb rank 0) "] * 2 and "(0, 10)" in out
    assert "rank 0 raised ZeroDivisionError" in out


def test_session_runs_on_the_sessions_ranks(notebook):
    kernel, where = notebook
    write(where / "in_session.py", "import os\nprint('session rank', os.environ['RANK'])\n")
    out, reply = kernel.run(
        "%ddp_session start -n 2 --device cpu\n%ddp_run --session --display none in_session.py"
    )
    try:
        assert reply["status"] == "ok", out
        assert "session rank 0" in out
        out, reply = kernel.run("%ddp_run --session -n 2 in_session.py")
        assert reply["ename"] == "UsageError" and "-n cannot apply" in out
    finally:
        kernel.run("%ddp_session stop")


CHECKS = """\
import sys, time
import nbddp

for step in nbddp.progress(range(1_000_000)):
    if step == 20:
        print("training", flush=True)
    time.sleep(0.01)
print("the script saw the stop:", nbddp.stopping(), flush=True)
"""

PLAIN = """\
import os, signal, sys, time

def on_sigterm(signum, frame):
    open(sys.argv[1] + os.environ["RANK"], "w").close()
    sys.exit(143)

signal.signal(signal.SIGTERM, on_sigterm)
open(sys.argv[1] + "-ready" + os.environ["RANK"], "w").close()
while not all(os.path.exists(sys.argv[1] + "-ready" + r) for r in "01"):
    time.sleep(0.01)  # "training" once every rank's handler is in place
print("training", flush=True)
time.sleep(600)
"""


def test_an_interrupt_stops_a_checking_script_gracefully_and_a_plain_one_with_sigterm(
    notebook, tmp_path
):
    kernel, where = notebook
    write(where / "checks.py", CHECKS)
    write(where / "plain.py", PLAIN)
    out, reply, _ = interrupt_when(kernel, f"{TWO.replace('none', 'text')} checks.py", "training")
    assert reply["status"] == "ok", out  # stopped gracefully: the script ended by itself
    assert "the script saw the stop: True" in out and "stopped gracefully at step" in out
    seen = tmp_path / "sigterm"
    out, reply, _ = interrupt_when(kernel, f"{TWO} plain.py {seen}", "training")
    assert reply["ename"] == "KeyboardInterrupt", out
    ended = sorted(p.name for p in tmp_path.iterdir() if "ready" not in p.name)
    assert ended == ["sigterm0", "sigterm1"]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("", "the following arguments are required: script"),
        ("--device cpu missing.py", "no script missing.py"),
        ("hello.py 'unclosed", "No closing quotation"),
        ("--env NOVALUE hello.py", "--env 'NOVALUE' must be NAME=VALUE"),
        ("-m hello.py", "file's path: drop module=True"),
        ("--detach --session hello.py", "--detach cannot apply"),
        ("--session hello.py", "no session is running"),
    ],
)
def test_misuse_is_a_usage_error(notebook, line, says):
    kernel, _ = notebook
    out, reply = kernel.run(f"%ddp_run {line}")
    assert reply["status"] == "error" and reply["ename"] == "UsageError", out
    assert says in out
