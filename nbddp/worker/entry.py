"""What each rank runs: connect, receive the job, join the process group, call fn, report.

The generated ``__main__`` script only calls :func:`main`. A rank reads the job spec from the
run's private directory (``spec.json``: the channel's address and key), its rank and the
rendezvous from the torchrun environment, and the job itself (the pickled call) from the
kernel over the channel, after the handshake.

A rank never outlives the kernel: a daemon thread blocks on the channel, and when the kernel
end closes (kernel exit, restart, SIGKILL) the rank kills its own process group at once. It is
the reaper of its descendants' orphans and ends all of them before it exits, so nothing it
started survives it, whatever session they moved to.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

from .. import payload, transport
from ..call import loads_call
from ..errors import SerializationError
from ..processes import become_subreaper, end_descendants
from ..rundir import SPEC
from ..transport import Connection
from ..wire import (
    AllJoined,
    Bars,
    BarSnapshot,
    Block,
    DeviceName,
    Failed,
    Hello,
    Job,
    JobSpec,
    Joined,
    MainRows,
    Result,
    Rows,
    Unsendable,
)
from . import integrations, live
from .report import error_report


def main(directory: str) -> int:
    become_subreaper()
    with open(os.path.join(directory, SPEC), "rb") as f:
        spec = JobSpec.from_json(f.read())
    rank = int(os.environ["RANK"])
    conn = transport.connect(spec.address, bytes.fromhex(spec.authkey))
    conn.send(Hello(rank))
    joined = threading.Event()
    code = _run(spec, rank, conn, joined)
    if code == 0:
        joined.wait()  # a peer still joining needs us (rank 0 hosts the rendezvous store)
    end_descendants()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)  # no interpreter shutdown: a user thread or child cannot hold the run


class _ChannelSink:
    """``nbddp.log`` rows and progress bars, to the kernel."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self._conn = conn
        self._rank = rank

    def rows(self, first: int, blocks: list[Block]) -> None:
        self._conn.send(Rows(self._rank, first, blocks))

    def main_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        self._conn.send(MainRows(self._rank, rows))

    def bars(self, bars: list[BarSnapshot]) -> None:
        self._conn.send(Bars(self._rank, bars))


def _listen(conn: Connection, joined: threading.Event) -> None:
    """The kernel's word after the job: ``AllJoined``. Its end closing means it is gone, and
    so is this rank, at once, with its whole process group."""
    try:
        while True:
            if isinstance(conn.recv().message, AllJoined):
                joined.set()
    except (EOFError, OSError):
        pass
    _kill_own_group()


def _kill_own_group() -> None:
    if os.getpgrp() == os.getpid():  # we lead our group: take DataLoader workers along
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _adopt_kernel_logging(spec: JobSpec) -> None:
    """The notebook's ``logging.basicConfig(...)``, here too: ``logger.info`` in fn prints as
    it would in the notebook (to stderr; rank 0's is shown, like print)."""
    if spec.logging is not None:
        import logging

        level, fmt, datefmt = spec.logging
        logging.basicConfig(level=level, format=fmt, datefmt=datefmt, stream=sys.stderr, force=True)


def _adopt_kernel_paths(spec: JobSpec) -> None:
    """Import what the notebook can import: its sys.path entries, its working directory."""
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    os.chdir(spec.cwd)


def _run(spec: JobSpec, rank: int, conn: Connection, joined: threading.Event) -> int:
    """Receive the job, join the process group, call fn and report; the exit code."""
    import torch
    import torch.distributed as dist

    from .context import Context, installed

    frame = conn.recv()
    job, fds = frame.message, frame.fds
    del frame  # the job is held by ``job`` alone, and dropped before fn runs
    if not isinstance(job, Job):
        return 1
    threading.Thread(target=_listen, args=(conn, joined), daemon=True).start()
    _adopt_kernel_paths(spec)
    _adopt_kernel_logging(spec)
    early_exit = False
    try:
        payload.install_sources(job.sources)
        if spec.device == "cuda":
            device = torch.device("cuda", spec.device_index[rank])
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if rank == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            conn.send(DeviceName(rank, name))
        world_size = int(os.environ["WORLD_SIZE"])
        context = Context(
            rank=rank,
            local_rank=int(os.environ["LOCAL_RANK"]),
            world_size=world_size,
            device=device,
        )
        with installed(context):
            fn, args, kwargs = loads_call(job.call, job.shared, fds)
            del job  # the pickled call is not kept while fn runs
            dist.init_process_group(
                backend=spec.backend, init_method="env://", rank=rank, world_size=world_size
            )
            conn.send(Joined(rank))
            buffer = live.LiveBuffer(_ChannelSink(conn, rank))
            live.install(buffer)
            integrations.install(spec.output)
            try:
                value = fn(*args, **kwargs)
            finally:
                buffer.close()  # every logged row reaches the kernel before the outcome
    except SystemExit as exc:
        if exc.code not in (None, 0):
            conn.send(Failed(rank, error_report(exc)))
            return 1
        value, early_exit = None, True
    except BaseException as exc:
        conn.send(Failed(rank, error_report(exc)))
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return _send_result(spec, rank, conn, value, early_exit)


def _send_result(spec: JobSpec, rank: int, conn: Connection, value: Any, early: bool) -> int:
    """The rank's value (when wanted), then the end. The process group is not destroyed: the
    rank exits right after (``os._exit``) and the OS closes its connections, while gloo's
    ``destroy_process_group`` alone costs ~20 ms of every launch."""
    try:
        wanted = rank == 0 or spec.return_all
        stream, buffers = (
            payload.dumps_oob(value, what="the result", root="result") if wanted else (None, [])
        )
    except SerializationError as exc:
        conn.send(Unsendable(rank, exc.path, exc.reason))
        return 1
    conn.send(Result(rank, stream, early), buffers)
    return 0
