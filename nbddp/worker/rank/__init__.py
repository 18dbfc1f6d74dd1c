"""A rank's own process: from the spec to ``os._exit``.

A launched rank (``entry``), a session's rank (``session``), what both do (``job``: the job
received, the notebook's paths and logging adopted, the device, the value sent back), the
process group and the user's own ``init_process_group`` answered from it (``world``), a
rank's error (``report``), a normal end's exit work (``exiting``), a ``%%ddp`` cell on a rank
(``cell``), ``nbddp.spawn``'s calling convention (``spawned``), notebook code in the rank's own
worker processes (``notebook_code``).
"""
