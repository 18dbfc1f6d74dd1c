"""Notebook code in a rank's own worker processes, whatever their start method.

A rank's notebook functions and classes arrived by value (cloudpickle); their module is
``__main__``, and the rank's ``__main__`` is nbddp's launch script, which does not hold them.
``multiprocessing`` pickles classes and functions by reference (module and name), so a
``DataLoader(..., multiprocessing_context="spawn" | "forkserver")`` over a ``Dataset`` defined in
a cell, or a ``Pool`` mapping a notebook function, failed in the child: "attribute lookup
Squares on __main__ failed". Only ``fork`` worked, its children inheriting the objects.

:func:`install` makes multiprocessing's pickler (``ForkingPickler``: what ``Process`` under
spawn and forkserver, ``Queue``, ``Pipe``, ``Pool``, ``concurrent.futures`` and so DataLoader use)
send such code by value, as the launch itself does: a class or function of ``__main__``, of a
module registered with ``cloudpickle.register_pickle_by_value``, or that cannot be found by its
name, travels as a cloudpickle stream. Everything else is pickled as before (tensors still by
torch's shared-memory reducers). The child that unpickles one installs the same rule, so what
it sends back (a batch of a notebook class) travels too.

Non-goal: the kernel's own multiprocessing (the in-kernel rank of a one-worker launch): the
notebook's ``__main__`` is the user's to configure.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from typing import Any

import cloudpickle

from nbddp.wire.code_origin import OriginPickler


def install() -> None:
    """Teach this process's ``ForkingPickler`` to send notebook code by value (idempotent)."""
    from multiprocessing.reduction import ForkingPickler

    if ForkingPickler.__dict__.get("reducer_override") is not _reducer_override:
        ForkingPickler.reducer_override = _reducer_override  # type: ignore[method-assign]


def _reducer_override(pickler: Any, obj: Any) -> Any:
    if isinstance(obj, (type, types.FunctionType)) and _by_value(obj):
        return _rebuild, (_dumps(obj),)
    return NotImplemented


def _by_value(obj: type | types.FunctionType) -> bool:
    """Whether pickle's lookup by name would fail (or find the wrong object) in a child."""
    module_name = getattr(obj, "__module__", None)
    if module_name is None or module_name == "__main__":
        return True
    registered = cloudpickle.list_registry_pickle_by_value()
    if any(module_name == m or module_name.startswith(m + ".") for m in registered):
        return True
    found: Any = sys.modules.get(module_name)
    for part in obj.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is not obj  # a local class or closure, or a module's shadowed name


def _dumps(obj: Any) -> bytes:
    stream = io.BytesIO()
    OriginPickler(stream, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)  # frames keep their cell
    return stream.getvalue()


def _rebuild(stream: bytes) -> Any:
    install()  # in the child: what it sends back travels the same way
    return cloudpickle.loads(stream)
