"""The last step of an exported script's rank (``runner.py`` calls it after
``destroy_process_group``): wait until gloo's worker threads are asleep, so none is unwound
out of C++ by the interpreter's end.

Copied whole into each exported script before ``runner.py``'s class: it imports only the
standard library, and its one top-level name is :func:`nbddp_let_gloo_settle`.
"""


def nbddp_let_gloo_settle(limit: float = 2.0) -> None:
    """Return once gloo's worker threads are all asleep (at most ``limit`` seconds).

    An allreduce DDP starts in backward carries autograd's context, a Python object, and
    gloo's worker thread frees it after the work is done, taking the GIL. A worker that
    asks for the GIL as the interpreter finalizes is unwound out of C++ and the rank
    aborts ('terminate called without an active exception', SIGABRT) after its value was
    saved, so torchrun reports the run failed: 6 times in 700 runs of the docs' export
    block, four at once on two cores. Plain DDP scripts share the race, and
    ``destroy_process_group`` does not end it: once DDP used the group, torch keeps the
    group and its threads alive.

    Sleeping releases the GIL, so a worker waiting for it gets it; a worker that is
    running shows as such in ``/proc``. Two looks a sleep apart that find every worker
    asleep (waiting for work) mean none can ask for the GIL again. Where there is no
    ``/proc`` (not Linux) or no gloo worker, this returns at once. Not covered: a worker
    still inside a collective nobody waited for (it sleeps on the network)."""
    import os
    import time

    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return
    deadline = time.monotonic() + limit
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        states = []
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/comm") as f:
                    if f.read().strip() != "pt_gloo_runloop":
                        continue
                with open(f"{tasks}/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # the thread is gone
                continue
        if not states:
            return
        quiet = quiet + 1 if all(state == "S" for state in states) else 0
        time.sleep(0.01)
