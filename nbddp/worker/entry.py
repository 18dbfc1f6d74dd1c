"""What each rank runs: connect, receive the job, join the process group, call fn, report.

The generated ``__main__`` script only calls :func:`main`. A rank reads the job spec from the
run's private directory (``spec.json``: the channel's address and key), its rank and the
rendezvous from the torchrun environment, and the job itself (the pickled call) from the
kernel over the channel, after the handshake.

A rank whose ``fn`` returned (or called ``sys.exit(0)``) sends its result and then runs what a
Python program runs when it ends (``worker/exiting.py``: exit handlers, then the processes it
started get SIGTERM), within ``JobSpec.exit_timeout``; a rank that failed ends at once.

A rank never outlives the kernel: a daemon thread blocks on the channel, and when the kernel
end closes (kernel exit, restart, SIGKILL) the rank kills its own process group at once. It is
the reaper of its descendants' orphans and ends all of them before it exits, so nothing it
started survives it, whatever session they moved to.
"""

from __future__ import annotations

import os
import threading

from nbddp.wire import payload, transport
from nbddp.wire.call import loads_call
from nbddp.wire.frames import Connection
from nbddp.wire.messages import AllJoined, Failed, Hello, Joined, Shown, Trained
from nbddp.wire.prompts import Release, Reply
from nbddp.wire.spec import SPEC, JobSpec
from nbddp.wire.stacks import AskStacks
from nbddp.wire.stopping import Checkpointed, StopRequested
from nbddp.worker import (
    asking,
    checkpoints,
    debugger,
    integrations,
    live,
    rich,
    stacks,
    stopping,
    sync_check,
)
from nbddp.worker.exiting import exit_normally, skip_import_finalizers
from nbddp.worker.reaping import become_subreaper, end_descendants
from nbddp.worker.report import ChannelSink, error_report
from nbddp.worker.setup import (
    flush_output,
    join_process_group,
    kill_own_group,
    prepare,
    receive_job,
    send_result,
)


def main(directory: str) -> int:
    become_subreaper()
    with open(os.path.join(directory, SPEC), "rb") as f:
        spec = JobSpec.from_json(f.read())
    rank = int(os.environ["RANK"])
    stacks.install(directory, rank)
    conn = transport.connect(spec.address, bytes.fromhex(spec.authkey))
    conn.send(Hello(rank))
    if spec.session:
        from nbddp.worker.session import serve

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
    from nbddp.worker.context import installed

    frame = receive_job(conn, rank)
    job, fds = frame.message, frame.fds
    del frame  # the job is held by ``job`` alone, and dropped before fn runs
    store = fds.pop() if job.store and fds else None
    agreement = stopping.for_rank(conn.send, rank)
    stopping.install(agreement)
    stopping.ask_on_signal(lambda: conn.send(StopRequested(rank, stopping.SIGNALLED)))
    checkpoints.configure(
        spec.checkpoint_dir or None,
        spec.keep,
        lambda *saved: conn.send(Checkpointed(rank, *saved)),
    )
    threading.Thread(
        target=_listen, args=(conn, rank, joined, agreement), name="nbddp-listener", daemon=True
    ).start()
    early_exit = checked = False
    try:
        payload.install_sources(job.sources)
        context = prepare(spec, rank, conn)
        integrations.install(spec.output)  # before unpickling: see install()
        with installed(context):
            fn, args, kwargs = loads_call(job.call, job.shared, fds, context.device)
            del job  # the pickled call is not kept while fn runs
            join_process_group(spec, rank, context.world_size, store)
            conn.send(Joined(rank))
            buffer = live.LiveBuffer(ChannelSink(conn, rank))
            live.install(buffer)
            rich.configure(conn.send, rank, spec.output)
            asking.configure(
                asking.Link(conn.send, rank, context.world_size, spec.output, debug=spec.debug)
            )
            checked = context.world_size > 1  # "did DDP happen?" means something
            if checked:
                sync_check.install()
            skip_import_finalizers()
            try:
                value = fn(*args, **kwargs)
            finally:
                rich.finish()  # figures left open go to the cell, before the outcome
                buffer.close()  # every logged row reaches the kernel before the outcome
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return _failed(conn, rank, exc)
        value, early_exit = None, True
    except BaseException as exc:
        debugger.post_mortem(exc)  # debug=True: pdb at the failing frame, the others held
        return _failed(conn, rank, exc)
    finally:
        flush_output()
    check = sync_check.report() if checked else None
    if check is not None:
        conn.send(Trained(rank, check))
    # The process group is not destroyed: the rank exits right after its exit work
    # (``os._exit``) and the OS closes its connections, while gloo's ``destroy_process_group``
    # alone costs ~20 ms.
    return 0 if send_result(conn, rank, value, early_exit, rank == 0 or spec.return_all) else 1


def _failed(conn: Connection, rank: int, exc: BaseException) -> int:
    """Report the rank's failure; the process's exit code (a script's own, else 1)."""
    report = error_report(exc)
    conn.send(Failed(rank, report))
    return report.exitcode or 1
