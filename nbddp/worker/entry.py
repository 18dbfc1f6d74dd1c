"""What each worker process runs: connect, load the job, join the process group, call fn, report.

The generated ``__main__`` script only calls :func:`main`. Everything a rank needs arrives in
its environment (the torchrun variables) and in the run's private directory (``spec.json`` with
the channel address and key, ``job.pkl`` with the pickled function and arguments).

A worker never outlives the kernel: a daemon thread blocks on the channel, and when the kernel
end closes (kernel exit, restart, SIGKILL) the worker kills its own process group at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from .. import channel, payload
from . import live
from .report import error_report

_EXIT_GRACE = 10.0  # seconds a finished worker may spend in interpreter shutdown


def main(job_dir: str) -> int:
    with open(os.path.join(job_dir, "spec.json")) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    conn = channel.connect(spec["address"], bytes.fromhex(spec["authkey"]), rank)
    reporter = _Reporter(conn, rank)
    threading.Thread(target=_die_with_kernel, args=(conn, reporter), daemon=True).start()
    _adopt_kernel_paths(spec)
    code = _run(job_dir, spec, rank, reporter)
    reporter.finishing = True
    _exit_within(_EXIT_GRACE, code)
    return code


class _Reporter:
    """Sends to the kernel from any thread of the worker."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank
        self.finishing = False
        self._lock = threading.Lock()

    def send(self, *message: Any) -> None:
        with self._lock:
            self.conn.send(message)

    def send_result(self, stream: bytes | None, buffers: list[memoryview]) -> None:
        """The value's pickle stream, then each tensor buffer straight from its memory."""
        with self._lock:
            self.conn.send(("result", self.rank, stream, [b.nbytes for b in buffers]))
            for buffer in buffers:
                self.conn.send_bytes(buffer)


def _die_with_kernel(conn: Connection, reporter: _Reporter) -> None:
    try:
        while True:
            conn.recv()  # the kernel never writes: this returns only when it is gone
    except (EOFError, OSError):
        pass
    if not reporter.finishing:
        _kill_own_group()


def _kill_own_group() -> None:
    if os.getpgrp() == os.getpid():  # we lead our group: take DataLoader workers along
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _exit_within(seconds: float, code: int) -> None:
    """A user thread that never ends must not keep a finished worker (and the run) alive."""

    def force() -> None:
        time.sleep(seconds)
        os._exit(code)

    threading.Thread(target=force, daemon=True).start()


def _adopt_kernel_paths(spec: dict[str, Any]) -> None:
    """Import what the notebook can import: its sys.path entries, its working directory."""
    for entry in reversed(spec["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    os.chdir(spec["cwd"])


def _run(job_dir: str, spec: dict[str, Any], rank: int, reporter: _Reporter) -> int:
    import torch
    import torch.distributed as dist

    from .context import Context, installed

    try:
        with open(os.path.join(job_dir, "job.pkl"), "rb") as f:
            job = payload.loads(f.read())
        payload.install_sources(job["sources"])
        fn, args, kwargs = payload.loads(job["call"])

        if spec["device"] == "cuda":
            device = torch.device("cuda", spec["device_index"][rank])
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if rank == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            reporter.send("device", rank, name)
        dist.init_process_group(
            backend=spec["backend"], init_method="env://",
            rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
        )
        context = Context(
            rank=rank, local_rank=int(os.environ["LOCAL_RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]), device=device,
        )
        buffer = live.LiveBuffer(lambda kind, data: reporter.send(kind, rank, data))
        live.install(buffer)
        with installed(context):
            try:
                value = fn(*args, **kwargs)
            finally:
                buffer.close()  # every logged row reaches the kernel before the outcome
    except SystemExit as exc:
        if exc.code in (None, 0):
            value = None
        else:
            _report_error(reporter, exc)
            return 1
    except BaseException as exc:
        _report_error(reporter, exc)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()

    try:
        wanted = rank == 0 or spec["return_all"]
        stream, buffers = (payload.dumps_oob(value, what="the result", root="result")
                           if wanted else (None, []))
    except payload.SerializationError as exc:
        reporter.send("unsendable", rank, exc.path, exc.reason)
        return 1
    reporter.send_result(stream, buffers)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _report_error(reporter: _Reporter, exc: BaseException) -> None:
    reporter.send("error", reporter.rank, error_report(exc))
