"""Modules travel by name, whatever their class: torch's module-like objects in ``sys.modules``
(``torch.backends.cudnn`` is a ``CudnnModule``) in functions, closures, captured objects,
``%%ddp`` inputs and exports alike (``wire/code_origin.py``)."""

from __future__ import annotations

import pickle
import pickletools
import sys
import types

import cloudpickle
import pytest
import torch
import torch.backends.cudnn as cudnn

from nbddp.exporting.pickling import ExportPickler, dumps_checked, modules_needed
from nbddp.wire.call import dumps_call, loads_call
from nbddp.wire.payload import check_picklable, dumps, loads

pytestmark = pytest.mark.unit


@pytest.fixture
def like_notebook_code():
    """This module's functions by value, as cloudpickle pickles a notebook cell's."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def gpu_setup_lines():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    return cudnn.benchmark, torch.backends


class Config:
    def __init__(self):
        self.backend = cudnn  # an object that holds a module-like one


def test_a_function_with_the_tf32_and_cudnn_lines_pickles_and_runs(like_notebook_code):
    """The launch used to fail with ``cannot pickle 'CudnnModule' object``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cudnn, "benchmark", False)
        patch.setattr(cudnn, "allow_tf32", True)
        fn = loads(dumps(gpu_setup_lines, what="fn to the workers", root="fn"))
        benchmark, backends = fn()
        assert benchmark is True and backends is sys.modules["torch.backends"]


def test_the_call_of_a_launch_carries_closures_and_captured_objects(like_notebook_code):
    config = Config()

    def closure():
        return cudnn, config.backend

    call = dumps_call(closure, (cudnn,), {"backends": torch.backends})
    fn, args, kwargs = loads_call(call.stream, call.layout, call.fds, None)
    call.close()
    assert fn() == (cudnn, cudnn) and args == (cudnn,)
    assert kwargs["backends"] is torch.backends
    assert {"torch"} <= call.needs()


def test_a_module_like_object_is_pickled_as_its_name():
    stream = dumps(cudnn, what="x", root="x")
    names = [arg for op, arg, _ in pickletools.genops(stream) if isinstance(arg, str)]
    assert "torch.backends.cudnn" in names and "subimport" in names
    assert loads(stream) is cudnn


def test_any_object_standing_in_sys_modules_goes_by_name(monkeypatch):
    """A library that puts a plain object into ``sys.modules`` (``sh``, ``typing.io``
    did): it is the name the receiver imports, not the object's state."""

    class Lazy:
        def __reduce__(self):
            raise TypeError("cannot pickle 'Lazy' object")

    lazy = Lazy()
    monkeypatch.setitem(sys.modules, "nbddp_test_lazy_module", lazy)
    assert check_picklable(lazy) is None
    assert loads(dumps({"m": lazy}, what="x", root="x"))["m"] is lazy


def test_a_module_registered_by_value_still_travels_by_value():
    module = types.ModuleType("nbddp_test_by_value")
    module.answer = 42  # type: ignore[attr-defined]
    sys.modules["nbddp_test_by_value"] = module
    cloudpickle.register_pickle_by_value(module)
    try:
        stream = dumps(module, what="x", root="x")
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules["nbddp_test_by_value"]
    assert pickle.loads(stream).answer == 42  # rebuilt from its state: no import


def test_a_ddp_cells_input_and_an_export_carry_them_too(like_notebook_code):
    assert check_picklable(cudnn) is None  # %%ddp checks each input this way
    stream = dumps_checked(
        {"fn": gpu_setup_lines, "args": (), "kwargs": {"cudnn": cudnn}},
        what="fn to the script",
        pieces=[("fn", gpu_setup_lines)],
    )
    assert "torch" in modules_needed(stream)
    assert pickle.loads(stream)["kwargs"]["cudnn"] is cudnn
    assert check_picklable(torch.backends, ExportPickler) is None


class _Counting(dict):
    """A ``sys.modules`` that counts the entries read through ``get``."""

    reads = 0

    def get(self, *args):  # type: ignore[override]
        self.reads += 1
        return super().get(*args)


def test_the_table_reads_only_what_was_imported_since(monkeypatch):
    """A whole pass over ``sys.modules`` in a freshly forked rank copies the pages of every
    module it touches (~6 ms of a ~60 ms launch here): once read (by the helper before it
    forks), the table reads only the names added since, and still sees what left."""
    from nbddp.wire import code_origin

    modules = _Counting(sys.modules)
    monkeypatch.setattr(code_origin, "sys", types.SimpleNamespace(modules=modules))
    monkeypatch.setattr(code_origin, "_table", {})
    monkeypatch.setattr(code_origin, "_tail", None)
    monkeypatch.setattr(code_origin, "_size", -1)
    code_origin.standing_in_sys_modules()
    assert modules.reads == len(modules)  # the first read: all of it

    modules.reads = 0
    assert code_origin.standing_in_sys_modules() is code_origin._table
    assert modules.reads == 0  # nothing new

    fake = types.SimpleNamespace(name="a library's object")
    modules["nbddp_test_fake_one"] = fake
    modules["nbddp_test_plain"] = types.ModuleType("nbddp_test_plain")
    assert code_origin.standing_in_sys_modules()[id(fake)] == "nbddp_test_fake_one"
    assert modules.reads == 2  # the two new names only

    del modules["nbddp_test_plain"]  # the last name read leaves: everything is read again
    modules.reads = 0
    other = types.SimpleNamespace()
    modules["nbddp_test_fake_two"] = other
    table = code_origin.standing_in_sys_modules()
    assert table[id(other)] == "nbddp_test_fake_two" and table[id(fake)] == "nbddp_test_fake_one"
    assert modules.reads == len(modules)
