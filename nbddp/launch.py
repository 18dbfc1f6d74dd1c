"""``notebook_launch``: resolve a plan, pick the backend that runs it, drive a :class:`Run`;
and ``spawn``, the same launch in ``torch.multiprocessing.spawn``'s shape. Where the ranks
run is picked by :func:`nbddp.ranks.ranks_for`, for launches and sessions alike."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbddp import interrupts
from nbddp.backend import Backend, Ranks
from nbddp.local.in_kernel import InKernel, device_name
from nbddp.plan import STALL_AFTER, LaunchPlan
from nbddp.planning import make_plan
from nbddp.ranks import ranks_for
from nbddp.recovery import KEEP, STOP_GRACE, default_checkpoint_dir
from nbddp.run import Run, remember
from nbddp.supervised import Supervised
from nbddp.wire.call import dumps_call
from nbddp.worker.rank.spawned import LocalRankFirst


def notebook_launch(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
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
) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank of a DDP job started from the notebook.

    Every rank is a fresh process (never a fork of the kernel) that sees the torchrun
    environment and a default process group made before ``fn`` is called. One resolved worker
    runs ``fn`` in the kernel itself (a world of 1). A failure on any rank ends every rank and
    raises [nbddp.WorkerError][] here; a kernel interrupt ends every rank and raises
    ``KeyboardInterrupt``, except that the first one of a run that checks
    [nbddp.stopping][] stops it gracefully. Bad arguments raise ``ValueError`` before any
    process starts.

    Tensors and arrays that ``fn`` captures are not copied per rank: their bytes sit once in
    shared memory that every rank maps copy-on-write (a rank's writes stay its own).
    ``NBDDP_PREWARM=0`` in the environment turns the pre-warmed worker start off.

    Args:
        fn: The function each rank calls; defined in the notebook, a lambda or a closure: it
            travels by value (cloudpickle) with the notebook globals, classes and functions it
            uses; modules travel by name.
        args: Positional arguments for ``fn``.
        kwargs: Keyword arguments for ``fn``.
        num_workers: How many ranks: an int, or "auto" (one per visible GPU; 1 without one,
            which runs ``fn`` in the kernel).
        device: "auto" (cuda when a GPU is visible), "cuda" or "cpu".
        backend: None (nccl on cuda, gloo on cpu), "nccl" or "gloo".
        gpus: The GPUs to use, rank i on ``gpus[i]``: the kernel's ``torch.cuda`` indices
            (which follow its ``CUDA_VISIBLE_DEVICES``) or UUIDs as ``nvidia-smi -L`` prints
            them (``"GPU-…"``, ``"MIG-…"``: a MIG slice is one rank's whole device). Each
            rank's ``LOCAL_RANK`` is its own device's index. ``gpus=[0, 0]`` puts two ranks
            on one GPU (a testing aid for single-GPU machines): with gloo, or with NCCL
            2.30 and later, time-sliced (an older NCCL is refused, by name).
        timeout: Seconds for the whole run; None: no limit. Then a run that checks
            [nbddp.stopping][] (or [nbddp.progress][]) stops gracefully and returns its value,
            with a warning; any other is ended and [nbddp.LaunchTimeout][] raised.
        display: The live view: "auto", "widget" (the HTML panel), "text" (tqdm-style
            lines) or "none".
        output: Whose prints and rich output reach the notebook: "rank0", "all" (each line
            labelled with its rank) or "none".
        return_all: Return every rank's value, as a list indexed by rank.
        block: False returns a running [nbddp.Run][] at once; training goes on in the
            background, with a Stop button below the panel.
        env: Extra environment variables for the ranks (not the ones nbddp sets).
        cluster: None for this machine; "ray", "ray://host:port" or an [nbddp.RayCluster][];
            "slurm" or an [nbddp.SlurmCluster][]; the default is [nbddp.set_cluster][]'s.
        nodes: Cluster nodes: an int, or "auto" (every alive node that can hold the ranks).
        workers_per_node: Ranks per cluster node: an int, or "auto" (the node's GPUs on
            cuda, 1 on cpu).
        stall_after: Seconds without progress on any rank (log rows, bars, output, CPU time)
            before the panel shows where each rank is; None turns the banner off. Nothing is
            killed.
        detach: True gives the ranks a supervisor of their own, outside the kernel: the run
            outlives a kernel restart or death, any later kernel can list it
            ([nbddp.runs][]) and follow it ([nbddp.attach][]); returns the [nbddp.Run][] at
            once (on Slurm, a batch job; on Ray, its supervisor is a Ray driver of its own).

        debug: True: an uncaught exception on a rank opens post-mortem pdb at the frame that
            raised, in the notebook's input box, the other ranks held, before the run fails as
            usual. (``breakpoint()`` on a rank opens pdb there in any case;
            [nbddp.breakpoint][] stops one rank and holds the others.)
        checkpoint_dir: Where [nbddp.checkpoint][] saves; None: a directory named after
            ``fn`` under ``./nbddp-checkpoints/``, the same at its next launch, so that
            [nbddp.restore][] resumes it.
        keep: How many complete checkpoints stay (the last ones).
        max_restarts: A failing rank (or a lost node) restarts the whole world, up to this
            many times; [nbddp.restore][] in ``fn`` then resumes from the last checkpoint.
        stop_grace: Seconds a graceful stop (Stop, the first interrupt, ``timeout``) may
            take before the ranks are ended at once.

    Returns:
        Rank 0's return value, with tensors on the CPU and DDP wrappers unwrapped (a list of
            every rank's with ``return_all=True``; the [nbddp.Run][] with ``block=False``).
            A run stopped gracefully returns what ``fn`` returned, with an
            [nbddp.NbddpWarning][] saying at which step and why.

    Raises:
        ValueError: An argument is invalid (before any process starts).
        nbddp.WorkerError: A rank failed; also an instance of the rank's own exception class
            when it can be rebuilt.
        nbddp.SerializationError: ``fn`` or what it captures cannot travel to the ranks.
        nbddp.LaunchTimeout: The run took longer than ``timeout`` (plus ``stop_grace`` for a
            run that checks [nbddp.stopping][], which is first stopped gracefully).
    """
    __tracebackhide__ = True  # IPython: show the user's frames, not ours
    interrupts.reached("planning")
    check_call(fn, args, kwargs)
    plan = make_plan(
        num_workers=num_workers,
        device=device,
        backend=backend,
        gpus=gpus,
        timeout=timeout,
        display=display,
        output=output,
        return_all=return_all,
        block=block,
        env=env,
        cluster=cluster,
        nodes=nodes,
        workers_per_node=workers_per_node,
        stall_after=stall_after,
        debug=debug,
        checkpoint_dir=default_checkpoint_dir(_name(fn))
        if checkpoint_dir is None
        else checkpoint_dir,
        keep=keep,
        max_restarts=max_restarts,
        stop_grace=stop_grace,
        detach=detach,
    )
    return launch_plan(fn, tuple(args), dict(kwargs or {}), plan)


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int | None = None,
    join: bool = True,
    **launch_options: Any,
) -> Any:
    """A drop-in for ``torch.multiprocessing.spawn``: ``fn(i, *args)`` on every rank.

    ``i`` is the rank's local rank (the process index ``mp.spawn`` passes). ``mp.spawn``'s
    ``daemon`` and ``start_method`` are accepted and change nothing (ranks are always fresh
    processes that never outlive the kernel). A tutorial's own ``init_process_group`` in
    ``fn`` is answered with the group nbddp made, so porting is one changed line.

    Args:
        fn: Called as ``fn(i, *args)`` on every rank.
        args: The arguments after the rank's index.
        nprocs: How many ranks (``num_workers``); None: one per visible GPU, 1 without.
        join: False returns the running [nbddp.Run][] at once.
        **launch_options: [nbddp.notebook_launch][]'s options (``device``, ``timeout``,
            ``display``, ...).

    Returns:
        Rank 0's return value (the [nbddp.Run][] with ``join=False``).
    """
    __tracebackhide__ = True  # IPython: show the user's frames, not ours
    options = _spawn_options(nprocs, join, launch_options)
    check_call(fn, args, None)
    return notebook_launch(
        LocalRankFirst(fn),
        tuple(args),
        num_workers="auto" if nprocs is None else nprocs,
        block=join,
        **options,
    )


_SPAWN_ONLY = {"daemon", "start_method"}  # mp.spawn's own options
_START_METHODS = ("spawn", "fork", "forkserver")


def _spawn_options(nprocs: Any, join: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``notebook_launch``'s options out of ``spawn``'s; anything else is refused here."""
    if nprocs is not None and (type(nprocs) is not int or nprocs < 1):
        raise ValueError(
            f"nprocs={nprocs!r}: how many ranks to start, a whole number >= 1 (None: one per "
            "visible GPU, 1 without)."
        )
    if not isinstance(join, bool):
        raise ValueError(f"join={join!r} must be True (wait, return rank 0's value) or False.")
    renamed = {"num_workers": "nprocs=", "block": "join=", "kwargs": "args= (fn(i, *args))"}
    allowed = [
        name
        for name, p in inspect.signature(notebook_launch).parameters.items()
        if p.kind is p.KEYWORD_ONLY and name not in renamed
    ]
    for name in options:
        if name in renamed:
            raise ValueError(f"nbddp.spawn takes {renamed[name]} instead of {name}=.")
        if name not in allowed and name not in _SPAWN_ONLY:
            raise ValueError(
                f"nbddp.spawn got an unknown option {name}=. It takes mp.spawn's (args, "
                f"nprocs, join, daemon, start_method) and notebook_launch's: "
                f"{', '.join(allowed)}."
            )
    method = options.get("start_method", "spawn")
    if method not in _START_METHODS:
        raise ValueError(
            f"start_method={method!r} is none of mp.spawn's ({', '.join(_START_METHODS)}); "
            "nbddp always starts fresh processes, so leave it out."
        )
    return {name: value for name, value in options.items() if name not in _SPAWN_ONLY}


def check_call(fn: Any, args: Any, kwargs: Any) -> None:
    """What cannot run on the ranks is refused here, before any process starts."""
    if not callable(fn):
        raise ValueError(f"fn must be a callable (your training function), got {fn!r}.")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise ValueError(
            f"fn={_name(fn)} is an async function: a rank would only get a coroutine from "
            "calling it. Launch a plain function that runs it: "
            "def train(): return asyncio.run(your_async_fn())."
        )
    if inspect.isgeneratorfunction(fn):
        raise ValueError(
            f"fn={_name(fn)} is a generator function: calling it runs none of its body. "
            "Return a value instead of yielding (e.g. collect the items in a list)."
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ValueError(f"args={args!r} must be a tuple or list of positional arguments.")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"kwargs={kwargs!r} must be a dict of keyword arguments.")
        for key in kwargs:
            if not isinstance(key, str):
                raise ValueError(
                    f"kwargs key {key!r} is not a string: keyword arguments are named by "
                    "strings (the parameter names of fn)."
                )


def _name(fn: Any) -> str:
    if isinstance(fn, LocalRankFirst):  # nbddp.spawn's: the user's function is inside
        fn = fn.fn
    return getattr(fn, "__qualname__", None) or repr(fn)


def launch_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    plan: LaunchPlan,
    names: Mapping[str, Any] | None = None,
    cell: Mapping[str, Any] | None = None,
) -> Any:
    """Run a resolved plan with the backend it needs; wait for it unless ``plan.block`` is
    False. ``names``: what the call carries, by the names the user knows (``%%ddp``);
    ``cell``: what a detached ``%%ddp`` cell's run keeps to bring its names back on attach."""
    __tracebackhide__ = True  # IPython: show the user's frames, not ours
    backend, name = _backend_for(fn, args, kwargs, plan, names, cell)
    run = Run(plan, backend, name)
    remember(run)
    return run.drive(plan.block)


def _backend_for(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    plan: LaunchPlan,
    names: Mapping[str, Any] | None = None,
    cell: Mapping[str, Any] | None = None,
) -> tuple[Backend, str]:
    """The backend and the device's name for the header; raises before anything starts."""
    if plan.detach:
        from nbddp.detached.launching import DetachedLaunch

        # SerializationError before any process; on Slurm the bytes go into the job's file
        call = dumps_call(fn, args, kwargs, names, segment=plan.cluster is None)
        meta = {"name": _name(fn), "kind": "function"} if cell is None else dict(cell)
        return DetachedLaunch(plan, call, meta), "cpu" if plan.device == "cpu" else "GPU"
    if plan.in_kernel:
        return InKernel(plan, fn, args, kwargs), device_name(plan)

    def ranks() -> Ranks:
        # on a cluster the engine carries the bytes; here a SerializationError before any
        # process
        call = dumps_call(fn, args, kwargs, names, segment=plan.cluster is None)
        try:
            return ranks_for(plan, call)
        except BaseException:
            call.close()
            raise

    remake = ranks if plan.max_restarts else None  # a restart's world: the call pickled anew
    interrupts.reached("pickling")
    return Supervised(plan, ranks(), remake), "cpu" if plan.device == "cpu" else "GPU"
