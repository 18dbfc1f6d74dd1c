"""Detached runs: training that outlives the kernel that started it.

``notebook_launch(..., detach=True)`` and ``%%ddp --detach`` give the ranks a supervisor of
their own, outside the kernel's process tree: forked by the kernel's pre-warmed helper away
from every tree (``worker/helper/leaving.py``), it runs the launch through the same backend an
attached launch uses, writes every event into the run's directory as it comes, and serves any
kernel that attaches, until the run ends. Then it exits, and nothing of the run is left
running; if it is killed, its ranks die with it.

    spawn.py       the kernel starts the supervisor and hands it the launch
    supervisor.py  the supervisor: the backend, the record, the attached kernels
    recorder.py    its RunEvents: record + every attached kernel + status.json
    records.py     events.log: append-only frames, readable while growing and after a crash
    outcome.py     the end: status, error (rebuilt in the reading kernel), value
    link.py        what the supervisor and attached kernels say (HMAC handshake, run's key)
    attached.py    a kernel's view: replay the record, then follow live; nbddp.attach
    replay.py      events into a Run's state
    store.py       run directories, ownership, liveness, retention
    info.py        nbddp.runs(), RunInfo, forget
    batch.py       on Slurm: a batch job (queue.py: what squeue says of it)
    launching.py   a detached launch: start the supervisor (or submit), then follow

Non-goal: Ray (refused in ``plan.py``: Ray has no users, so a run cannot be kept its owner's).
"""
