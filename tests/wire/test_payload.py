"""What travels: by value from the notebook, named precisely when it cannot travel, and
returned with tensors on the CPU and DDP unwrapped."""

import sys
import threading

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from nbddp import SerializationError
from nbddp.wire.call import dumps_call
from nbddp.wire.payload import dumps, loads, to_cpu

pytestmark = pytest.mark.unit

LOCK = threading.Lock()


def uses_global_lock():
    return LOCK.locked()


@pytest.fixture
def like_notebook_code():
    """Pickle this module's functions by value, as cloudpickle does for notebook cells."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class Holder:
    def __init__(self):
        self.config = {"lr": 0.1, "guard": threading.Lock()}


def test_global_lock_is_named_with_its_path(like_notebook_code):
    with pytest.raises(SerializationError) as info:
        dumps_call(uses_global_lock, (), {})
    message = str(info.value)
    assert "uses_global_lock -> global 'LOCK' -> _thread.lock" in message
    assert "uses_global_lock to the workers" in message
    assert "inside the function" in message  # says what to do
    assert isinstance(info.value, TypeError)


def test_closure_and_nested_attribute_paths():
    holder = Holder()

    def train():
        return holder

    with pytest.raises(
        SerializationError,
        match=r"closure 'holder' -> attribute 'config' -> "
        r"\['guard'\] -> _thread.lock",
    ):
        dumps_call(train, (), {})


def test_arguments_are_named_too():
    with pytest.raises(SerializationError, match=r"kwargs\['opt'\] -> _thread.lock"):
        dumps_call(print, (), {"opt": threading.Lock()})
    with pytest.raises(SerializationError, match=r"args\[1\] -> \[0\] -> _thread.lock"):
        dumps_call(print, (1, [threading.Lock()]), {})


def test_lambdas_closures_and_local_classes_travel_by_value():
    scale = 3

    class Local:
        def double(self, x):
            return 2 * x * scale

    call = dumps_call(lambda x: Local().double(x), (7,), {})
    fn, args, kwargs, _settings = cloudpickle.loads(call.stream)  # + the torch settings
    assert fn(*args, **kwargs) == 42


def test_results_are_unwrapped_from_ddp():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        back = loads(dumps({"model": model}, what="test", root="result"))
    finally:
        dist.destroy_process_group()
    assert type(back["model"]) is torch.nn.Linear
    assert torch.equal(back["model"].weight, model.module.weight)


def test_to_cpu_walks_containers_and_unwraps():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        out = to_cpu({"m": model, "xs": [torch.ones(1)], "n": 3})
    finally:
        dist.destroy_process_group()
    assert type(out["m"]) is torch.nn.Linear
    assert out["n"] == 3 and out["xs"][0].device.type == "cpu"


def test_out_of_band_tensors_round_trip_without_copying_into_the_stream():
    from nbddp.wire.payload import dumps_oob

    big = torch.arange(100_000, dtype=torch.float32)
    shared = torch.nn.Parameter(torch.ones(3, 2))
    value = {
        "big": big,
        "bf16": torch.ones(4, dtype=torch.bfloat16) / 3,
        "ints": torch.arange(5),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "strided": torch.ones(4, 4).t(),
        "param": shared,
        "again": shared,
        "flag": torch.tensor([True, False]),
    }
    stream, buffers = dumps_oob(value, what="test", root="value")
    assert len(stream) < 10_000  # the 400 kB of `big` are not in the stream
    back = loads(stream, [bytearray(b) for b in buffers])
    for name, tensor in value.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"] is back["again"]
    back["big"] += 1  # writable memory, not a read-only view of a message


def test_a_sparse_tensor_that_arrived_is_not_checked_again_by_the_next_torch_load(tmp_path):
    """Unpickling a sparse tensor leaves it on torch's list of sparse tensors to check, which
    only ``torch.load`` empties: after a result carrying one, the kernel's next
    ``torch.load(weights_only=True)`` warned about it (stop 47, under ``-W error``: failed)."""
    import io
    import socket
    import warnings

    from nbddp.wire.frames import Connection

    sparse = torch.eye(3).to_sparse()
    arrived = loads(dumps({"value": sparse}, what="the result", root="value"))  # a result
    assert torch.equal(arrived["value"].to_dense(), torch.eye(3))
    assert not torch._utils._sparse_tensors_to_validate
    ends = [Connection(s) for s in socket.socketpair()]  # a message's path
    try:
        ends[0].send({"metric": sparse})
        assert torch.equal(ends[1].recv(timeout=10).message["metric"].to_dense(), torch.eye(3))
    finally:
        for end in ends:
            end.close()
    assert not torch._utils._sparse_tensors_to_validate
    saved = io.BytesIO()
    torch.save({"w": torch.ones(2)}, saved)
    saved.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(torch.load(saved, weights_only=True)["w"], torch.ones(2))
