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

import io
import linecache
import os
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import cloudpickle

from .errors import SerializationError
from .wire import SharedLayout

PROTOCOL = 5
_MAX_DEPTH = 40


class _TransferPickler(cloudpickle.Pickler):  # type: ignore[misc] # cloudpickle is untyped
    """cloudpickle, plus: tensors leave their device for the CPU and DDP wrappers drop away.

    With a ``buffer_callback`` (``dumps_oob``), a dense tensor's bytes are not copied into the
    pickle stream: they travel as an out-of-band buffer that views the tensor's own memory.
    """

    def __init__(self, file: io.BytesIO, buffer_callback: Callable[[Any], Any] | None = None):
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffer_callback)
        self._out_of_band = buffer_callback is not None

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None:
            if isinstance(obj, torch.Tensor):
                moved = obj.device.type not in ("cpu", "meta")
                tensor = _cpu_copy(torch, obj) if moved else obj
                if self._out_of_band and _is_plain_dense(torch, tensor):
                    return _tensor_as_buffer(torch, tensor)
                if moved:
                    return tensor.__reduce_ex__(PROTOCOL)
            elif isinstance(obj, torch.nn.parallel.DistributedDataParallel):
                return _identity, (obj.module,)
        return super().reducer_override(obj)


def _is_plain_dense(torch: Any, tensor: Any) -> bool:
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type == "cpu"
        and "numpy" in sys.modules
    )


def _tensor_as_buffer(torch: Any, tensor: Any) -> tuple[Any, ...]:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return _rebuild_tensor, (
        pickle.PickleBuffer(data),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.requires_grad,
        isinstance(tensor, torch.nn.Parameter),
    )


def _rebuild_tensor(
    buffer: Any, dtype: Any, shape: tuple[int, ...], requires_grad: bool, parameter: bool
) -> Any:
    import torch

    raw = memoryview(buffer)
    if raw.nbytes:  # the received bytearray becomes the tensor's memory: no copy
        flat = torch.frombuffer(raw if not raw.readonly else bytearray(raw), dtype=torch.uint8)
    else:
        flat = torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(dtype).reshape(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if tensor.is_floating_point() else tensor


def _cpu_copy(torch: Any, tensor: Any) -> Any:
    cpu = tensor.detach().cpu()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(cpu, requires_grad=tensor.requires_grad)
    return cpu.requires_grad_(tensor.requires_grad) if cpu.is_floating_point() else cpu


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
        path, reason = locate_unpicklable(obj, root, exc)
        raise SerializationError(what, path, reason) from None


class _ExceptionPickler(_TransferPickler):
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


class Call(NamedTuple):
    """A launch's pickled ``(fn, args, kwargs)``, as it travels to every rank."""

    stream: bytes
    shared: SharedLayout | None = None


def dumps_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """Pickle a launch's ``(fn, args, kwargs)``; the path of a failure starts at the piece that
    failed: ``train -> global 'lock' -> _thread.lock`` or ``kwargs['opt'] -> ...``."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    what = f"{name} to the workers"
    try:
        return Call(_dumps((fn, args, kwargs)))
    except Exception as exc:
        pieces = [(name, fn)]
        pieces += [(f"args[{i}]", value) for i, value in enumerate(args)]
        pieces += [(f"kwargs[{key!r}]", value) for key, value in kwargs.items()]
        for root, piece in pieces:
            failure = check_picklable(piece)
            if failure is not None:
                path, reason = locate_unpicklable(piece, root, failure)
                raise SerializationError(what, path, reason) from None
        raise SerializationError(what, name, _reason(exc)) from None


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _TransferPickler(buffer).dump(obj)
    return buffer.getvalue()


def dumps_oob(obj: Any, *, what: str, root: str) -> tuple[bytes, list[memoryview]]:
    """Like :func:`dumps`, but tensor bytes stay out of the stream: returns the stream and the
    buffers (views of the tensors' memory) to send after it, for ``loads(stream, buffers)``."""
    buffers: list[memoryview] = []
    stream = io.BytesIO()
    try:
        _TransferPickler(stream, buffer_callback=lambda b: buffers.append(b.raw())).dump(obj)
    except Exception as exc:
        path, reason = locate_unpicklable(obj, root, exc)
        raise SerializationError(what, path, reason) from None
    return stream.getvalue(), buffers


def check_picklable(obj: Any) -> BaseException | None:
    """Would ``obj`` travel? Cheap for tensors: their bytes are not copied to find out."""
    try:
        _TransferPickler(io.BytesIO(), buffer_callback=lambda b: None).dump(obj)
    except Exception as exc:
        return exc
    return None


def loads(data: bytes, buffers: list[Any] | None = None) -> Any:
    return pickle.loads(data, buffers=buffers)


def loads_call(stream: bytes, shared: SharedLayout | None, fds: list[int]) -> Any:
    """A rank's side of :func:`dumps_call`: the ``(fn, args, kwargs)`` to run."""
    for fd in fds:
        os.close(fd)
    return pickle.loads(stream)


def locate_unpicklable(obj: Any, root: str, error: BaseException) -> tuple[str, str]:
    """Descend from ``obj`` to the deepest part that fails to pickle on its own.

    Returns ``(path, reason)``; the path ends with the culprit's type. Only runs on the error
    path, so pickling each candidate again is an acceptable cost.
    """
    path = [root]
    reason = _reason(error)
    seen = {id(obj)}
    current = obj
    for _ in range(_MAX_DEPTH):
        for label, child in _children(current):
            if id(child) in seen:
                continue
            seen.add(id(child))
            failure = check_picklable(child)
            if failure is not None:
                path.append(label)
                reason = _reason(failure)
                current = child
                break
        else:
            break
    if not isinstance(current, (types.FunctionType, type)):
        path.append(_type_name(current))
    return " -> ".join(path), reason


def _reason(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # an exception of the user's whose __str__ raises
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _type_name(obj: Any) -> str:
    cls = type(obj)
    module = cls.__module__
    if module in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """The parts pickle would descend into, each with a label for the path."""
    if isinstance(obj, types.FunctionType):
        yield from _function_children(obj)
    elif isinstance(obj, types.MethodType):
        yield "self", obj.__self__
        yield obj.__func__.__name__, obj.__func__
    elif isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield f"[{key!r}]", value
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield f"[{index}]", value
    elif isinstance(obj, (set, frozenset)):
        for value in list(obj):
            yield "item", value
    elif isinstance(obj, type):
        for name, value in list(vars(obj).items()):
            if not name.startswith("__"):
                yield f"attribute {name!r}", value
    else:
        yield from _reduced_children(obj)


def _function_children(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    for name in sorted(_global_names(fn.__code__)):
        if name in fn.__globals__:
            yield f"global {name!r}", fn.__globals__[name]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f"closure {name!r}", cell.cell_contents
        except ValueError:  # empty cell
            continue
    for index, value in enumerate(fn.__defaults__ or ()):
        yield f"default [{index}]", value
    for name, value in (fn.__kwdefaults__ or {}).items():
        yield f"default {name!r}", value
    for name, value in vars(fn).items():
        yield f"attribute {name!r}", value


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _reduced_children(obj: Any) -> Iterator[tuple[str, Any]]:
    try:
        reduced = obj.__reduce_ex__(PROTOCOL)
    except Exception:
        return  # obj itself refuses to be pickled: it is the culprit
    if not isinstance(reduced, tuple):
        return
    args = reduced[1] if len(reduced) > 1 else ()
    state = reduced[2] if len(reduced) > 2 else None
    if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
        state = {**(state[0] or {}), **(state[1] or {})}
    if isinstance(state, dict):
        for name, value in state.items():
            yield f"attribute {name!r}", value
    elif state is not None:
        yield "state", state
    for index, value in enumerate(args or ()):
        if not isinstance(value, type):
            yield f"argument [{index}]", value
    for label, position in (("item", 3), ("entry", 4)):
        if len(reduced) > position and reduced[position] is not None:
            for value in reduced[position]:
                yield label, value


def notebook_sources() -> dict[str, tuple[Any, ...]]:
    """Source lines of notebook cells, which live only in the kernel's linecache.

    Shipped so a worker's traceback shows the cell's lines, not bare line numbers.
    IPython registers cells with an mtime of None, which keeps linecache from checking the disk.
    """
    return {
        name: entry
        for name, entry in list(linecache.cache.items())
        if len(entry) == 4 and entry[1] is None
    }


def install_sources(sources: dict[str, tuple[Any, ...]]) -> None:
    linecache.cache.update(sources)


def to_cpu(value: Any) -> Any:
    """In-kernel counterpart of the transfer pickler, for the fallback: no pickling, no copy of
    what already is on the CPU. Walks plain containers; moves tensors and modules to the CPU;
    unwraps DDP. Other objects are returned as they are."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        value = value.module
    if isinstance(value, torch.nn.Module):
        return value.cpu()
    if isinstance(value, torch.Tensor):
        return _cpu_copy(torch, value) if value.device.type not in ("cpu", "meta") else value
    if type(value) is dict:
        return {key: to_cpu(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_cpu(item) for item in value)
    return value
