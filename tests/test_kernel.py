"""Launches from a real IPython kernel, the way a notebook runs them."""

from __future__ import annotations

import signal
import time

import psutil
from conftest import is_warm_helper, running


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


def test_workers_end_themselves_when_the_kernel_is_killed(kernel_factory):
    doomed = kernel_factory()
    try:
        doomed.run("import nbddp, time")
        out, reply = doomed.run(
            "def wait_forever():\n    time.sleep(600)\n"
            "run = nbddp.notebook_launch(wait_forever, num_workers=2, device='cpu', block=False)\n"
        )
        assert reply["status"] == "ok", out
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = [p.pid for p in psutil.Process(doomed.pid).children(recursive=True)]
            time.sleep(0.1)
        time.sleep(5)  # let them connect to the kernel's channel (import torch first)
        assert run_status(doomed) == "running"
        doomed.manager.signal_kernel(signal.SIGKILL)
        assert _wait_gone(workers, timeout=10) == []
    finally:
        doomed.shutdown()


def run_status(kernel) -> str:
    out, _ = kernel.run("print(run.status)")
    return out.strip()
