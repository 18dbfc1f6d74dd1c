"""Slurm allocations to launch on: the one this kernel runs in (``cluster="slurm"``), or one
:class:`SlurmCluster` asks for from a login node and keeps.

Either way the allocation's nodes are read from Slurm (``commands.py``: names in Slurm's
order, each node's ``NodeAddr``, the CPUs and GPUs the job holds there), and one node helper
per node is started through ``srun --overlap`` at the first launch and kept warm for later
launches and sessions (``link.py``).

An allocation nbddp asked for asks Slurm for SIGUSR1 ``SIGNAL_LEAD`` seconds before its time limit,
sent to its steps: the node helpers ignore it, and each rank asks the kernel for a graceful stop
(``worker/recovery/stopping.py``). It is a sleeper job (``sbatch --wrap 'sleep infinity'``, as
submitit and ipyparallel submit theirs): while it is pending its queue state is printed as it
changes; an interrupt then cancels it; ``close()``, the kernel's exit (``atexit``) and a failed
wait cancel it too, so nothing is left queued or running. The allocation a kernel runs in is never
cancelled by nbddp: it only ends its own step.

Non-goal: the launch itself (``../ranks.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nbddp.clusters.placement import NodeInfo
from nbddp.clusters.slurm import commands
from nbddp.clusters.slurm.commands import SlurmCommandError
from nbddp.errors import NbddpError

if TYPE_CHECKING:
    from nbddp.clusters.slurm.link import HelperLink, HelperStep

POLL_QUEUE = 1.0  # seconds between looks at a pending job's state
# Seconds before the time limit at which Slurm signals the job's steps (SIGUSR1): the ranks
# then stop gracefully (Slurm sends it up to a minute early or late; the default stop_grace
# is 60 s). Options of the user's own ``--signal`` in extra_args win.
SIGNAL_LEAD = 120
CANCEL_WAIT = 30.0  # seconds for a cancelled job to leave the queue

_lock = threading.Lock()
_current: dict[str, SlurmCluster] = {}  # the allocation this kernel runs in, by job id


def current_allocation() -> SlurmCluster:
    """The allocation this kernel runs in (``SLURM_JOB_ID``), for ``cluster="slurm"``."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise ValueError(
            "cluster='slurm' runs the ranks on the Slurm allocation this kernel runs in, but "
            "this kernel is not in one (no SLURM_JOB_ID in its environment). From a login "
            "node, ask Slurm for one: cluster=nbddp.SlurmCluster(nodes=2, gpus_per_node=..., "
            "time='1:00:00'), start the notebook inside an allocation (salloc, sbatch), or "
            "write the launch as a batch job: nbddp.export(fn, 'train.py', num_workers=..., "
            "nodes=...) then `sbatch train.sbatch`."
        )
    with _lock:
        cluster = _current.get(job_id)
        if cluster is None:
            cluster = _current[job_id] = SlurmCluster._inside(job_id)
        return cluster


class SlurmCluster:
    """A Slurm allocation asked for from this kernel (a login node's), kept for later launches
    and sessions, released by ``close()`` or the kernel's exit. ``nodes``, ``gpus_per_node``,
    ``partition``, ``time`` (Slurm's format: ``"1:00:00"``, or minutes) and ``account`` are
    sbatch's options of the same names; ``extra_args`` more of them (``["--qos=debug"]``).
    The allocation is asked for at the first launch (or ``allocate()``).

    Args:
        partition: sbatch's ``--partition``.
        nodes: sbatch's ``--nodes``.
        gpus_per_node: sbatch's ``--gpus-per-node``.
        time: sbatch's ``--time``: ``"1:00:00"``, or minutes.
        account: sbatch's ``--account``.
        extra_args: More sbatch options, as on its command line (``["--qos=debug"]``).

    Raises:
        ValueError: An option is not of its kind. At the first launch (or ``allocate()``),
            a job Slurm would refuse is a ``ValueError`` too, with Slurm's reason, before
            anything is queued (``sbatch --test-only`` first).
    """

    def __init__(
        self,
        partition: str | None = None,
        nodes: int | None = None,
        gpus_per_node: int | None = None,
        time: str | int | None = None,
        account: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self._options = _sbatch_options(partition, nodes, gpus_per_node, time, account, extra_args)
        self.partition, self.nodes, self.gpus_per_node = partition, nodes, gpus_per_node
        self.time, self.account, self.extra_args = time, account, tuple(extra_args)
        self.job_id: str | None = None
        self._owned = True  # nbddp asked for it: nbddp cancels it
        self._closed = False
        self._at_exit = False  # close() is registered to run at the kernel's exit
        self._lock = threading.RLock()
        self._infos: list[NodeInfo] | None = None
        self._step: HelperStep | None = None

    @classmethod
    def _inside(cls, job_id: str) -> SlurmCluster:
        cluster = cls()
        cluster.job_id, cluster._owned = job_id, False
        return cluster

    def __repr__(self) -> str:
        if not self._owned:
            return f"SlurmCluster(the allocation this kernel runs in: job {self.job_id})"
        state = "closed" if self._closed else f"job {self.job_id}" if self.job_id else "not asked"
        return f"SlurmCluster({' '.join(self._options) or 'defaults'}; {state})"

    # -- the allocation ----------------------------------------------------------------------

    def allocate(self) -> str:
        """Ask Slurm for the allocation unless this cluster has it; wait until it runs,
        printing its queue state as it changes. Its job id."""
        with self._lock:
            if self._closed:
                raise ValueError(
                    f"{self!r} was closed (its allocation released): make a new "
                    "nbddp.SlurmCluster(...) to launch again."
                )
            if self.job_id is None:
                try:
                    self.job_id = commands.submit_sleeper(self._options)
                except SlurmCommandError as exc:
                    raise ValueError(
                        f"Slurm refused the allocation nbddp.SlurmCluster asked for: {exc}. "
                        "Ask for what the cluster has (`sinfo` lists its partitions and nodes)."
                    ) from None
                self._close_at_exit()
                try:
                    self._wait_running()
                except BaseException:
                    self.close()
                    raise
            return self.job_id

    def _wait_running(self) -> None:
        assert self.job_id is not None
        shown = False
        # the kernel's wait, never a detached run's supervisor's: it alone loads the display
        from nbddp.display.notice import Notice

        notice = Notice()  # one line in the cell, updated as the job's state changes
        while True:
            state, reason = commands.job_state(self.job_id)
            if state == "RUNNING":
                if shown:
                    notice.show(f"Slurm job {self.job_id} is running: launching.")
                return
            if reason in commands.NEVER:
                raise ValueError(
                    f"Slurm job {self.job_id} can never start: {reason} (it asks for more than "
                    f"the partition, account or QOS allow: {' '.join(self._options)}). Ask for "
                    "what the cluster has (`sinfo` lists its partitions and nodes)."
                )
            if state == "" or state in commands.ENDED:
                raise NbddpError(
                    f"Slurm job {self.job_id}, the allocation nbddp asked for, ended before it "
                    f"ran ({state or 'it left the queue'}{f': {reason}' if reason else ''})."
                )
            shown = True
            notice.show(
                f"Slurm job {self.job_id} is {state}"
                f"{f' ({reason})' if reason and reason != 'None' else ''}: waiting for "
                f"its allocation ({' '.join(self._options) or 'defaults'}). Interrupt "
                "the kernel to cancel it."
            )
            time.sleep(POLL_QUEUE)

    def _close_at_exit(self) -> None:
        if not self._at_exit:
            self._at_exit = True
            atexit.register(self.close)

    def close(self) -> None:
        """End the node helpers (and their ranks); cancel the allocation if nbddp asked for
        it, and wait until it left the queue. Idempotent. The kernel's exit calls it."""
        with self._lock:
            step, self._step = self._step, None
            if step is not None:
                step.close()
            if self._at_exit:
                self._at_exit = False
                atexit.unregister(self.close)
            if not self._owned or self._closed:
                return
            self._closed = True
            job_id = self.job_id
        if job_id is None:
            return
        with contextlib.suppress(SlurmCommandError):
            commands.cancel(job_id)
            deadline = time.monotonic() + CANCEL_WAIT
            while commands.job_state(job_id)[0] and time.monotonic() < deadline:
                time.sleep(0.2)  # COMPLETING, then gone

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the launch asks ----------------------------------------------------------------

    def alive_nodes(self) -> list[NodeInfo]:
        """The allocation's nodes (asking for it first if this cluster has none yet)."""
        with self._lock:
            if self._infos is None:
                job_id = self.allocate() if self._owned else self.job_id
                assert job_id is not None
                try:
                    self._infos = commands.job_nodes(job_id)
                except SlurmCommandError as exc:
                    raise ValueError(
                        f"cannot read Slurm job {job_id}'s nodes ({exc}). Is the job still "
                        "running (`squeue`)?"
                    ) from None
            return list(self._infos)

    def helpers(self, count: int) -> list[HelperLink]:
        """The helpers of the allocation's first ``count`` nodes, started on first use (one
        step for every node of the allocation) and again after one was lost."""
        from nbddp.clusters.slurm.link import HelperStep

        with self._lock:
            nodes = self.alive_nodes()
            if self._step is not None and not self._step.alive:
                self._step.close()
                self._step = None
            if self._step is None:
                assert self.job_id is not None
                self._close_at_exit()
                self._step = HelperStep(self.job_id, nodes)
            return [self._step.links[node.id] for node in nodes[:count]]


def _sbatch_options(
    partition: Any, nodes: Any, gpus_per_node: Any, time: Any, account: Any, extra_args: Any
) -> list[str]:
    """SlurmCluster's arguments as sbatch's options; ValueError for one that is not."""
    options = []
    for name, value in (("partition", partition), ("account", account)):
        if value is not None:
            if not isinstance(value, str) or not value or value.startswith("-"):
                raise ValueError(f"SlurmCluster({name}={value!r}): a {name}'s name, or None.")
            options.append(f"--{name}={value}")
    for name, value, least in (("nodes", nodes, 1), ("gpus_per_node", gpus_per_node, 0)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < least
        ):
            raise ValueError(
                f"SlurmCluster({name}={value!r}) must be a whole number >= {least}, or None "
                "(Slurm's default)."
            )
    if nodes is not None:
        options.append(f"--nodes={nodes}")
    options.append("--ntasks-per-node=1")
    if gpus_per_node:  # and a CPU per GPU rank at least (Slurm gives one per task otherwise)
        options += [f"--gpus-per-node={gpus_per_node}", f"--cpus-per-task={gpus_per_node}"]
    if time is not None:
        valid = isinstance(time, int) and not isinstance(time, bool) and time > 0
        if not valid and not (isinstance(time, str) and time and not time.startswith("-")):
            raise ValueError(
                f"SlurmCluster(time={time!r}): Slurm's time limit, e.g. '1:00:00' or 90 (minutes)."
            )
        options.append(f"--time={time}")
    if not any(str(arg).startswith("--signal") for arg in extra_args or ()):
        options.append(f"--signal=USR1@{SIGNAL_LEAD}")  # the steps: helpers and ranks
    if isinstance(extra_args, str) or not all(isinstance(a, str) for a in extra_args):
        raise ValueError(
            f"SlurmCluster(extra_args={extra_args!r}) must be a list of sbatch options, e.g. "
            "['--qos=debug', '--constraint=a100']."
        )
    for arg in extra_args:
        if not arg.startswith("-"):
            raise ValueError(
                f"SlurmCluster(extra_args=[..., {arg!r}, ...]): each is one sbatch option with "
                "its value, e.g. '--qos=debug' (not '--qos', 'debug')."
            )
    return [*options, *extra_args]
