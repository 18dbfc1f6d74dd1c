"""Detached runs with real Jupyter kernels: kernel A starts two detached runs; kernel B
attaches to one while A still follows it; A is killed with SIGKILL; the ranks go on; B sees
every metric row from before and after the kill and stops the other run from its kernel; B is
restarted, and its ``%ddp_attach`` brings the detached cell's names back; ``forget()`` removes
both; nothing is left running."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import Kernel
from detached.support import family, runs_dir, supervisor_of, wait_for_file, wait_gone

pytestmark = pytest.mark.e2e

__all__ = ["runs_dir"]  # an autouse fixture (support.py)

CELL = """%%ddp --detach -n 2 --device cpu --display none
import os, time
total = 0
for step in range(30):
    if step in (10, 20):
        open({ready!r} + str(step), "w").close()
        while not os.path.exists({go!r} + str(step)):
            time.sleep(0.01)
    nbddp.log(i=float(step))
    total += step
nbddp.print("the cell is done")
"""

FOREVER = """
def forever():
    import time, nbddp
    for step in nbddp.progress(range(10**6), desc="forever"):
        nbddp.log(step_seen=float(step))
        time.sleep(0.02)
second = nbddp.notebook_launch(forever, num_workers=2, device="cpu", display="none",
                               detach=True)
print(second.id)
"""


def test_runs_outlive_a_killed_kernel_and_a_later_kernel_takes_them_over(tmp_path, runs_dir):
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    a, b = Kernel(), Kernel()
    try:
        try:
            a.run("import nbddp\n%load_ext nbddp")
            out, reply = a.run(CELL.format(ready=ready, go=go))
            assert reply["status"] == "ok", out
            assert "%ddp_attach" in out
            cell_run = out.split("Detached run ")[1].split(":")[0]
            out, reply = a.run(FOREVER)
            assert reply["status"] == "ok", out
            forever_run = out.strip().splitlines()[-1]
            wait_for_file(ready + "10")  # rows 0-9 are logged
            supervisors = [supervisor_of(cell_run), supervisor_of(forever_run)]
            everything = [p for s in supervisors for p in family(s)]
            # a second kernel attaches while the first still follows the run: both are attached
            out, reply = b.run(
                "import nbddp, os, time\n"
                "deadline = time.monotonic() + 60\n"
                "while True:  # the second run may still be starting its ranks\n"
                "    listed = {r.id: r.status for r in nbddp.runs()}\n"
                f"    if listed[{forever_run!r}] != 'starting' or time.monotonic() > deadline:\n"
                "        break\n"
                "    time.sleep(0.05)\n"
                f"print(listed[{cell_run!r}], listed[{forever_run!r}])\n"
                f"run = nbddp.attach({cell_run!r}, display='none')\n"
                "print('before', [r['i'] for r in run.history])\n"
            )
            assert reply["status"] == "ok", out
            assert "running running" in out
            assert f"before {[float(i) for i in range(10)]}" in out
            out, reply = a.run("print(nbddp.last_run().status, len(nbddp.last_run().history) > 0)")
            assert "running True" in out  # the first kernel follows still
            os.kill(a.pid, signal.SIGKILL)
            a.manager.provisioner.process.wait()
        finally:
            if a.manager.is_alive():
                a.shutdown()
            else:
                a.client.stop_channels()
                a.manager.cleanup_resources()
        # the ranks go on without the kernel
        assert all(p.is_running() for p in everything)
        assert len([p for s in supervisors for p in s.children(recursive=True)]) >= 6
        out, reply = b.run(
            f"open({go!r} + '10', 'w').close()\n"
            f"while not os.path.exists({ready!r} + '20'): time.sleep(0.01)\n"
            "while len(run.history) < 20: time.sleep(0.01)\n"
            "print('after', [r['i'] for r in run.history])\n"
            f"other = nbddp.attach({forever_run!r}, display='none')\n"
            "print('stopped', other.stop(timeout=30), other.status)\n",
            messages=None,
        )
        assert reply["status"] == "ok", out
        assert f"after {[float(i) for i in range(20)]}" in out
        assert "stopped True stopped" in out

        b.manager.restart_kernel(now=True)
        b.client.wait_for_ready(timeout=60)
        b.run(f"import nbddp\n%load_ext nbddp\nopen({go!r} + '20', 'w').close()")
        out, reply = b.run(f"%ddp_attach {cell_run} --display text")
        assert reply["status"] == "ok", out
        assert "the cell is done" in out and "succeeded" in out
        out, reply = b.run("print(total, step)")
        assert out.split() == [str(sum(range(30))), "29"]
        out, reply = b.run(
            f"nbddp.attach({cell_run!r}, display='none').forget()\n"
            f"nbddp.attach({forever_run!r}, display='none').forget()\n"
            "print(nbddp.runs())"
        )
        assert reply["status"] == "ok", out
        assert "no detached runs" in out
        assert [n for n in os.listdir(runs_dir) if not n.startswith(".")] == []
    finally:
        b.shutdown()
    assert wait_gone(everything) == []


def test_attach_in_a_kernel_names_an_unknown_run(runs_dir):
    k = Kernel()
    try:
        out, reply = k.run("import nbddp\n%load_ext nbddp\n%ddp_attach 0123abcd")
        assert reply["status"] == "error"
        assert "no detached run 0123abcd of yours" in out
    finally:
        k.shutdown()


if __name__ == "__main__":
    pytest.main([__file__])
