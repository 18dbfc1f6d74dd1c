"""What an exported script loads: the notebook's function and its captures, or a cell's
inputs, pickled by value for a Python where nbddp's kernel side is absent.

Unlike a launch's call (``wire/call.py``), nothing here may refer to nbddp by name: a tensor on
the notebook's GPU is a persistent id the script's unpickler moves to its rank's device, and a
DDP wrapper is stored as the module it wraps. What the pickle does refer to by name (the
modules the ranks must import) is read back from the stream itself, so the script can say what
is missing before it unpickles anything.

Non-goal: shrinking the payload; tensors travel in the stream as torch pickles them.
"""

from __future__ import annotations

import importlib.metadata
import io
import operator
import pickletools
import sys
import types
from collections.abc import Mapping
from typing import Any

from nbddp.errors import SerializationError
from nbddp.wire.code_origin import OriginPickler
from nbddp.wire.culprit import describe, function_children, locate_unpicklable
from nbddp.wire.payload import check_picklable

PROTOCOL = 5
_STRINGS = frozenset(
    {
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "UNICODE",
        "SHORT_BINSTRING",
        "BINSTRING",
        "STRING",
    }
)


class ExportPickler(OriginPickler):
    """cloudpickle (code keeping the name of its cell: ``code_origin``), with GPU tensors
    marked for the rank's device and DDP unwrapped."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=PROTOCOL)

    def persistent_id(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if (
            torch is not None
            and isinstance(obj, torch.Tensor)
            and obj.device.type not in ("cpu", "meta")
        ):
            cpu = obj.detach().cpu()
            if isinstance(obj, torch.nn.Parameter):
                cpu = torch.nn.Parameter(cpu, requires_grad=obj.requires_grad)
            elif cpu.is_floating_point():
                cpu.requires_grad_(obj.requires_grad)
            return ("on-device", cpu)
        return None

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.nn.parallel.DistributedDataParallel):
            return operator.getitem, ([obj.module], 0)
        return super().reducer_override(obj)


def dumps_checked(payload: Mapping[str, Any], *, what: str, pieces: list[tuple[str, Any]]) -> bytes:
    """The payload's bytes, or ``SerializationError`` naming the piece that cannot be pickled
    and the path to the culprit (``train -> global 'lock' -> _thread.lock``)."""
    stream = io.BytesIO()
    try:
        ExportPickler(stream).dump(dict(payload))
    except Exception as exc:
        for root, piece in pieces:
            failure = _check(piece)
            if failure is not None:
                path, reason = locate_unpicklable(piece, root, failure, _check)
                raise SerializationError(what, path, reason) from None
        raise SerializationError(what, what.split(" ")[0], describe(exc)) from None
    return stream.getvalue()


def call_pieces(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """What a call carries, each with the label a user recognises."""
    label = getattr(fn, "__qualname__", None) or repr(fn)
    pieces: list[tuple[str, Any]] = [(label, fn)]
    if isinstance(fn, types.FunctionType):
        pieces += [(f"{label} -> {child}", value) for child, value in function_children(fn)]
    pieces += [(f"args[{i}]", value) for i, value in enumerate(args)]
    pieces += [(f"kwargs[{key!r}]", value) for key, value in kwargs.items()]
    return pieces


def _check(obj: Any) -> BaseException | None:
    return check_picklable(obj, ExportPickler)


def modules_needed(stream: bytes) -> set[str]:
    """Top-level modules a pickle refers to by name: its globals, and the modules cloudpickle
    imports by name (``subimport``). The standard library and cloudpickle are left out."""
    modules: set[str] = set()
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # the value of each op that pushed; strings are what matter
    subimport_next = False
    for op, arg, _ in pickletools.genops(stream):
        name = op.name
        if name in _STRINGS or name in ("GET", "BINGET", "LONG_BINGET"):
            value = arg if name in _STRINGS else memo.get(int(str(arg)))
            if subimport_next and isinstance(value, str):  # subimport's argument
                modules.add(value)
            subimport_next = False
            pushed.append(value)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(str(arg))] = pushed[-1] if pushed else None
        elif name in ("GLOBAL", "INST"):
            module, _, attribute = str(arg).partition(" ")
            modules.add(module)
            subimport_next = attribute == "subimport"
        elif name == "STACK_GLOBAL":
            module, attribute = (pushed[-2], pushed[-1]) if len(pushed) >= 2 else ("", "")
            if isinstance(module, str):
                modules.add(module)
            subimport_next = attribute == "subimport"
            pushed.append(None)
        elif name not in ("FRAME", "PROTO", "STOP", "MARK"):
            pushed.append(None)
    tops = {m.split(".")[0] for m in modules if m}
    return {m for m in tops if m not in _NOT_NEEDED and m not in sys.stdlib_module_names}


_NOT_NEEDED = frozenset({"__main__", "__builtin__", "cloudpickle", "copy_reg"})


def describe_needs(modules: set[str]) -> dict[str, str]:
    """Each module with what the notebook had: ``numpy`` -> ``"2.1.0"``, a local module ->
    its file. What the script checks for, and what its docstring lists."""
    distributions = importlib.metadata.packages_distributions()
    described = {}
    for module in sorted(modules):
        if module == "nbddp":  # what the function calls: nbddp.rank(), prepare_model()...
            version = getattr(sys.modules["nbddp"], "__version__", "?")
            described[module] = f"{version}; only its rank side is imported"
            continue
        names = distributions.get(module, [])
        if names:
            try:
                version = importlib.metadata.version(names[0])
            except importlib.metadata.PackageNotFoundError:
                pass
            else:
                package = "" if names[0].lower() == module.lower() else f" from {names[0]}"
                described[module] = f"{version}{package}"
                continue
        loaded = sys.modules.get(module)
        origin = getattr(loaded, "__file__", None)
        described[module] = f"a local module, {origin}" if origin else "a local module"
    return described
