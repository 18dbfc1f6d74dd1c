"""The data a launch captures reaches every rank without copies: its bytes sit once in shared
memory that each rank maps copy-on-write (a CPU tensor's own storage, moved there in place on
its first launch; the rest in a segment per launch); the segment is gone however the run
ends."""

from __future__ import annotations

import gc
import glob
import os
import signal
import sys
import threading
import time

import cloudpickle
import numpy as np
import psutil
import pytest
import torch
from conftest import TWO_CPU_QUIET, wait_until
from torch.utils.data import TensorDataset

import nbddp
from nbddp.wire import call as calls

SEGMENT = "memfd:nbddp-data"


@pytest.fixture(autouse=True)
def like_notebook_code():
    """This module's functions travel by value with the globals they read, as a notebook
    cell's do (a rank could otherwise import this module and build its own data)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def holders_of_segments(segment: str = SEGMENT) -> list[int]:
    """Our processes that hold a launch's shared segment, by descriptor or by mapping."""
    holders = []
    me = os.getuid()
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if os.stat(f"/proc/{pid}").st_uid != me:
                continue
            with open(f"/proc/{pid}/maps") as maps:
                mapped = segment in maps.read()
            held = any(segment in _link(fd) for fd in glob.glob(f"/proc/{pid}/fd/*"))
        except OSError:
            continue
        if mapped or held:
            holders.append(pid)
    return holders


def wait_no_holders(timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (holders := holders_of_segments()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return holders


# notebook globals, captured by the functions below
TENSOR = torch.arange(4_000_000, dtype=torch.float32)  # 16 MB
ARRAY = np.arange(3_000_000, dtype=np.int64)  # 24 MB
DATASET = TensorDataset(torch.ones(100_000, 10), torch.arange(100_000))
STATE = {"w": torch.full((512, 1024), 2.0), "b": torch.zeros(1024), "step": 7}


def reads_every_capture() -> dict:
    with open("/proc/self/maps") as maps:
        mapped = SEGMENT in maps.read()
    x, y = DATASET[12_345]
    return {
        "tensor": int(TENSOR.to(torch.int64).sum()),
        "array": int(ARRAY.sum()),
        "dataset": (len(DATASET), float(x.sum()), int(y)),
        "state": (float(STATE["w"].sum()), float(STATE["b"].sum()), STATE["step"]),
        "mapped": mapped,
        "writable": TENSOR.is_contiguous() and ARRAY.flags.writeable,
    }


@pytest.mark.ranks
def test_captured_tensors_arrays_datasets_and_dicts_arrive_intact_on_every_rank():
    for value in nbddp.notebook_launch(reads_every_capture, **TWO_CPU_QUIET, return_all=True):
        assert value == {
            "tensor": int(TENSOR.to(torch.int64).sum()),
            "array": int(ARRAY.sum()),
            "dataset": (100_000, 10.0, 12_345),
            "state": (2.0 * 512 * 1024, 0.0, 7),
            "mapped": True,
            "writable": True,
        }
    assert wait_no_holders() == []


def writes_to_its_copy() -> tuple[float, float]:
    if nbddp.rank() == 1:
        TENSOR.add_(1)  # copy-on-write: only rank 1's pages change
        ARRAY[:] = -1
    nbddp.barrier()
    return float(TENSOR[:10].sum()), float(ARRAY[:10].sum())


@pytest.mark.ranks
def test_a_rank_writing_to_captured_data_changes_only_its_own_copy():
    before = (float(TENSOR[:10].sum()), float(ARRAY[:10].sum()))
    rank0, rank1 = nbddp.notebook_launch(writes_to_its_copy, **TWO_CPU_QUIET, return_all=True)
    assert rank0 == before and rank1 == (before[0] + 10, -10.0)
    assert (float(TENSOR[:10].sum()), float(ARRAY[:10].sum())) == before  # the notebook's


@pytest.mark.unit
def test_the_pickle_stream_stays_small_and_the_bytes_go_to_one_segment(monkeypatch):
    monkeypatch.setenv("NBDDP_SHARE_IN_PLACE", "0")  # the opt-out: a copy per launch, as before
    big = torch.ones(25_000_000)  # 100 MB
    call = calls.dumps_call(lambda: big.sum(), (), {})
    try:
        # the lambda and the kernel's torch settings (its random state: about 8 KB), no tensor
        assert len(call.stream) < 20_000
        assert call.shared_size >= big.nbytes and len(call.fds) == 1
    finally:
        call.close()
    assert SEGMENT not in " ".join(_link(f) for f in glob.glob("/proc/self/fd/*"))
    assert not big.is_shared()


def _file_of(fd: int) -> tuple[int, int]:
    stat = os.fstat(fd)
    return stat.st_dev, stat.st_ino


@pytest.mark.ranks
def test_a_captured_tensor_is_shared_in_place_once_and_later_launches_copy_nothing():
    data = torch.arange(2_000_000, dtype=torch.float64)  # 16 MB
    view = data[8:]
    values = data.clone()
    assert not data.is_shared()
    first = calls.dumps_call(lambda: (data.sum(), view.sum()), (), {})
    second = calls.dumps_call(lambda: data.sum(), (), {})
    try:
        assert data.is_shared() and data.untyped_storage().is_shared()
        assert torch.equal(data, values) and view.data_ptr() == data.data_ptr() + 64
        # one file, the storage's own (both tensors view it), in both launches: no segment
        assert len(first.fds) == 1 and len(second.fds) == 1
        assert _link(f"/proc/self/fd/{first.fds[0]}").startswith("/dev/shm/torch_")
        assert _file_of(first.fds[0]) == _file_of(second.fds[0])
        assert first.layout is not None and len(first.layout.spans) == 2
        assert first.layout.spans[1][1] == 64  # the view, where it sits in the storage
    finally:
        first.close()
        second.close()
    sums = nbddp.notebook_launch(lambda: (float(data.sum()), float(view[0])), **TWO_CPU_QUIET)
    assert sums == (float(values.sum()), 8.0)


@pytest.mark.ranks
def test_storages_beyond_the_limit_of_one_launch_are_copied(monkeypatch):
    monkeypatch.setattr(calls, "MAX_PLACED", 2)
    tensors = [torch.full((100_000,), float(i)) for i in range(3)]
    call = calls.dumps_call(lambda: [t.sum() for t in tensors], (), {})
    try:
        assert len(call.fds) == 3  # the segment (the third storage's copy) and two files
        assert call.layout is not None and [f for f, _, _ in call.layout.spans] == [1, 2, 0]
        assert [t.is_shared() for t in tensors] == [True, True, False]  # the third copied
    finally:
        call.close()
    sums = nbddp.notebook_launch(lambda: [float(t.sum()) for t in tensors], **TWO_CPU_QUIET)
    assert sums == [0.0, 100_000.0, 200_000.0]


@pytest.mark.ranks
def test_the_next_launch_sees_the_kernels_writes_and_a_ranks_writes_stay_its_own():
    data = torch.zeros(1_000_000)  # 4 MB, shared in place by the first launch

    def rank1_writes() -> tuple[float, float]:
        seen = float(data[1])
        if nbddp.rank() == 1:
            data[0] = -5.0  # copy-on-write: rank 1's page only
        nbddp.barrier()
        return seen, float(data[0])

    assert nbddp.notebook_launch(rank1_writes, **TWO_CPU_QUIET, return_all=True) == [
        (0.0, 0.0),
        (0.0, -5.0),
    ]
    assert data.is_shared() and float(data[0]) == 0.0  # the notebook's is untouched
    data[1] = 42.0  # the notebook changes it between two launches
    assert nbddp.notebook_launch(rank1_writes, **TWO_CPU_QUIET, return_all=True) == [
        (42.0, 0.0),
        (42.0, -5.0),
    ]
    assert float(data[0]) == 0.0


@pytest.mark.ranks
def test_memory_torch_does_not_own_and_the_opt_out_stay_where_they_are(monkeypatch):
    array = np.zeros(1_000_000, dtype=np.float32)
    viewing = torch.from_numpy(array)  # moving it would end its sharing with the array
    strided = torch.zeros(2_000_000)[::2]  # not contiguous: gathered into the segment
    assert nbddp.notebook_launch(
        lambda: (float(viewing.sum()), float(strided.sum())), **TWO_CPU_QUIET
    ) == (0.0, 0.0)
    assert not viewing.is_shared() and not strided.is_shared()
    array[0] = 3.0
    assert float(viewing[0]) == 3.0  # still the array's memory
    monkeypatch.setenv("NBDDP_SHARE_IN_PLACE", "0")
    plain = torch.ones(1_000_000)
    assert nbddp.notebook_launch(lambda: float(plain.sum()), **TWO_CPU_QUIET) == 1e6
    assert not plain.is_shared()


def pss_of_the_run(kernel: int) -> int:
    """Rank 0: the proportional memory of the kernel and every rank, once all hold the data."""
    import torch.distributed as dist

    float(CAPTURED.sum()) if CAPTURED is not None else 0.0  # touch every page on every rank
    pids = [None] * nbddp.world_size()
    dist.all_gather_object(pids, os.getpid())
    total = sum(psutil.Process(pid).memory_full_info().pss for pid in [kernel, *pids])
    dist.barrier()
    return total


CAPTURED: torch.Tensor | None = None


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("in_place", [True, False])
def test_total_memory_grows_by_the_data_once_not_per_rank(monkeypatch, in_place):
    global CAPTURED
    monkeypatch.setenv("NBDDP_SHARE_IN_PLACE", "1" if in_place else "0")
    size = 256 * 2**20
    CAPTURED = None
    gc.collect()  # an earlier test's data, held by a reference cycle, would count in `empty`
    empty = nbddp.notebook_launch(pss_of_the_run, (os.getpid(),), **TWO_CPU_QUIET)
    CAPTURED = torch.ones(size // 4)
    try:
        baseline = nbddp.notebook_launch(pss_of_the_run, (os.getpid(),), **TWO_CPU_QUIET)
        # the kernel's own CAPTURED is in `baseline` but not in `empty`: count it out
        extra = baseline - empty - size
        if in_place:  # the ranks map the kernel's own pages: no second copy at all
            assert abs(extra) <= 0.2 * size + 64 * 2**20, (extra / size, baseline, empty)
        else:  # one copy in the launch's segment
            assert extra <= 1.2 * size + 64 * 2**20, (extra / size, baseline, empty)
            assert extra >= 0.5 * size  # the ranks do hold the data: the measure is not blind
    finally:
        CAPTURED = None


def fails_after_reading() -> None:
    float(TENSOR.sum())
    raise RuntimeError("after reading")


@pytest.mark.ranks
def test_the_segment_is_gone_after_success_failure_and_interrupt():
    nbddp.notebook_launch(reads_every_capture, **TWO_CPU_QUIET)
    assert wait_no_holders() == []
    with pytest.raises(RuntimeError, match="after reading"):
        nbddp.notebook_launch(fails_after_reading, **TWO_CPU_QUIET)
    assert wait_no_holders() == []
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        nbddp.notebook_launch(_reads_then_sleeps, **TWO_CPU_QUIET)
    timer.join()
    assert wait_no_holders() == []


def _reads_then_sleeps() -> None:
    float(TENSOR.sum())
    time.sleep(60)


@pytest.mark.e2e
def test_the_segment_is_gone_when_the_kernel_is_killed(kernel_factory, tmp_path):
    doomed = kernel_factory()
    try:
        out, reply = doomed.run(
            "import nbddp, numpy, torch, time\n"
            "data, array = torch.ones(10_000_000), numpy.ones(10_000_000)\n"
            "def hold(directory):\n"
            "    float(data.sum()), float(array.sum())\n"
            "    open(f'{directory}/{nbddp.rank()}', 'w').close()  # it holds both now\n"
            "    time.sleep(600)\n"
            f"run = nbddp.notebook_launch(hold, ({str(tmp_path)!r},), num_workers=2,\n"
            "                           device='cpu', block=False)\n"
        )
        assert reply["status"] == "ok", out
        assert wait_until(lambda: len(os.listdir(tmp_path)) == 2, 120), "the ranks never read"
        out, reply = doomed.run("print(run.status)")
        assert reply["status"] == "ok" and "running" in out, out
        in_place = f"/dev/shm/torch_{doomed.pid}_"  # the tensor's storage, shared in place
        assert holders_of_segments() and len(holders_of_segments(in_place)) == 3  # + the ranks
        doomed.manager.signal_kernel(signal.SIGKILL)
        assert wait_no_holders() == []
        deadline = time.monotonic() + 10
        while holders_of_segments(in_place) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert holders_of_segments(in_place) == []
    finally:
        doomed.shutdown()


@pytest.mark.unit
def test_a_capture_that_is_large_for_this_machine_is_named(monkeypatch):
    monkeypatch.setattr(calls, "SHARED_WARN", 1e-6)
    monkeypatch.setattr(calls, "IN_BAND_WARN", 50_000)
    words = [f"word {i}" for i in range(20_000)]  # not a tensor: copied into every rank
    with pytest.warns(nbddp.NbddpWarning) as caught:
        call = calls.dumps_call(lambda: (TENSOR.sum(), len(words)), (), {})
        call.close()
    messages = [str(w.message) for w in caught]
    assert any("global 'TENSOR' (15.3 MiB)" in m and "of this machine's" in m for m in messages)
    assert any("closure 'words'" in m and "every rank unpickles a copy" in m for m in messages)
    assert all(w.filename == __file__ for w in caught)  # pointed at the caller, not at nbddp
