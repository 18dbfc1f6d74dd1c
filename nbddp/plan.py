"""What one launch will do: the frozen :class:`LaunchPlan`, its option types and defaults, and
the job spec every rank of a plan gets.

Non-goal: checking and resolving options (``planning.py`` turns ``notebook_launch``'s arguments
into a plan, and raises every ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from nbddp.environment import notebook_logging
from nbddp.recovery import KEEP, STOP_GRACE
from nbddp.wire.messages import Output
from nbddp.wire.spec import JobSpec

if TYPE_CHECKING:
    from nbddp.clusters.placement import Cluster

EXIT_TIMEOUT = JobSpec.exit_timeout  # seconds, unless NBDDP_EXIT_TIMEOUT says otherwise

DeviceOption = Literal["auto", "cuda", "cpu"]
Device = Literal["cuda", "cpu"]
# torch.distributed's backend; not the execution seam, which is ``backend.Backend``
DistBackend = Literal["nccl", "gloo"]
Display = Literal["auto", "widget", "text", "none"]

DEVICE_OPTIONS: tuple[str, ...] = get_args(DeviceOption)
BACKENDS: tuple[str, ...] = get_args(DistBackend)
DISPLAYS: tuple[str, ...] = get_args(Display)
OUTPUTS: tuple[str, ...] = get_args(Output)
STALL_AFTER = 120.0  # default seconds without progress before the panel shows where ranks are
STALL_HELP = "seconds without progress before the panel shows where ranks are (none: off)"


@dataclass(frozen=True)
class LaunchPlan:
    """What one launch will do, with nothing left to resolve."""

    world_size: int
    device: Device
    backend: DistBackend
    # Each rank's GPU (cuda only): the kernel's index, or a UUID ("GPU-…", "MIG-…");
    # equal entries mean shared GPUs (``devices.py``).
    gpus: tuple[int | str, ...] = ()
    timeout: float | None = None
    display: Display = "auto"
    output: Output = "rank0"
    return_all: bool = False
    block: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    cluster: Cluster | None = None  # a RayCluster or SlurmCluster, or None: this machine
    nodes: int = 1
    workers_per_node: int = 0  # on one machine: world_size
    exit_timeout: float = EXIT_TIMEOUT  # a rank's exit work's bound (NBDDP_EXIT_TIMEOUT)
    stall_after: float | None = STALL_AFTER  # seconds without progress before the banner
    debug: bool = False  # an uncaught exception on a rank opens post-mortem pdb first
    checkpoint_dir: str = ""  # absolute; "": the ranks' default (outside notebook_launch)
    keep: int = KEEP  # complete checkpoints kept
    max_restarts: int = 0  # whole-world restarts after a failure
    stop_grace: float = STOP_GRACE  # seconds a graceful stop may take
    detach: bool = False  # the ranks belong to a supervisor outside the kernel (detached/)
    batch: tuple[str, ...] = ()  # a detached run on Slurm: its batch job's sbatch options
    processes: bool = False  # ranks are processes even with one (a script's: run_script)

    @property
    def in_kernel(self) -> bool:
        """One rank on this machine runs in the kernel itself: no worker process at all."""
        return (
            self.world_size == 1 and self.cluster is None and not self.detach and not self.processes
        )


def job_spec(
    plan: LaunchPlan,
    run_id: str,
    device_index: tuple[int, ...],
    session: bool,
    sys_path: tuple[str, ...] = (),
    cwd: str = "",
) -> JobSpec:
    """What every rank of ``plan`` needs before it connects, wherever it runs. The channel's
    address and key are filled in by the group that listens; a cluster node fills in its own
    ``sys_path`` and ``cwd``."""
    return JobSpec(
        address="",
        authkey="",
        run_id=run_id,
        sys_path=sys_path,
        cwd=cwd,
        device=plan.device,
        device_index=device_index,
        backend=plan.backend,
        return_all=plan.return_all,
        output=plan.output,
        logging=notebook_logging(),
        session=session,
        exit_timeout=plan.exit_timeout,
        debug=plan.debug,
        checkpoint_dir=plan.checkpoint_dir,
        keep=plan.keep,
    )
