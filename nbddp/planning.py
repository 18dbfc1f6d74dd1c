"""Turn ``notebook_launch``'s arguments into a frozen :class:`~nbddp.plan.LaunchPlan`.

Every "auto" is resolved here and every bad argument raises ``ValueError`` here, with the fix in
the message, so nothing downstream validates and no process starts for a call that cannot work:
the options of one machine and of a cluster, whether a run can be detached there, a session
run's own options, and the kernel's ``NBDDP_EXIT_TIMEOUT``.
Non-goal: probing the GPUs beyond counting them (no CUDA context is created in the kernel).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from nbddp.clusters.choice import resolve as resolve_cluster
from nbddp.clusters.placement import Cluster, place_on_cluster
from nbddp.devices import (
    MULTI_RANK_NCCL,
    MULTI_RANK_VARIABLE,
    is_mig,
    is_uuid,
    known_uuids,
    mig_slices,
    nccl_version,
    physical,
    shared,
    version_text,
    visible,
)
from nbddp.environment import check_user_env
from nbddp.plan import (
    BACKENDS,
    DEVICE_OPTIONS,
    DISPLAYS,
    OUTPUTS,
    STALL_AFTER,
    Device,
    DistBackend,
    LaunchPlan,
)
from nbddp.recovery import KEEP, STOP_GRACE, check_stop_grace, check_stopping
from nbddp.wire.spec import JobSpec


def make_plan(
    *,
    num_workers: int | str = "auto",
    device: str = "auto",
    backend: str | None = None,
    gpus: Sequence[int | str] | None = None,
    timeout: float | None = None,
    display: str = "auto",
    output: str = "rank0",
    return_all: bool = False,
    block: bool = True,
    env: Mapping[str, str] | None = None,
    cluster: Any = None,
    nodes: int | str = "auto",
    workers_per_node: int | str = "auto",
    stall_after: float | None = STALL_AFTER,
    debug: bool = False,
    checkpoint_dir: Any = None,
    keep: int = KEEP,
    max_restarts: int = 0,
    stop_grace: float = STOP_GRACE,
    detach: bool = False,
    gpu_count: int | None = None,
) -> LaunchPlan:
    """Validate and resolve the launch options. ``gpu_count`` overrides detection (tests)."""
    if device not in DEVICE_OPTIONS:
        raise ValueError(f"device={device!r} is not one of {_choices(DEVICE_OPTIONS)}.")
    on_cluster = resolve_cluster(cluster)
    check_detachable(detach, on_cluster, debug)
    if on_cluster is None:
        if nodes != "auto" or workers_per_node != "auto":
            raise ValueError(
                f"nodes={nodes!r}, workers_per_node={workers_per_node!r} place ranks on a "
                "cluster: pass cluster='ray' or 'slurm' (or call nbddp.set_cluster first), or "
                "use "
                "num_workers= alone on this machine."
            )
        n_gpus = visible_gpu_count() if gpu_count is None else gpu_count
        resolved_device, workers, rank_gpus = _this_machine(num_workers, device, gpus, n_gpus)
        n_nodes, per_node = 1, workers
        batch: list[str] = []  # sbatch's options: a detached run's batch job on Slurm
    else:
        if gpus is not None:
            raise ValueError(
                "gpus= selects this machine's GPUs; on a cluster, workers_per_node= sets how "
                "many GPUs of each node are used. Drop gpus=."
            )
        placed = place_launch(on_cluster, num_workers, device, nodes, workers_per_node, detach)
        resolved_device, n_nodes, per_node, batch = placed
        workers, rank_gpus = n_nodes * per_node, ()

    resolved_backend: DistBackend
    if backend is None:
        resolved_backend = "nccl" if resolved_device == "cuda" else "gloo"
    elif backend in BACKENDS:
        resolved_backend = "nccl" if backend == "nccl" else "gloo"
    else:
        raise ValueError(
            f"backend={backend!r} is not one of {_choices(BACKENDS)} (or None for auto)."
        )
    if resolved_backend == "nccl" and resolved_device == "cpu":
        raise ValueError(
            "backend='nccl' needs GPUs but this run is on the CPU. "
            "Use backend='gloo' (or None), or device='cuda' on a machine with GPUs."
        )
    user_env = _check_env(env, resolved_device)
    if workers == 1 and on_cluster is None and not detach:
        _check_kernel_slice(rank_gpus)
    if resolved_backend == "nccl" and shared(rank_gpus):
        user_env = {**_nccl_sharing(rank_gpus), **user_env}

    _check_run_options(timeout, display, output, return_all, block, debug)
    stall = check_stall_after(stall_after)
    stopping = check_stopping(checkpoint_dir, keep, max_restarts, stop_grace)
    return LaunchPlan(
        world_size=workers,
        device=resolved_device,
        backend=resolved_backend,
        gpus=rank_gpus,
        timeout=float(timeout) if timeout is not None else None,
        display=chosen_display(display),  # type: ignore[arg-type]
        output=output,  # type: ignore[arg-type]
        return_all=return_all,
        block=block and not detach,  # a detached launch never waits
        env=user_env,
        cluster=on_cluster,
        nodes=n_nodes,
        workers_per_node=per_node,
        exit_timeout=exit_timeout_from_env(),
        stall_after=stall,
        debug=debug,
        **stopping,
        detach=detach,
        batch=tuple(batch),
    )


def with_run_options(
    plan: LaunchPlan,
    *,
    timeout: float | None,
    display: str,
    output: str,
    return_all: bool,
    block: bool,
    stall_after: float | None = STALL_AFTER,
    debug: bool = False,
    stop_grace: float = STOP_GRACE,
) -> LaunchPlan:
    """``plan`` (where the ranks run) with one run's own options, checked (a session's)."""
    _check_run_options(timeout, display, output, return_all, block, debug)
    stall = check_stall_after(stall_after)
    return dataclasses.replace(
        plan,
        timeout=float(timeout) if timeout is not None else None,
        display=chosen_display(display),  # type: ignore[arg-type]
        output=output,  # type: ignore[arg-type]
        return_all=return_all,
        block=block,
        stall_after=stall,
        debug=debug,
        stop_grace=check_stop_grace(stop_grace),
    )


def chosen_display(display: str) -> str:
    """``display="auto"`` is what ``NBDDP_DISPLAY`` in the kernel's environment names, if it
    names one (a live text view in jupyter console: ``NBDDP_DISPLAY=text``)."""
    chosen = os.environ.get("NBDDP_DISPLAY", "").strip()
    if display != "auto" or not chosen:
        return display
    if chosen not in DISPLAYS:
        raise ValueError(
            f"NBDDP_DISPLAY={chosen!r} in the kernel's environment is not one of "
            f"{_choices(DISPLAYS)}: it sets the default of display=. Set one of those, or unset "
            "it (os.environ.pop('NBDDP_DISPLAY') in the notebook)."
        )
    return chosen


def _check_run_options(
    timeout: Any, display: Any, output: Any, return_all: Any, block: Any, debug: Any = False
) -> None:
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(f"timeout={timeout!r} must be a number of seconds or None.")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or None.")
    if display not in DISPLAYS:
        raise ValueError(f"display={display!r} is not one of {_choices(DISPLAYS)}.")
    chosen_display(display)
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r} is not one of {_choices(OUTPUTS)}.")
    for name, value in (("return_all", return_all), ("block", block), ("debug", debug)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False.")


def _this_machine(
    num_workers: int | str, device: str, gpus: Sequence[int | str] | None, n_gpus: int
) -> tuple[Device, int, tuple[int | str, ...]]:
    """Device, world size and each rank's GPU on this machine."""
    if device == "cuda" and n_gpus == 0:
        raise ValueError(
            "device='cuda' but no GPU is visible to this kernel "
            "(torch.cuda.is_available() is False). Use device='cpu' or device='auto'."
        )
    wants_gpu = device == "cuda" or (device == "auto" and n_gpus > 0)
    resolved: Device = "cuda" if wants_gpu else "cpu"
    if gpus is not None:
        gpus = _check_gpus(gpus, resolved, n_gpus)
    workers = _resolve_workers(num_workers, resolved, n_gpus, gpus)
    if resolved != "cuda":
        return resolved, workers, ()
    chosen = list(gpus) if gpus is not None else _every_gpu(n_gpus)
    if workers > len(chosen):
        raise ValueError(
            f"num_workers={workers} but only {len(chosen)} GPU(s) are selected "
            f"({chosen}). Use num_workers<={len(chosen)}, or let two ranks share a GPU "
            "for testing with gpus=[0, 0] (gloo, or NCCL 2.30 and later), or device='cpu'."
        )
    _check_kernel_view(chosen[:workers])
    return resolved, workers, tuple(chosen[:workers])


def _every_gpu(n_gpus: int) -> list[int | str]:
    """Every GPU the kernel sees: its indices, or, where it sees MIG slices, each slice (a
    process's CUDA enumerates one slice, so each rank gets one of its own)."""
    slices = mig_slices()
    return list(slices) if slices else list(range(n_gpus))


def _check_kernel_view(gpus: Sequence[int | str]) -> None:
    """What the ranks would see must be what the kernel meant: ``CUDA_VISIBLE_DEVICES`` changed
    after CUDA started here leaves torch counting the GPUs it saw then; a MIG slice other than
    the kernel's own cannot run in the kernel."""
    for gpu in gpus:
        physical(gpu)  # a ValueError that explains, for an index CUDA_VISIBLE_DEVICES lost
    names = visible()
    torch = sys.modules.get("torch")
    if (
        names is not None
        and not any(is_mig(n) for n in names)
        and torch is not None
        and torch.cuda.is_initialized()
        and len(names) != torch.cuda.device_count()
    ):
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={','.join(names)!r} names {len(names)} GPU(s), but CUDA "
            f"started in this kernel with {torch.cuda.device_count()}: it was changed after "
            "CUDA was initialised, and torch's GPU indices still follow the old value. Set it "
            "back, or restart the kernel and set it before anything uses CUDA."
        )


def _check_kernel_slice(gpus: Sequence[int | str]) -> None:
    """One rank runs in the kernel, whose CUDA enumerates one MIG slice: the first it sees."""
    slices = mig_slices()
    if gpus and is_uuid(gpus[0]) and is_mig(str(gpus[0])) and slices and gpus[0] != slices[0]:
        raise ValueError(
            f"gpus={list(gpus)!r}: one rank runs in the kernel, and the kernel's CUDA sees one "
            f"MIG slice, {slices[0]!r}. Name that one, or launch a rank per slice "
            "(num_workers=2 with both slices): each rank then sees its own."
        )


def _nccl_sharing(gpus: Sequence[int | str]) -> dict[str, str]:
    """Two ranks on one GPU with NCCL: the NCCL torch loads must allow it (2.30 and later,
    when told so), else the launch is refused naming the release."""
    version = nccl_version()
    if version is None or version < MULTI_RANK_NCCL:
        raise ValueError(
            f"gpus={list(gpus)} puts two ranks on one GPU, which {version_text(version)} (the "
            "library torch loads) refuses: NCCL runs several ranks on one GPU from release "
            "2.30 on. Pass backend='gloo' to share a GPU (a testing aid for single-GPU "
            "machines), or install a torch whose NCCL is 2.30 or later."
        )
    return {MULTI_RANK_VARIABLE: "1"}


def _choices(options: tuple[str, ...]) -> str:
    return ", ".join(map(repr, options))


def _resolve_workers(
    num_workers: int | str, device: Device, n_gpus: int, gpus: Sequence[int | str] | None
) -> int:
    if num_workers == "auto":
        if device == "cpu":
            return 1
        return len(gpus) if gpus is not None else len(_every_gpu(n_gpus))
    if isinstance(num_workers, bool) or not isinstance(num_workers, int):
        raise ValueError(
            f"num_workers={num_workers!r} must be an int >= 1 or 'auto' (one per visible GPU)."
        )
    if num_workers < 1:
        raise ValueError(
            f"num_workers={num_workers} must be at least 1 (1 runs the function in the kernel)."
        )
    if device == "cpu" and num_workers > (os.cpu_count() or 1) * 4:
        raise ValueError(
            f"num_workers={num_workers} CPU workers on {os.cpu_count()} cores would thrash; "
            "use at most 4 per core."
        )
    return num_workers


def _check_gpus(gpus: Sequence[int | str], device: Device, n_gpus: int) -> tuple[int | str, ...]:
    """Indices as the kernel's ``torch.cuda`` counts them, or UUIDs (``GPU-…``, ``MIG-…``); a
    GPU UUID the kernel's ``CUDA_VISIBLE_DEVICES`` lists becomes its index."""
    if device == "cpu":
        raise ValueError("gpus= selects GPUs, but device='cpu'. Drop gpus= or use device='cuda'.")
    if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Sequence) or not gpus:
        raise ValueError(
            f"gpus={gpus!r} must be a non-empty list of GPU indices or UUIDs, e.g. [0, 1]."
        )
    names = visible()
    known = None
    checked: list[int | str] = []
    for gpu in gpus:
        if is_uuid(gpu):
            assert isinstance(gpu, str)
            if names is not None and gpu in names and not is_mig(gpu):
                checked.append(names.index(gpu))  # the kernel's own index for it
                continue
            known = known_uuids() if known is None else known
            if (names is not None and gpu not in names) or (known is not None and gpu not in known):
                where = (
                    f"this kernel's CUDA_VISIBLE_DEVICES={','.join(names)!r}"
                    if names is not None
                    else "nvidia-smi -L"
                )
                raise ValueError(
                    f"gpus={list(gpus)!r}: {gpu!r} is not among the GPUs {where} lists."
                )
            checked.append(gpu)
            continue
        if isinstance(gpu, bool) or not isinstance(gpu, int):
            raise ValueError(
                f"gpus={list(gpus)!r}: {gpu!r} is not a GPU index (an int) or UUID "
                "('GPU-…', 'MIG-…', as nvidia-smi -L prints them)."
            )
        if not 0 <= gpu < n_gpus:
            raise ValueError(
                f"gpus={list(gpus)!r}: GPU {gpu} does not exist; this kernel sees {n_gpus} "
                f"GPU(s), indices 0..{n_gpus - 1}."
            )
        checked.append(gpu)
    return tuple(checked)


def _check_env(env: Mapping[str, str] | None, device: Device) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ValueError(f"env={env!r} must be a mapping of names to strings.")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(
                f"env[{key!r}]={value!r}: environment names and values must be strings "
                "(write str(value))."
            )
    check_user_env(env, device)
    return dict(env)


def check_stall_after(stall_after: Any) -> float | None:
    """``stall_after=``: seconds without progress before the panel shows where ranks are."""
    if stall_after is None:
        return None
    if isinstance(stall_after, bool) or not isinstance(stall_after, (int, float)):
        raise ValueError(
            f"stall_after={stall_after!r} must be a number of seconds, or None to turn the "
            "stall banner off."
        )
    if not (stall_after > 0 and math.isfinite(stall_after)):
        raise ValueError(
            f"stall_after={stall_after!r} must be a positive number of seconds (or None)."
        )
    return float(stall_after)


def seconds_or_none(text: str) -> float | None:
    """``--stall-after``'s value: a number of seconds, or ``none`` (argparse names the option
    and the value when this raises)."""
    return None if text.strip().lower() in ("none", "off") else float(text)


def visible_gpu_count() -> int:
    """GPUs the kernel can see, without creating a CUDA context (torch counts through NVML:
    the helper and the kernel set ``PYTORCH_NVML_BASED_CUDA_CHECK``). MIG slices count one
    each, although CUDA enumerates one of them per process."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(count, len(mig_slices())) if count else 0


def check_detachable(detach: Any, cluster: Any, debug: Any = False) -> None:
    """``detach=``: where a run cannot be detached, say so before anything starts."""
    if not isinstance(detach, bool):
        raise ValueError(f"detach={detach!r} must be True or False.")
    if detach and debug is True:
        raise ValueError(
            "debug=True opens pdb in the notebook's input box, but a detached run has none "
            "(kernels come and go): drop detach=True to debug the run, or drop debug=True."
        )
    if not detach or cluster is None:
        return
    if type(cluster).__name__ not in ("RayCluster", "SlurmCluster"):
        raise ValueError(f"detach=True cannot run on {cluster!r}.")


def place_launch(
    cluster: Cluster,
    num_workers: int | str,
    device: str,
    nodes: int | str,
    workers_per_node: int | str,
    detach: bool,
) -> tuple[Literal["cuda", "cpu"], int, int, list[str]]:
    """Device, nodes, ranks per node, and a detached run's batch job's sbatch options on
    Slurm (none elsewhere: the ranks are placed on the cluster's nodes as they are now)."""
    from nbddp.clusters.slurm.allocation import SlurmCluster

    if detach and isinstance(cluster, SlurmCluster):  # a batch job: no allocation to place on
        from nbddp.clusters.slurm.batch_shape import batch_shape

        return batch_shape(cluster, num_workers, device, nodes, workers_per_node)
    placed = place_on_cluster(cluster, num_workers, device, nodes, workers_per_node)
    return (*placed, [])


def exit_timeout_from_env() -> float:
    """Seconds a rank that ended normally has for its exit handlers and the processes it
    started (``NBDDP_EXIT_TIMEOUT`` in the kernel's environment; 30 s, as torchrun gives its
    workers between SIGTERM and SIGKILL)."""
    text = os.environ.get("NBDDP_EXIT_TIMEOUT")
    if text is None:
        return JobSpec.exit_timeout
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(
            f"NBDDP_EXIT_TIMEOUT={text!r} in the environment must be a number of seconds >= 0 "
            f"(how long a rank's exit handlers may run; the default is {JobSpec.exit_timeout:g}): "
            "fix it with os.environ['NBDDP_EXIT_TIMEOUT'] = '30', or del it."
        )
    return seconds
