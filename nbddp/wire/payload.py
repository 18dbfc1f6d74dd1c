"""Pickle what travels between the kernel and the workers, and explain what cannot travel.

* ``dumps`` uses cloudpickle, so notebook functions, lambdas, closures and classes go by value
  and modules by name. On failure it walks the object graph to name the culprit and the path
  to it (``train -> global 'lock' -> _thread.lock``) instead of a bare pickle traceback.
* The same pickler moves tensors to the CPU and unwraps DistributedDataParallel on the way, so
  results never drag a CUDA context into the kernel. It does so while pickling, without a
  second copy of the object graph.

Non-goal: making unpicklable objects picklable; we only say which one it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import linecache
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from nbddp.errors import SerializationError
from nbddp.wire import in_place, unpickling
from nbddp.wire.code_origin import OriginPickler
from nbddp.wire.culprit import locate_unpicklable
from nbddp.wire.on_cpu import cpu_copy
from nbddp.wire.on_cpu import to_cpu as to_cpu  # the one-rank run's value, where callers find it

PROTOCOL = 5
_ARRIVAL_DEVICE: contextvars.ContextVar[Any] = contextvars.ContextVar("arrival", default=None)


class TransferPickler(OriginPickler):
    """cloudpickle (code keeping the name of its cell: ``code_origin``), plus: tensors leave
    their device for the CPU and DDP wrappers drop away.

    With a ``buffer_callback``, a dense tensor's bytes are not copied into the pickle stream:
    they travel as an out-of-band buffer that views the tensor's own memory. ``to_devices``
    (a launch's call, on its way to the ranks): a tensor that was on a GPU is rebuilt on each
    rank's own device (``nbddp.device()``), not on the kernel's GPU. ``in_place_min``: a CPU
    tensor of at least that many bytes has its storage shared in place (``in_place.py``; at
    most ``in_place_max`` storages) and
    its buffer is listed in ``placed``, by ``id``, with where it sits in the storage's file.
    """

    def __init__(
        self,
        file: Any,
        buffer_callback: Callable[[Any], Any] | None = None,
        to_devices: bool = False,
        in_place_min: int | None = None,
        in_place_max: int = 0,
    ) -> None:
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffer_callback)
        self._out_of_band = buffer_callback is not None
        self._to_devices = to_devices
        self._in_place_min = in_place_min
        self._in_place_max = in_place_max  # storages, at most; the others are copied
        self._storages: set[int] = set()
        self.modules: set[str] = set()  # of the functions, classes and modules pickled
        self.placed: dict[int, tuple[int, int, int]] = {}  # id(buffer): (fd, size, offset)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__.split(".")[0])
        elif isinstance(obj, (types.FunctionType, type)):
            self.modules.add(str(getattr(obj, "__module__", None) or "").split(".")[0])
        torch = sys.modules.get("torch")
        if torch is not None:
            if isinstance(obj, torch.Tensor):
                moved = obj.device.type not in ("cpu", "meta")
                tensor = cpu_copy(torch, obj) if moved else obj
                if self._out_of_band and _is_plain_dense(torch, tensor):
                    where = self._in_place(tensor) if not moved else None  # first: it moves
                    reduced = _tensor_as_buffer(torch, tensor, moved and self._to_devices)
                    if where is not None:
                        self.placed[id(reduced[1][0])] = where
                    return reduced
                if moved and self._to_devices:  # sparse, quantized, a subclass: theirs, moved
                    return _arriving, (tensor,)
                if moved:
                    return tensor.__reduce_ex__(PROTOCOL)
            elif isinstance(obj, torch.nn.parallel.DistributedDataParallel):
                return _identity, (obj.module,)
        return super().reducer_override(obj)

    def _in_place(self, tensor: Any) -> tuple[int, int, int] | None:
        if self._in_place_min is None or tensor.nbytes < self._in_place_min:
            return None
        storage = tensor.untyped_storage()._cdata  # the same storage, however many views
        if storage not in self._storages and len(self._storages) >= self._in_place_max:
            return None  # not moved at all: copied with the rest
        self._storages.add(storage)
        found = in_place.storage_file(tensor)
        if found is None:
            return None
        return (*found, tensor.storage_offset() * tensor.element_size())


def _is_plain_dense(torch: Any, tensor: Any) -> bool:
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type == "cpu"
        and "numpy" in sys.modules
    )


def _tensor_as_buffer(torch: Any, tensor: Any, on_device: bool) -> tuple[Any, ...]:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return _rebuild_tensor, (
        pickle.PickleBuffer(data),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.requires_grad,
        isinstance(tensor, torch.nn.Parameter),
        on_device,
    )


def _rebuild_tensor(
    buffer: Any,
    dtype: Any,
    shape: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
    on_device: bool = False,
) -> Any:
    import torch

    raw = memoryview(buffer)
    if raw.nbytes:  # the buffer it arrived in becomes the tensor's memory: no copy
        flat = torch.frombuffer(raw if not raw.readonly else bytearray(raw), dtype=torch.uint8)
    else:
        flat = torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(dtype).reshape(shape)
    target = _ARRIVAL_DEVICE.get()
    if (
        on_device and target is not None
    ):  # it was on the kernel's GPU: on this rank's own device now
        tensor = tensor.to(target)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if tensor.is_floating_point() else tensor


def _arriving(tensor: Any) -> Any:
    """A tensor that left the kernel's GPU in its own format (not as bytes): on this rank's
    device, as the plain ones are (``_rebuild_tensor``)."""
    target = _ARRIVAL_DEVICE.get()
    if target is None:
        return tensor
    import torch

    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(tensor.data.to(target), requires_grad=tensor.requires_grad)
    return tensor.to(target)


@contextlib.contextmanager
def arriving_on(device: Any) -> Iterator[None]:
    """Tensors that left the kernel from a GPU arrive on ``device`` (the rank's own) while
    unpickling inside this block; handed in, so that pickling never asks the rank side."""
    token = _ARRIVAL_DEVICE.set(device)
    try:
        yield
    finally:
        _ARRIVAL_DEVICE.reset(token)


def _identity(obj: Any) -> Any:
    return obj


def dumps(obj: Any, *, what: str, root: str) -> bytes:
    """Pickle ``obj`` for the other side or raise ``SerializationError`` naming the culprit.

    ``what`` says what was being sent ("train to the workers"), ``root`` names ``obj`` at the
    start of the path ("train").
    """
    try:
        return _dumps(obj)
    except Exception as exc:  # any pickling failure; we re-explain it below
        path, reason = locate_unpicklable(obj, root, exc, check_picklable)
        raise SerializationError(what, path, reason) from None


class _ExceptionPickler(TransferPickler):
    """Exceptions by their state, not by calling their class again: a class whose
    ``__init__`` takes other arguments than ``args`` (``MyError(message, code)``) cannot be
    rebuilt by pickle's default, and its instance would not reach the kernel at all."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, BaseException) and _own_init(type(obj)):
            state = dict(vars(obj)) if hasattr(obj, "__dict__") else None
            return _rebuild_exception, (type(obj), obj.args, state)
        return super().reducer_override(obj)


def _own_init(cls: type) -> bool:
    """Whether a class above the builtin exceptions defines ``__init__`` (the builtins pickle
    themselves well, fields in C slots included)."""
    return any("__init__" in vars(c) for c in cls.__mro__ if c.__module__ != "builtins")


def _rebuild_exception(cls: type, args: tuple[Any, ...], state: dict[str, Any] | None) -> Any:
    error = cls.__new__(cls, *args)
    error.args = args
    if state:
        error.__dict__.update(state)
    return error


def dumps_exception(exc: BaseException) -> bytes:
    """A rank's exception for the kernel (its cause and traceback stay behind)."""
    buffer = io.BytesIO()
    _ExceptionPickler(buffer).dump(exc)
    return buffer.getvalue()


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    TransferPickler(buffer).dump(obj)
    return buffer.getvalue()


def dumps_oob(obj: Any, *, what: str, root: str) -> tuple[bytes, list[memoryview]]:
    """Like :func:`dumps`, but tensor bytes stay out of the stream: returns the stream and the
    buffers (views of the tensors' memory) to send after it, for ``loads(stream, buffers)``."""
    buffers: list[memoryview] = []
    stream = io.BytesIO()
    try:
        TransferPickler(stream, buffer_callback=lambda b: buffers.append(b.raw())).dump(obj)
    except Exception as exc:
        path, reason = locate_unpicklable(obj, root, exc, check_picklable)
        raise SerializationError(what, path, reason) from None
    return stream.getvalue(), buffers


def check_picklable(obj: Any, pickler: type[Any] | None = None) -> BaseException | None:
    """Would ``obj`` travel (with ``pickler``; ours by default)? Cheap for tensors and arrays:
    their bytes are not copied."""
    try:
        if pickler is None:
            TransferPickler(_Discard(), buffer_callback=lambda b: None).dump(obj)
        else:
            pickler(_Discard()).dump(obj)
    except Exception as exc:
        return exc
    return None


class _Discard(io.RawIOBase):
    """A file that keeps nothing: pickling into it only tells whether it works."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def loads(data: bytes, buffers: list[Any] | None = None) -> Any:
    return unpickling.loads(data, buffers)


def notebook_sources() -> dict[str, tuple[Any, ...]]:
    """Source lines of notebook cells, which live only in the kernel's linecache.

    Shipped so a worker's traceback shows the cell's lines, not bare line numbers.
    IPython registers cells with an mtime of None, which keeps linecache from checking the disk;
    older IPython (8.0 for one) gave them a time and kept them in ``linecache._ipython_cache``.
    Either way they travel with an mtime of None, so the rank's linecache keeps them.
    """
    cells = dict(getattr(linecache, "_ipython_cache", {}))
    cells.update(
        (name, entry)
        for name, entry in list(linecache.cache.items())
        if len(entry) == 4 and entry[1] is None
    )
    return {
        name: (size, None, lines, fullname) for name, (size, _, lines, fullname) in cells.items()
    }


def install_sources(sources: dict[str, tuple[Any, ...]]) -> None:
    linecache.cache.update(sources)
