"""What every rank does, launched or in a session: receive its job, adopt the notebook's paths
and logging, set up its device, report its value, and end its whole process group when the
kernel is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from nbddp.errors import SerializationError
from nbddp.wire import payload
from nbddp.wire.frames import Connection, Frame
from nbddp.wire.messages import DeviceName, Failed, Job, Result, Unsendable
from nbddp.wire.spec import JobSpec
from nbddp.wire.stacks import AskStacks
from nbddp.worker.diagnosis import collective_watch, stacks

if TYPE_CHECKING:
    from nbddp.worker.context import Context
from nbddp.worker.rank import notebook_code
from nbddp.worker.rank.report import error_report
from nbddp.worker.streams import flush_output


def receive_job(conn: Connection, rank: int) -> Frame:
    """The kernel's first word after the hello: the job. A roll-call may come first (the user
    asked where the ranks are while this one was starting): it is answered, and the wait goes
    on."""
    while True:
        frame = conn.recv()
        if isinstance(frame.message, Job):
            return frame
        if not isinstance(frame.message, AskStacks):
            raise RuntimeError(
                f"nbddp bug: the kernel sent {type(frame.message).__name__} before the job"
            )
        stacks.answer(conn, rank, frame.message)


def kill_own_group() -> None:
    """The kernel is gone, so is this rank, at once, with DataLoader workers and the like."""
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


def prepare(spec: JobSpec, rank: int, conn: Connection) -> Context:
    """What a rank sets up before the process group: the notebook's paths and logging, its
    device (named to the kernel by rank 0), and the ``nbddp.rank()`` context to install."""
    import torch

    from nbddp.worker.context import Context
    from nbddp.worker.rank import world

    world.intercept()  # before the job is unpickled (see world.py)
    _adopt_kernel_paths(spec)
    _adopt_kernel_logging(spec)
    notebook_code.install()  # the rank's DataLoader workers get notebook classes, any start method
    if spec.device == "cuda":
        device = torch.device("cuda", spec.device_index[rank])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        conn.send(DeviceName(rank, name))
    watch_collectives(conn, rank)
    return Context(
        rank=rank,
        local_rank=int(os.environ["LOCAL_RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        device=device,
    )


_FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}


def finish_device_work() -> None:
    """Wait for the GPU work this rank queued (NCCL collectives included): an NCCL
    ``all_reduce`` returns at once, and a rank that ends before its kernel ran would leave its
    peers waiting in theirs. A slow peer makes this wait, as the next collective would; one
    that never comes is the collective watch's (``collective_watch.py``)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def watch_collectives(conn: Connection, rank: int) -> None:
    """A collective that waits past its timeout ends this rank, reported as its failure."""

    def fail(error: BaseException) -> None:
        with contextlib.suppress(OSError, EOFError):
            conn.send(Failed(rank, error_report(error)))
        flush_output()
        kill_own_group()

    collective_watch.configure(fail)


def join_process_group(
    spec: JobSpec, rank: int, world_size: int, store_socket: int | None = None
) -> None:
    """The default group, on the rendezvous of the torchrun environment nbddp set for this
    rank; from now on the rank's own ``init_process_group`` is answered from it (world.py).

    ``store_socket`` (rank 0's): the rendezvous store's socket, bound and listening since
    before any rank started, so a peer that knocks early waits in its backlog instead of being
    refused (torch's store client then backs off for 0.3-1 s, a stall one launch in a few
    paid). Rank 0 serves the store on it; every rank builds what ``env://`` would build."""
    from nbddp.worker.rank import world

    if not _FLIGHT_RECORDER & set(os.environ):
        # torch's flight recorder says which collective a rank is in (the default in newer
        # torch): gloo's and NCCL's recorders both read it
        os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    world.join(spec.backend, rank, world_size, _rendezvous_store(rank, world_size, store_socket))


def _rendezvous_store(rank: int, world_size: int, listening: int | None) -> Any:
    """The store of the torchrun environment's rendezvous; None (``env://`` binds the port)
    for a rank 0 that was handed no socket."""
    if listening is None and rank == 0:
        return None
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    return dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=listening is not None,
        timeout=default_pg_timeout,
        multi_tenant=True,
        master_listen_fd=listening,
    )


def send_result(conn: Connection, rank: int, value: Any, early: bool, wanted: bool) -> bool:
    """The rank's value (pickled only when ``wanted``), or why it cannot travel; True if sent.
    First the rank's GPU work completes: a collective ``fn`` issued just before it returned
    must not die with this process (a peer would then wait for its half for ever)."""
    finish_device_work()
    collective_watch.disarm()  # the job's code is over: nothing of it can time out now
    try:
        stream, buffers = (
            payload.dumps_oob(value, what="the result", root="result") if wanted else (None, [])
        )
    except SerializationError as exc:
        conn.send(Unsendable(rank, exc.path, exc.reason))
        return False
    conn.send(Result(rank, stream, early), buffers)
    return True
