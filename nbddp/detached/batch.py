"""Detached runs on Slurm: a batch job whose script is the run's supervisor.

No allocation needs to stay open for the kernel: the launch is written into the run's
directory (``job.pkl``: the call with its bytes, the kernel's directory, path and
environment), which must be on a filesystem the job's nodes see (``NBDDP_RUNS_DIR``), and
submitted with ``sbatch``; the job's first node runs the supervisor, which starts the node
helpers of its own allocation exactly as an attached ``cluster="slurm"`` launch does, records
the run and listens on the node's address for kernels that attach (TCP, the run's key). The
job ends with the run. While it waits in the queue, the kernel's view says so; a stop then
cancels the job.

Non-goal: the supervisor's side (``supervisor.py``, ``main_batch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import shlex
import socket
import sys
from typing import Any

from nbddp import interrupts
from nbddp.clusters.slurm import commands
from nbddp.clusters.slurm.commands import SlurmCommandError
from nbddp.detached import retention, store
from nbddp.detached.link import Handoff
from nbddp.plan import LaunchPlan
from nbddp.wire.call import Call

JOB = "job.pkl"
POLL_QUEUE = 1.0  # seconds between looks at a waiting job
_SCRIPT = """\
# Written by nbddp: the supervisor of detached run {run_id}, as its Slurm batch job's script.
if __name__ == "__main__":
    import os
    import sys

    sys.path.append({package_parent!r})
    from nbddp.detached.supervisor import main_batch

    os._exit(main_batch({directory!r}))
"""


def node_address() -> str:
    """This node's address as Slurm reaches it (its ``NodeAddr``), for kernels to attach."""
    name = os.environ.get("SLURMD_NODENAME")
    if name:
        try:
            return commands.node_addresses([name])[name]
        except SlurmCommandError:
            pass
    return socket.gethostbyname(socket.gethostname())


def submit(run: store.StoredRun, plan: LaunchPlan, call: Call, handoff: Handoff) -> str:
    """Write the launch into the run's directory and submit its batch job; the job's id.
    An impossible request raises (Slurm's reason) before anything is queued."""
    job = handoff._replace(plan=dataclasses.replace(plan, cluster=None))  # G: its allocation
    data = pickle.dumps((job, [bytes(b) for b in call.buffers]), protocol=5)
    fd = os.open(run.join(JOB), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = run.join("supervisor.py")
    text = _SCRIPT.format(run_id=run.id, package_parent=package_parent, directory=run.path)
    fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    command = [
        "sbatch",
        f"--job-name=nbddp-{run.id}",
        f"--output={run.join('supervisor.log')}",
        f"--chdir={os.getcwd()}",
        *plan.batch,
        f"--wrap=exec {shlex.quote(sys.executable)} {shlex.quote(script)}",
    ]
    try:
        commands.run([command[0], "--test-only", *command[1:]])
        job_id = commands.run([command[0], "--parsable", *command[1:]]).strip().split(";")[0]
    except SlurmCommandError as exc:
        raise ValueError(
            f"Slurm refused the detached run's batch job: {exc}. Ask for what the cluster has "
            "(`sinfo` lists its partitions and nodes)."
        ) from None
    store.write_json(run.join(store.JOB_ID), {"job_id": job_id})
    return job_id


def cancel(job_id: str) -> None:
    with contextlib.suppress(SlurmCommandError):  # it ended meanwhile
        commands.cancel(job_id)


def submit_run(
    info: dict[str, Any], plan: LaunchPlan, call: Call, handoff: Handoff
) -> store.StoredRun:
    """A new run's directory and its batch job, submitted; nothing is left if it fails."""
    retention.sweep()
    with interrupts.deferred():
        run, lock = store.create({**info, "cluster": "slurm"})
        try:
            submit(run, plan, call, handoff._replace(directory=run.path))
        except BaseException:
            run.remove()
            raise
        finally:
            os.close(lock)  # from here on the job's state says whether it is supervised
            call.close()
    return run
