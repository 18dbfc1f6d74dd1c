"""The environment each rank sees, built in one place: the torchrun variables (for every rank
of a launch, and for the kernel itself when it runs one rank), thread and GPU settings (the GPUs
it sees; its ``LOCAL_RANK`` is its own one's index there: ``devices.py``), and the user's
``env=``.

The variables nbddp owns cannot be set through ``env=``: :func:`check_user_env` refuses them
and names the option that sets them instead.

A kernel inside a Slurm job, or one started by torchrun or mpirun, carries that launcher's
variables (``SLURM_*``, ``PMI_*``, ``OMPI_*``, ``RANK``...). No rank inherits them
(:func:`without_launchers`): a rank that did would believe that launcher started it (Lightning
picks its Slurm environment, mpi4py dials the job's PMI server, torch reuses an agent's store)
instead of seeing exactly the torchrun contract. ``env=`` may hand one on deliberately.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from nbddp.devices import GpuName, rank_devices

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface
WORKER_VARIABLE = "NBDDP_WORKER"  # set in every rank and in the helper: no helper of its own
RUN_ID_VARIABLE = "NBDDP_RUN_ID"  # every process of a run inherits it: how strays are found


def new_run_id() -> str:
    """A run's id: its kernel's pid (so a sweep can tell a dead kernel's) and a random part."""
    return f"nbddp-{os.getpid()}-{secrets.token_hex(4)}"


# What sets each variable nbddp owns, for the error that refuses it in env=.
_OWNED = {
    "RANK": "num_workers=",
    "LOCAL_RANK": "num_workers=",
    "GROUP_RANK": "num_workers=",
    "ROLE_RANK": "num_workers=",
    "WORLD_SIZE": "num_workers=",
    "LOCAL_WORLD_SIZE": "num_workers=",
    "ROLE_WORLD_SIZE": "num_workers=",
    "GROUP_WORLD_SIZE": "num_workers=",
    "ROLE_NAME": "nbddp itself",
    "MASTER_ADDR": "nbddp itself (the kernel's machine, 127.0.0.1)",
    "MASTER_PORT": "nbddp itself (a free port, new for every launch)",
    RUN_ID_VARIABLE: "nbddp itself",
    WORKER_VARIABLE: "nbddp itself",
}


# Set by a launcher or a scheduler for the processes *it* starts, and read by libraries to
# detect such a launch (Lightning, Accelerate, mpi4py, torch.distributed.elastic, submitit).
LAUNCHER_PREFIXES = (
    "SLURM_",  # Slurm: the job, the step and this task's place in it
    "SLURMD_",
    "SRUN_",
    "SBATCH_",
    "SALLOC_",
    "PMI_",  # the process-management interface of Slurm, MPICH, Intel MPI
    "PMIX_",
    "OMPI_",  # Open MPI (OMPI_COMM_WORLD_RANK ...)
    "MPI_",  # Intel MPI (MPI_LOCALRANKID ...)
    "MV2_",  # MVAPICH2
    "HYDRA_",  # MPICH's launcher
    "PALS_",  # Cray PALS
    "LSB_",  # LSF
    "JSM_NAMESPACE_",  # LSF's jsrun
    "PBS_",  # PBS / Torque
    "TORCHELASTIC_",  # torchrun's agent (nbddp sets its own)
    "HOROVOD_",  # horovodrun
    "SUBMITIT_",
)
LAUNCHER_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "NODE_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_SIZE",  # DeepSpeed's and Horovod's launchers
        "CROSS_RANK",
        "CROSS_SIZE",
    }
)


def is_launcher_variable(name: str) -> bool:
    return name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES)


def without_launchers(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less every launcher's and scheduler's variables (submitit's ``clean_env``,
    widened to MPI, LSF, PBS and torchrun)."""
    return {name: value for name, value in environ.items() if not is_launcher_variable(name)}


class Place(NamedTuple):
    """Where one rank sits, as torchrun describes it."""

    rank: int
    local_rank: int
    group_rank: int  # the node's rank
    world_size: int
    local_world_size: int
    group_world_size: int  # the number of nodes


def single_node(rank: int, world_size: int) -> Place:
    return Place(rank, rank, 0, world_size, world_size, 1)


def torchrun_env(place: Place, master_addr: str, master_port: int, run_id: str) -> dict[str, str]:
    """Exactly what torchrun sets for a rank, so Lightning and Accelerate recognise the launch
    (they look at ``TORCHELASTIC_RUN_ID`` and the ranks)."""
    return {
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "GROUP_RANK": str(place.group_rank),
        "ROLE_RANK": str(place.rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "ROLE_WORLD_SIZE": str(place.world_size),
        "GROUP_WORLD_SIZE": str(place.group_world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def store_socket(host: str = "127.0.0.1") -> socket.socket:
    """The rendezvous store's socket, bound to a free port and listening before any rank
    starts; rank 0 serves the store on it (``TCPStore(master_listen_fd=...)``). Ranks that
    connect first wait in its backlog: nobody is refused (torch's store client backs off for
    0.3-1 s when refused), and no other process can take the port between its choice and
    its use."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def interface_of(address: str) -> str | None:
    """The network interface that holds the IPv4 ``address`` on this machine (the loopback
    interface for any 127.x.y.z, which it serves whole)."""
    if address.startswith("127."):
        address = "127.0.0.1"
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on it
        if socket.inet_ntoa(reply[20:24]) == address:
            return name
    return None


def worker_env(
    place: Place,
    port: int,
    run_id: str,
    *,
    device: str,
    gpus: Sequence[GpuName],
    user_env: Mapping[str, str],
    master_addr: str = "127.0.0.1",
    interface: str | None = None,
) -> dict[str, str]:
    """This process's environment, less any launcher's variables, plus what torchrun would
    set, plus the user's ``env=``. ``interface``: the network interface gloo and NCCL use,
    unless the user set theirs (without it they pick the hostname's address, which may be the
    wrong one or none)."""
    env = without_launchers(os.environ)
    env.update(torchrun_env(place, master_addr, port, run_id))
    env[RUN_ID_VARIABLE] = run_id
    env[WORKER_VARIABLE] = str(place.rank)  # importing nbddp in a rank starts no helper
    env["PYTHONUNBUFFERED"] = "1"
    if "OMP_NUM_THREADS" not in os.environ:  # split the cores instead of oversubscribing them
        env["OMP_NUM_THREADS"] = str(max(1, available_cores() // place.local_world_size))
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        # launched from a Jupyter kernel (ipykernel set this): the notebook's inline backend,
        # as a rank can have it, figures going to the cell; and plotly's renderer, which a
        # process without IPython would make a web browser
        env["MPLBACKEND"] = "module://nbddp.worker.output.figures"
        env.setdefault("PLOTLY_RENDERER", _plotly_renderer())
    if device == "cuda":  # the GPUs it sees, and its own one's index there is its LOCAL_RANK
        seen, index = rank_devices(gpus)[place.local_rank]
        env["CUDA_VISIBLE_DEVICES"] = seen
        env["LOCAL_RANK"] = str(index)
    else:  # Accelerator() sees CPU ranks as one job only when told (accelerate launch --cpu)
        env["ACCELERATE_USE_CPU"] = "true"
    if interface is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.setdefault(name, interface)
    env.update(user_env)
    return env


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def device_indices(gpus: Sequence[GpuName]) -> tuple[int, ...]:
    """Each rank's cuda index inside its process (``devices.rank_devices``)."""
    return tuple(index for _, index in rank_devices(gpus))


def notebook_logging() -> tuple[int, str, str | None] | None:
    """The notebook's root logger, as a rank can copy it (level, format, date format); None
    when the notebook configured none. Handlers themselves cannot travel, their format can."""
    import logging

    root = logging.getLogger()
    if not root.handlers:
        return None
    formatter = root.handlers[0].formatter
    if formatter is None:
        return root.level, logging.BASIC_FORMAT, None
    style = getattr(formatter, "_style", None)
    if style is not None and not isinstance(style, logging.PercentStyle):
        return root.level, logging.BASIC_FORMAT, formatter.datefmt  # {}- and $-styles: plain
    return root.level, getattr(formatter, "_fmt", None) or logging.BASIC_FORMAT, formatter.datefmt


def _plotly_renderer() -> str:
    """The kernel's plotly renderer when plotly chose one here, else what plotly chooses in a
    Jupyter kernel, with plotly.js from its CDN (a rank's own would embed it in every run)."""
    renderers = getattr(sys.modules.get("plotly.io"), "renderers", None)
    chosen = getattr(renderers, "default", None)
    return chosen if isinstance(chosen, str) and chosen else "plotly_mimetype+notebook_connected"


def check_user_env(env: Mapping[str, str], device: str) -> None:
    """Refuse ``env=`` entries that would contradict the launch (the run would hang in the
    rendezvous until a timeout), naming the option that sets each instead."""
    for name in env:
        owner = _OWNED.get(name)
        if owner is None and name.startswith("TORCHELASTIC_"):
            owner = "nbddp itself (Lightning and Accelerate read it)"
        if owner is None and name == "CUDA_VISIBLE_DEVICES" and device == "cuda":
            owner = "gpus= (e.g. gpus=[2, 3])"
        if owner is not None:
            raise ValueError(
                f"env={{{name!r}: ...}}: nbddp sets {name} for every rank; a different value "
                f"would leave the ranks waiting for each other. It is set by {owner}: drop it "
                "from env=."
            )
