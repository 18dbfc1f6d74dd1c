"""Launches from a real IPython kernel, the way a notebook runs them."""

from __future__ import annotations

import glob
import os
import re
import signal
import tempfile
import time

import psutil
import pytest
from conftest import is_warm_helper, running, wait_until

from nbddp.local import rundir

pytestmark = pytest.mark.e2e


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def test_function_class_and_closure_defined_in_cells(kernel):
    kernel.run("class Doubler(torch.nn.Module):\n    def forward(self, x):\n        return 2 * x\n")
    kernel.run(
        "def make_train(factor):\n"
        "    def train():\n"
        "        print('training on rank', nbddp.rank())\n"
        "        return Doubler()(torch.ones(1)) * factor, Doubler()\n"
        "    return train\n"
    )
    out, reply = kernel.run(
        "value, module = nbddp.notebook_launch(make_train(3), num_workers=2, device='cpu')\n"
        "print(value.tolist(), type(module) is Doubler)\n"
    )
    assert reply["status"] == "ok", out
    assert "training on rank 0" in out and "training on rank 1" not in out
    assert "[6.0] True" in out


def test_error_shows_the_cell_source_line(kernel):
    kernel.run(
        "def broken():\n"
        "    scale = 2\n"
        "    raise ValueError(f'scale {scale} on rank {nbddp.rank()}')\n"
    )
    out, reply = kernel.run("nbddp.notebook_launch(broken, num_workers=2, device='cpu')")
    assert reply["status"] == "error" and reply["ename"] == "WorkerError"
    assert "raise ValueError(f'scale {scale} on rank {nbddp.rank()}')" in out
    assert "in broken" in out


@pytest.mark.smoke
def test_a_rank_traceback_names_notebook_cells_and_shows_no_nbddp_frame(kernel):
    """As IPython shows a cell's error: ``Cell In[n], line m`` for the notebook's frames, on
    the ranks (notebook_launch and %%ddp alike) and in the kernel, and nothing of nbddp."""
    kernel.run("%load_ext nbddp")
    _, helper = kernel.run("def helper(x):\n    return 1 / x\n")
    _, train = kernel.run("def train():\n    a = 1\n    return helper(0)\n")
    for launch in (
        "nbddp.notebook_launch(train, num_workers=2, device='cpu', display='none')",
        "nbddp.notebook_launch(train, num_workers=1, device='cpu', display='none')",
        "%%ddp -n 2 --device cpu --display none\nx = 1\ntrain()",
    ):
        out, reply = kernel.run(launch)
        out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # IPython's colours
        assert reply["status"] == "error" and reply["ename"] == "WorkerError", out
        assert f"Cell In[{train['execution_count']}], line 3, in train" in out, out
        assert f"Cell In[{helper['execution_count']}], line 2, in helper" in out
        # each notebook frame with its source line, as IPython shows it (IPython 8.0 kept cells
        # apart from linecache's mtime-None entries: without them these lines were bare)
        assert "in train\n    return helper(0)\n" in out, out
        assert "in helper\n    return 1 / x\n" in out, out
        if launch.startswith("%%ddp"):  # the cell's own frame, by the cell's line number
            assert f"Cell In[{reply['execution_count']}], line 3, in <module>" in out
            assert "run_cell_magic" not in out  # IPython's frame, echoing the whole cell
        else:  # the launching line, as this IPython names it ("Input In [n]" before 8.5)
            launching = reply["execution_count"]
            assert re.search(rf"Cell In\[{launching}\], line 1|Input In \[{launching}\]", out)
        assert "ipykernel_" not in out and "<%%ddp cell" not in out
        assert "/nbddp/" not in out and "with_traceback" not in out, out
        # the rank's exception is told once, in the message, not again as a frameless cause
        assert out.count("ZeroDivisionError: division by zero") == 2, out  # head, rank


def test_interrupt_stops_every_worker_and_the_next_launch_works(kernel):
    kernel.run(
        "import time\ndef forever():\n    print('started', flush=True)\n    time.sleep(600)\n"
    )
    interrupted = []

    def interrupt_once_started(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "started" in msg["content"]["text"] and not interrupted:
            interrupted.append(psutil.Process(kernel.pid).children(recursive=True))
            kernel.manager.interrupt_kernel()

    started = time.monotonic()
    reply = kernel.client.execute_interactive(  # text display: rank 0's prints are streams
        "nbddp.notebook_launch(forever, num_workers=2, device='cpu', display='text')",
        timeout=60,
        output_hook=interrupt_once_started,
    )
    assert interrupted, "the workers never printed"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - started < 30
    workers = [p.pid for p in interrupted[0] if not is_warm_helper(p)]
    assert len(workers) >= 2
    assert _wait_gone(workers, timeout=5) == []
    out, reply = kernel.run("print(nbddp.notebook_launch(lambda: 7, num_workers=2, device='cpu'))")
    assert reply["status"] == "ok" and "7" in out


@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_a_notebook_dataset_in_dataloader_workers_of_any_start_method(kernel, context):
    kernel.run(
        "from torch.utils.data import Dataset, DataLoader\n"
        "class Pair:\n"
        "    def __init__(self, x):\n        self.x = x\n"
        "class Squares(Dataset):\n"
        "    def __len__(self):\n        return 8\n"
        "    def __getitem__(self, i):\n        return Pair(i * i)\n"
        "def as_sum(batch):\n    return Pair(sum(p.x for p in batch))\n"
    )
    out, reply = kernel.run(
        "def load(context):\n"
        "    loader = DataLoader(Squares(), batch_size=4, num_workers=2, collate_fn=as_sum,\n"
        "                        multiprocessing_context=context)\n"
        "    batches = list(loader)  # once: each pass starts its workers anew (torch each)\n"
        "    return [type(b).__name__ for b in batches], sum(b.x for b in batches)\n"
        f"print(nbddp.notebook_launch(load, ({context!r},), num_workers=2, device='cpu',\n"
        "                            display='none', return_all=True))\n",
        timeout=240,
    )
    assert reply["status"] == "ok", out
    assert "[(['Pair', 'Pair'], 140), (['Pair', 'Pair'], 140)]" in out, out


def test_workers_end_themselves_when_the_kernel_is_killed(kernel_factory, tmp_path):
    doomed = kernel_factory()
    try:
        doomed.run("import nbddp, os, time")
        out, reply = doomed.run(
            "def wait_forever(directory):\n"
            "    path = os.path.join(directory, str(nbddp.rank()))\n"
            "    with open(path + '.part', 'w') as f:\n"
            "        f.write(str(os.getpid()))\n"
            "    os.rename(path + '.part', path)  # whole when it appears\n"
            "    time.sleep(600)\n"
            f"run = nbddp.notebook_launch(wait_forever, ({str(tmp_path)!r},), num_workers=2,\n"
            "                           device='cpu', block=False)\n"
        )
        assert reply["status"] == "ok", out
        # in fn: each rank got its job over the kernel's channel, and holds it open
        pids = [tmp_path / "0", tmp_path / "1"]
        assert wait_until(lambda: all(p.exists() for p in pids), 120), os.listdir(tmp_path)
        ranks = [int(p.read_text()) for p in pids]
        workers = [p.pid for p in psutil.Process(doomed.pid).children(recursive=True)]
        assert set(ranks) <= set(workers), (ranks, workers)
        assert run_status(doomed) == "running"
        doomed.manager.signal_kernel(signal.SIGKILL)
        assert _wait_gone(workers, timeout=10) == []
    finally:
        doomed.shutdown()


def test_a_killed_kernels_run_directory_goes_with_the_next_launch_at_once(kernel_factory, kernel):
    doomed = kernel_factory()
    try:
        doomed.run("import nbddp, time")
        out, reply = doomed.run(
            "def wait_forever():\n    time.sleep(600)\n"
            "run = nbddp.notebook_launch(wait_forever, num_workers=2, device='cpu', block=False)\n"
        )
        assert reply["status"] == "ok", out
        left = glob.glob(os.path.join(tempfile.gettempdir(), f"nbddp-{doomed.pid}-*"))
        assert left, "the doomed kernel's run has no directory: the test proves nothing"
        doomed.manager.signal_kernel(signal.SIGKILL)
        assert _wait_gone([doomed.pid], timeout=10) == []
        deadline = time.monotonic() + 10  # its other threads may still be exiting, holding it
        while not all(rundir._lock_is_free(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(os.path.exists(p) for p in left)  # dead, and nobody swept it yet
        out, reply = kernel.run(  # seconds after the other kernel began its run
            "print(nbddp.notebook_launch(lambda: 7, num_workers=2, device='cpu', display='none'))"
        )
        assert reply["status"] == "ok" and "7" in out, out
        assert not [p for p in left if os.path.exists(p)], "the dead kernel's directory stayed"
    finally:
        doomed.shutdown()


def run_status(kernel) -> str:
    out, _ = kernel.run("print(run.status)")
    return out.strip()
