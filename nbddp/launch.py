"""``notebook_launch``: plan, then run in the kernel (one rank) or in worker processes."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import payload
from .fallback import run_in_kernel
from .plan import LaunchPlan, make_plan
from .run import Run
from .workers import WorkerGroup


def notebook_launch(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    num_workers: int | str = "auto",
    device: str = "auto",
    backend: str | None = None,
    gpus: Sequence[int] | None = None,
    timeout: float | None = None,
    display: str = "auto",
    output: str = "rank0",
    return_all: bool = False,
    block: bool = True,
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank of a DDP job started from the notebook.

    Returns rank 0's return value (a list of every rank's with ``return_all=True``; a running
    :class:`nbddp.Run` with ``block=False``), tensors on the CPU and DDP wrappers unwrapped.
    One resolved worker runs ``fn`` in the kernel itself. A failure on any rank ends every
    rank and raises :class:`nbddp.WorkerError` here; a kernel interrupt ends every rank and
    raises ``KeyboardInterrupt``. See API.md for each option.

    ``gpus=[0, 0]`` with ``backend="gloo"`` puts two ranks on one GPU: a testing aid for
    single-GPU machines (NCCL refuses it). ``NBDDP_PREWARM=0`` in the environment turns the
    pre-warmed worker start off.
    """
    __tracebackhide__ = True  # IPython: show the user's frames, not ours
    if not callable(fn):
        raise ValueError(f"fn must be a callable (your training function), got {fn!r}.")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ValueError(f"args={args!r} must be a tuple or list of positional arguments.")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ValueError(f"kwargs={kwargs!r} must be a dict of keyword arguments.")
    args, kwargs = tuple(args), dict(kwargs or {})
    plan = make_plan(
        num_workers=num_workers, device=device, backend=backend, gpus=gpus, timeout=timeout,
        display=display, output=output, return_all=return_all, block=block, env=env,
    )
    return launch_plan(fn, args, kwargs, plan)


def launch_plan(fn: Callable[..., Any], args: tuple, kwargs: dict, plan: LaunchPlan) -> Any:
    """Run a resolved plan: in the kernel for one rank, else in worker processes."""
    __tracebackhide__ = True  # IPython: show the user's frames, not ours
    if plan.in_kernel:
        return run_in_kernel(fn, args, kwargs, plan)

    call = payload.dumps_call(fn, args, kwargs)  # SerializationError before any process
    _warn_if_kernel_holds_gpus(plan)
    run = Run(plan, device_name="cpu" if plan.device == "cpu" else "GPU")
    run._show(plan.display, blocking=plan.block)
    group = WorkerGroup(plan, call, run.state, on_finish=run._finish,
                        output=run.state.as_stream() if run._shows_panel else None)
    run._stopper = group.stop
    try:
        group.start()
    except BaseException as exc:
        run._finish("failed", error=exc)
        raise
    if not plan.block:
        return run
    try:
        run.wait()
    except KeyboardInterrupt:
        _stop_despite_interrupts(run)
        raise
    return run.result()


def _stop_despite_interrupts(run: Run) -> None:
    """A second Ctrl-C must not leave workers behind: keep waiting for the teardown."""
    while True:
        try:
            run.stop()
            return
        except KeyboardInterrupt:
            continue


def _warn_if_kernel_holds_gpus(plan: LaunchPlan) -> None:
    """The kernel's own CUDA memory is memory rank 0 does not have: say so, once per launch."""
    if plan.device != "cuda":
        return
    import torch

    if not torch.cuda.is_initialized():
        return
    held = []
    for index in sorted(set(plan.gpus)):
        reserved = torch.cuda.memory_reserved(index)
        held.append(f"GPU {index} ({reserved / 2**30:.2f} GiB reserved by PyTorch + its context)")
    warnings.warn(
        "this kernel holds a CUDA context on " + ", ".join(held) + ", which the workers also "
        "use: they have that much less memory. If a rank runs out of memory, free it with "
        "`del` and torch.cuda.empty_cache(), or restart the kernel before launching.",
        ResourceWarning,
        stacklevel=3,
    )

