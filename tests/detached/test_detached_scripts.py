"""A detached ``run_script`` outlives the kernel that started it: the kernel is killed with
SIGKILL while the script's ranks wait for a file; they go on, and a later process attaches,
sees the rows logged before and after the kill, and gets the script's outcome from the run's
record: 0, or the ``WorkerError`` with the script's own exit code and lines."""

from __future__ import annotations

import os
import signal
import textwrap

import pytest
from conftest import Kernel
from detached.support import family, runs_dir, supervisor_of, wait_for_file, wait_gone

import nbddp

__all__ = ["runs_dir"]  # an autouse fixture (support.py)
pytestmark = pytest.mark.e2e

SCRIPT = """\
import os, sys, time
import nbddp

ready, go, code = sys.argv[1], sys.argv[2], int(sys.argv[3])
for step in range(20):
    if step == 10:
        open(ready + os.environ["RANK"], "w").close()
        while not os.path.exists(go):
            time.sleep(0.01)
    nbddp.log(step=float(step))
if os.environ["RANK"] == "1":
    sys.exit(code)
"""


def test_a_detached_script_outlives_a_killed_kernel_with_its_exit_code(tmp_path, runs_dir):
    script = tmp_path / "waits.py"
    script.write_text(SCRIPT)
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    kernel = Kernel()
    ids = []
    try:
        for code in ("0", "6"):
            out, reply = kernel.run(
                textwrap.dedent(
                    f"""\
                    import nbddp
                    run = nbddp.run_script({str(script)!r}, [{ready + code!r}, {go!r}, {code!r}],
                                           num_workers=2, device="cpu", detach=True,
                                           display="none")
                    print(run.id)
                    """
                )
            )
            assert reply["status"] == "ok", out
            ids.append(out.strip().splitlines()[-1])
        for code in ("0", "6"):
            wait_for_file(ready + code + "1")
        everything = [p for run_id in ids for p in family(supervisor_of(run_id))]
        os.kill(kernel.pid, signal.SIGKILL)
        kernel.manager.provisioner.process.wait()
    finally:
        if kernel.manager.is_alive():
            kernel.shutdown()
        else:
            kernel.client.stop_channels()
            kernel.manager.cleanup_resources()
    assert all(p.is_running() for p in everything)  # the ranks go on without the kernel
    open(go, "w").close()
    succeeded, failed = (nbddp.attach(run_id, display="none") for run_id in ids)
    assert succeeded.result(timeout=120) == 0
    assert [row["step"] for row in succeeded.history] == [float(i) for i in range(20)]
    with pytest.raises(nbddp.WorkerError) as info:
        failed.result(timeout=120)
    assert (info.value.rank, info.value.exitcode) == (1, 6)
    assert f'File "{script}", line 12, in <module>' in info.value.remote_traceback
    for run in (succeeded, failed):
        run.forget()
    assert wait_gone(everything) == []
