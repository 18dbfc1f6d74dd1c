"""Ranks as processes on this machine: the :class:`~nbddp.backend.Backend` of a launch with
more than one rank and no cluster.

A :class:`~nbddp.local.group.RankGroup` starts the ranks and serves them; a
:class:`~nbddp.rules.referee.Referee` judges what they report. Both run on one thread, so a rank
that dies is noticed at once, a large result arriving holds up nothing else, and a stop is
honoured within milliseconds.
"""

from __future__ import annotations

import os
import sys
import threading

from nbddp import interrupts
from nbddp.backend import Finish, Outcome, RunEvents, Writable
from nbddp.environment import (
    device_indices,
    interface_of,
    new_run_id,
    single_node,
    store_socket,
    worker_env,
)
from nbddp.errors import our_bug, warn_user
from nbddp.local.forkserver import default_starter
from nbddp.local.group import RankGroup
from nbddp.local.processes import Starter
from nbddp.plan import LaunchPlan, job_spec
from nbddp.rules.referee import Referee
from nbddp.wire.call import Call
from nbddp.wire.stacks import AskStacks


def local_group(
    plan: LaunchPlan,
    call: Call,
    starter: Starter | None = None,
    target: Writable | None = None,
    session: bool = False,
) -> RankGroup:
    """The ranks of ``plan`` on this machine, ready to start: their torchrun environment (the
    port of a fresh, listening rendezvous socket; the loopback interface) and their job spec.
    Call it with interrupts deferred: what it opens is the group's to close once it returns."""
    starter = starter or default_starter()
    run_id = new_run_id()
    loopback = interface_of("127.0.0.1")
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
        spec = job_spec(
            plan,
            run_id,
            device_indices(plan.gpus),
            session,
            sys_path=tuple(os.path.abspath(p) if p else os.getcwd() for p in sys.path),
            cwd=os.getcwd(),
        )
        return RankGroup(
            range(plan.world_size), envs, spec, call, starter, plan.output, target, store=store
        )
    except BaseException:
        store.close()
        raise


class LocalWorkers:
    """One launch's processes from start to teardown."""

    nodes: tuple[str, ...] = ("localhost",)

    def __init__(self, plan: LaunchPlan, call: Call, starter: Starter | None = None) -> None:
        _warn_if_kernel_holds_gpus(plan)
        self.plan = plan
        self._call = call
        self._starter = starter
        self._group: RankGroup | None = None
        self._referee: Referee | None = None

    def start(self, events: RunEvents, finish: Finish) -> None:
        """Start every rank and the loop. Cleans up if anything fails."""
        plan = self.plan
        starter = self._starter or default_starter()
        starter.warm_up()  # may wait for the warm helper, interruptibly: nothing is open yet
        supervisor: threading.Thread | None = None
        try:
            with interrupts.deferred():  # an interrupt lands after the whole start (or cleanup)
                group = self._group = local_group(plan, self._call, starter, events.output)
                self._referee = Referee(
                    plan.world_size,
                    plan.return_all,
                    plan.timeout,
                    events,
                    broadcast=group.send_all,
                    exit_timeout=plan.exit_timeout,
                )
                supervisor = threading.Thread(
                    target=self._supervise, args=(finish,), name="nbddp-supervisor", daemon=True
                )
                group.start()
                supervisor.start()
        except BaseException:
            if supervisor is not None and supervisor.is_alive():  # interrupted after the start
                self.stop()
                with interrupts.deferred():
                    supervisor.join()
            elif self._group is not None:  # its socket, pipes and directory; no rank runs
                self._group.teardown()
            raise

    def ask(self, message: AskStacks) -> None:
        if self._group is not None:
            self._group.send_all(message)

    def stop(self) -> None:
        if self._referee is not None:
            self._referee.stop()
        if self._group is not None:
            self._group.stop()

    def _supervise(self, finish: Finish) -> None:
        assert self._group is not None and self._referee is not None
        result = Outcome("failed")
        try:
            result = self._group.run(self._referee) or Outcome("stopped")
        except BaseException as exc:  # a bug of ours must still end the run cleanly
            result = Outcome("failed", error=our_bug("supervisor", exc))
        finally:
            self._group.teardown()
            finish(result)


def _warn_if_kernel_holds_gpus(plan: LaunchPlan) -> None:
    """The kernel's own CUDA memory is memory rank 0 does not have: say so, once per launch."""
    if plan.device != "cuda":
        return
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return
    held = []
    for index in sorted(set(plan.gpus)):
        reserved = torch.cuda.memory_reserved(index)
        held.append(f"GPU {index} ({reserved / 2**30:.2f} GiB reserved by PyTorch + its context)")
    warn_user(
        "this kernel holds a CUDA context on " + ", ".join(held) + ", which the workers also "
        "use: they have that much less memory. If a rank runs out of memory, free it with "
        "`del` and torch.cuda.empty_cache(), or restart the kernel before launching."
    )
