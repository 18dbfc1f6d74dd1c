"""Ranks as processes on this machine: the :class:`~nbddp.backend.Ranks` of a launch with more
than one rank and no cluster, and of a session without one.

One :class:`~nbddp.local.group.RankGroup` starts the ranks and serves them on one thread, so a
rank that dies is noticed at once, a large result arriving holds up nothing else, and a stop
is honoured within milliseconds. What decides is the caller's judge.
"""

from __future__ import annotations

import os
import sys

from nbddp.devices import shared
from nbddp.environment import (
    device_indices,
    interface_of,
    new_run_id,
    single_node,
    store_socket,
    worker_env,
)
from nbddp.errors.notices import warn_user
from nbddp.local.forkserver import default_starter
from nbddp.local.group import Environments, RankGroup
from nbddp.local.processes import Starter
from nbddp.plan import LaunchPlan, job_spec
from nbddp.wire.call import Call


def local_ranks(
    plan: LaunchPlan, call: Call, starter: Starter | None = None, session: bool = False
) -> RankGroup:
    """The ranks of ``plan`` on this machine, ready to start (nothing is open until then):
    their torchrun environment (the port of a fresh, listening rendezvous socket; the loopback
    interface) and their job spec."""
    _warn_if_kernel_holds_gpus(plan)
    _warn_if_nccl_shares_a_gpu(plan)
    run_id = new_run_id()
    loopback = interface_of("127.0.0.1")

    def environments() -> Environments:
        store = store_socket()  # listening before any rank starts: see store_socket
        try:
            envs = {
                rank: worker_env(
                    single_node(rank, plan.world_size),
                    store.getsockname()[1],
                    run_id,
                    device=plan.device,
                    gpus=plan.gpus,
                    user_env=plan.env,
                    interface=loopback,  # one machine: every rank on the loopback interface
                )
                for rank in range(plan.world_size)
            }
        except BaseException:
            store.close()
            raise
        return Environments(envs, store)

    spec = job_spec(
        plan,
        run_id,
        device_indices(plan.gpus),
        session,
        sys_path=tuple(os.path.abspath(p) if p else os.getcwd() for p in sys.path),
        cwd=os.getcwd(),
    )
    starter = starter or default_starter()
    return RankGroup(range(plan.world_size), environments, spec, call, starter, plan.output)


def _warn_if_kernel_holds_gpus(plan: LaunchPlan) -> None:
    """The kernel's own CUDA memory is memory the ranks on that GPU do not have: say so, once
    per launch or session, naming only the GPUs where the kernel holds a CUDA context."""
    if plan.device != "cuda":
        return
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return
    held = []
    for index in sorted({g for g in plan.gpus if isinstance(g, int)}):
        if not torch._C._cuda_hasPrimaryContext(index):  # type: ignore[attr-defined]
            continue  # the kernel never used this one
        reserved = torch.cuda.memory_reserved(index) / 2**30
        held.append(f"GPU {index} ({reserved:.2f} GiB reserved by PyTorch, plus the context's own)")
    if held:
        warn_user(
            "this kernel holds a CUDA context on " + ", ".join(held) + ", which the workers "
            "also use: they have that much less memory. If a rank runs out of memory, free it "
            "with `del` and torch.cuda.empty_cache(), or restart the kernel before launching."
        )


def _warn_if_nccl_shares_a_gpu(plan: LaunchPlan) -> None:
    """NCCL 2.30 runs two ranks on one GPU (``planning.py`` allowed it), taking turns."""
    if plan.device == "cuda" and plan.backend == "nccl" and shared(plan.gpus):
        warn_user(
            f"gpus={list(plan.gpus)} puts several NCCL ranks on one GPU: NCCL runs them "
            "time-sliced, for correctness, not speed (its collectives spin while a peer's turn "
            "runs). Time a run on one GPU per rank."
        )
