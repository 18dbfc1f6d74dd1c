"""What each rank runs: connect, receive the job, join the process group, call fn, report.

The generated ``__main__`` script only calls :func:`main`. A rank reads the job spec from the
run's private directory (``spec.json``: the channel's address and key), its rank and the
rendezvous from the torchrun environment, and the job itself (the pickled call) from the
kernel over the channel, after the handshake.

A rank whose ``fn`` returned (or called ``sys.exit(0)``) sends its result and then runs what a
Python program runs when it ends (``worker/rank/exiting.py``: exit handlers, then the processes it
started get SIGTERM), within ``JobSpec.exit_timeout``; a rank that failed ends at once.

A rank never outlives the kernel: a daemon thread blocks on the channel, and when the kernel
end closes (kernel exit, restart, SIGKILL) the rank kills its own process group at once. It is
the reaper of its descendants' orphans and ends all of them before it exits, so nothing it
started survives it, whatever session they moved to.
"""

from __future__ import annotations

import os
import threading

from nbddp.wire import transport
from nbddp.wire.call import loads_call
from nbddp.wire.frames import Connection
from nbddp.wire.messages import AllJoined, Failed, Hello, Shown, Trained
from nbddp.wire.prompts import Release, Reply
from nbddp.wire.spec import SPEC, JobSpec
from nbddp.wire.stacks import AskStacks
from nbddp.worker.debugging import asking
from nbddp.worker.diagnosis import stacks, sync_check
from nbddp.worker.output import rich
from nbddp.worker.rank.exiting import exit_normally
from nbddp.worker.rank.job import join_process_group, kill_own_group, receive_job, send_result
from nbddp.worker.rank.runtime import Call, RankProcess
from nbddp.worker.reaping import become_subreaper, end_descendants
from nbddp.worker.recovery import stopping
from nbddp.worker.streams import flush_output


def main(directory: str) -> int:
    become_subreaper()
    with open(os.path.join(directory, SPEC), "rb") as f:
        spec = JobSpec.from_json(f.read())
    rank = int(os.environ["RANK"])
    stacks.install(directory, rank)
    conn = transport.connect(spec.address, bytes.fromhex(spec.authkey))
    conn.send(Hello(rank))
    if spec.session:
        from nbddp.worker.rank.session import serve

        code = serve(spec, rank, conn)
    else:
        joined = threading.Event()
        code = _run(spec, rank, conn, joined)
        if code == 0:
            joined.wait()  # a peer still joining needs us (rank 0 serves the rendezvous store)
    if code == 0:  # ended normally: exit handlers and the processes it started, bounded
        exit_normally(conn, rank, spec.exit_timeout)
    end_descendants()
    flush_output()
    os._exit(code)  # no interpreter shutdown: a user thread or child cannot hold the run


def _listen(
    conn: Connection, rank: int, joined: threading.Event, agreement: stopping.Agreement
) -> None:
    """The kernel's word after the job: ``AllJoined``, ``Shown``, a roll-call, a graceful
    stop's agreement (answered even while fn waits in a collective: see ``stopping.py``), a
    reply to pdb's prompt or a release from ``nbddp.breakpoint()``. Its end closing means it
    is gone, and so is this rank, at once, with its whole process group."""
    try:
        while True:
            message = conn.recv().message
            if isinstance(message, AllJoined):
                joined.set()
            elif isinstance(message, Shown):
                rich.shown()
            elif isinstance(message, AskStacks):
                stacks.answer(conn, rank, message)
            elif isinstance(message, (Reply, Release)):
                asking.received(message)
            else:
                stopping.listened(message, agreement, rank, conn.send)
    except (EOFError, OSError):
        pass
    kill_own_group()


def _run(spec: JobSpec, rank: int, conn: Connection, joined: threading.Event) -> int:
    """Receive the job, join the process group, call fn and report; the exit code."""
    frame = receive_job(conn, rank)
    job, fds = frame.message, frame.fds
    del frame  # the job is held by ``job`` alone, and dropped before fn runs
    store = fds.pop() if job.store and fds else None
    process = RankProcess(spec, rank, conn)
    agreement = stopping.for_rank(conn.send, rank)
    threading.Thread(
        target=_listen, args=(conn, rank, joined, agreement), name="nbddp-listener", daemon=True
    ).start()
    prepared = Call.run(process.prepare)
    if prepared.failure is not None:
        flush_output()
        conn.send(Failed(rank, prepared.failure))
        return 1
    context = prepared.value
    checked = context.world_size > 1  # "did DDP happen?" means something

    def body() -> object:
        nonlocal job
        fn, args, kwargs = loads_call(job.call, job.shared, fds, context.device)
        del job  # the pickled call is not kept while fn runs
        join_process_group(spec, rank, context.world_size, store)
        process.joined()
        return fn(*args, **kwargs)

    with process.runtime.call(
        agreement,
        process.checkpoints(),
        sources=job.sources,
        output=spec.output,
        world_size=context.world_size,
        debug=spec.debug,
        checked=checked,
        context=context,
    ) as call:
        ended = call.run(body)
    flush_output()
    if ended.failure is not None:
        conn.send(Failed(rank, ended.failure))
        return ended.failure.exitcode or 1  # a script's own code, else 1
    check = sync_check.report() if checked else None
    if check is not None:
        conn.send(Trained(rank, check))
    # The process group is not destroyed: the rank exits right after its exit work
    # (``os._exit``) and the OS closes its connections, while gloo's ``destroy_process_group``
    # alone costs ~20 ms.
    wanted = rank == 0 or spec.return_all
    return 0 if send_result(conn, rank, ended.value, ended.early, wanted) else 1
