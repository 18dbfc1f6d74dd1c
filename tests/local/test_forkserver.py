"""Pre-warmed workers: fast, yet every launch gets brand-new, isolated worker processes."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest
from conftest import TWO_CPU_QUIET, is_warm_helper, running

import nbddp
from nbddp.local import forkserver


@pytest.fixture
def ready_helper():
    """The helper, once it imported what earlier tests' ranks did (one of those may have made
    it unsafe to fork: then its successor)."""
    forkserver.prestart()
    assert forkserver.wait_until_ready(60), "the helper never became ready"
    forkserver.wait_until_preloaded(120)
    forkserver.prestart()
    assert forkserver.wait_until_ready(60), "the helper never became ready"
    return forkserver.helper_pid()


def identity() -> dict:
    import random

    import nbddp_state_probe as probe
    import torch
    import torch.distributed as dist

    probe.counter += 1  # a module global mutated by this launch
    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "counter": probe.counter,
        "group": (dist.is_initialized(), dist.get_world_size()),
        "torch": torch.rand(1).item(),
        "random": random.random(),
        "threads": torch.get_num_threads(),
        "session": os.getsid(0) == os.getpid(),
    }


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    (tmp_path / "nbddp_state_probe.py").write_text("counter = 0\nVALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "nbddp_state_probe.py"
    sys.modules.pop("nbddp_state_probe", None)


@pytest.mark.ranks
def test_warm_workers_are_fresh_and_isolated_every_launch(ready_helper, probe_module):
    first = nbddp.notebook_launch(identity, **TWO_CPU_QUIET, return_all=True)
    second = nbddp.notebook_launch(identity, **TWO_CPU_QUIET, return_all=True)
    for launch in (first, second):
        for rank in launch:
            assert rank["parent"] == ready_helper  # forked by the helper: the warm path
            assert rank["counter"] == 1  # the previous launch's mutation is gone
            assert rank["group"] == (True, 2) and rank["session"]
            assert rank["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    pids = {r["pid"] for r in first + second}
    draws = {(r["torch"], r["random"]) for r in first + second}
    assert len(pids) == 4 and len(draws) == 4  # new processes, each with its own seeds


def reads_probe_value() -> int:
    import importlib

    import nbddp_state_probe

    return importlib.reload(nbddp_state_probe).VALUE


@pytest.mark.ranks
def test_a_module_edited_between_launches_is_imported_anew(ready_helper, probe_module):
    assert nbddp.notebook_launch(reads_probe_value, **TWO_CPU_QUIET) == 1
    probe_module.write_text("counter = 0\nVALUE = 2\n")
    assert nbddp.notebook_launch(reads_probe_value, **TWO_CPU_QUIET) == 2


def parent_pid() -> int:
    return os.getppid()


@pytest.mark.ranks
def test_a_dead_helper_is_replaced_and_launches_keep_working(ready_helper):
    os.kill(ready_helper, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while running(ready_helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    # the next launch notices, starts a new helper and waits for it
    assert nbddp.notebook_launch(parent_pid, **TWO_CPU_QUIET) != ready_helper
    new_helper = forkserver.helper_pid()
    assert new_helper not in (None, ready_helper)
    assert nbddp.notebook_launch(parent_pid, **TWO_CPU_QUIET) == new_helper


@pytest.mark.ranks
def test_prewarm_can_be_turned_off(monkeypatch, ready_helper):
    monkeypatch.setenv("NBDDP_PREWARM", "0")
    assert nbddp.notebook_launch(parent_pid, **TWO_CPU_QUIET) == os.getpid()


def fails_on_rank_one() -> None:
    if nbddp.rank() == 1:
        os._exit(7)
    time.sleep(60)


@pytest.mark.ranks
def test_failures_hold_on_the_warm_path(ready_helper):
    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.notebook_launch(fails_on_rank_one, **TWO_CPU_QUIET)
    assert (info.value.rank, info.value.exitcode) == (1, 7)


@pytest.mark.e2e
def test_the_helper_ends_with_its_kernel(kernel_factory):
    kernel = kernel_factory()
    try:
        out, reply = kernel.run(
            "import nbddp\nfrom nbddp.local import forkserver\n"
            "print(forkserver.wait_until_ready(60), forkserver.helper_pid())"
        )
        assert reply["status"] == "ok", out
        helper = int(out.split()[-1])
        assert is_warm_helper(psutil.Process(helper))
        assert psutil.Process(helper).ppid() == kernel.pid  # owned by the kernel
    finally:
        kernel.shutdown()
    deadline = time.monotonic() + 10
    while running(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(helper)


def imports_after_the_fork() -> tuple[list[str], list[str]]:
    """What a rank imported that the helper had not, when fn starts and after a first DDP step
    of each common optimizer."""
    import sys

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from nbddp.worker.helper import forked

    at_start = sorted(set(sys.modules) - forked.known)
    for optimizer in (torch.optim.SGD, torch.optim.AdamW):
        model = DistributedDataParallel(torch.nn.Linear(4, 1))
        step = optimizer(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        step.step()
    return at_start, sorted(set(sys.modules) - forked.known - set(at_start))


@pytest.mark.ranks
def test_a_warm_rank_imports_nothing_the_helper_lacks_up_to_its_first_step(ready_helper):
    """Whatever a rank imports after the fork, every launch pays for again (~3 ms for one of
    nbddp's modules, ~0.9 s for torch._dynamo, which optimizer.step() imports): the helper's
    preloads hold all of it."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        at_start, at_first_step = nbddp.notebook_launch(imports_after_the_fork, **TWO_CPU_QUIET)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert (at_start, at_first_step) == ([], [])
