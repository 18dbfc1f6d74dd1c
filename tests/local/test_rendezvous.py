"""The rendezvous store's socket listens before any rank starts, so no rank is ever refused
(torch's store client backs off for 0.3-1 s when it is: the launch stalls)."""

from __future__ import annotations

import socket

import pytest

import nbddp
from nbddp.local.processes import ColdStarter
from nbddp.local.ranks import local_ranks
from nbddp.plan import LaunchPlan
from nbddp.wire.call import Call

pytestmark = pytest.mark.ranks


class KnockingStarter(ColdStarter):
    """Before each rank starts, knock on the store's port that rank is given."""

    def __init__(self) -> None:
        self.knocked: list[int] = []

    def start(self, argv, env, stdout, stderr):
        port = int(env["MASTER_PORT"])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into the backlog: this rank is not running yet
        self.knocked.append(port)
        return super().start(argv, env, stdout, stderr)


def test_the_store_listens_before_any_rank_starts_and_closes_with_the_group():
    starter = KnockingStarter()
    group = local_ranks(LaunchPlan(2, "cpu", "gloo"), Call(b""), starter=starter)
    try:
        group.start()
    finally:
        group.teardown()
    assert len(starter.knocked) == 2 and len(set(starter.knocked)) == 1
    address = ("127.0.0.1", starter.knocked[0])
    with pytest.raises(ConnectionRefusedError), socket.create_connection(address, timeout=5):
        pass


def test_every_rank_shares_one_store_for_later_groups_too():
    def subgroup_sum() -> float:
        import torch
        import torch.distributed as dist

        group = dist.new_group(ranks=[0, 2])  # its rendezvous goes through the same store
        t = torch.tensor([float(dist.get_rank())])
        if dist.get_rank() in (0, 2):
            dist.all_reduce(t, group=group)
        dist.barrier()
        return t.item()

    values = nbddp.notebook_launch(
        subgroup_sum, num_workers=3, device="cpu", return_all=True, display="none"
    )
    assert values == [2.0, 1.0, 2.0]
