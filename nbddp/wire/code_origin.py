"""Notebook code keeps the name of the cell it came from, whatever the pickler does to it.

A function defined in a cell travels by value: cloudpickle rebuilds its code object on the
rank. The code's file name (``/tmp/ipykernel_7/4242.py``, which IPython shows as ``Cell In[5]``)
and first line are what tracebacks, the roll-call, warnings, pdb and ``inspect.getsource`` use
to find the cell's lines (shipped beside the call, ``payload.notebook_sources``). cloudpickle
3.1.3 writes ``"<dynamic-code>"`` instead of every file name (for deterministic pickles,
cloudpickle PR #560), which turned every notebook frame on a rank into
``File "<dynamic-code>", line 3`` with no source line, while CI was green.

So nbddp carries the origin by its own means: :class:`OriginPickler` reduces each code object
to ``put_back(bare_copy)``, where ``put_back`` is
``functools.partial(types.CodeType.replace, co_filename=..., co_firstlineno=...)`` and the copy
is reduced by cloudpickle as usual. Whatever a cloudpickle release does to the copy's name and
first line, they are put back as the kernel knew them. Loading it needs the standard library and
cloudpickle only, so an exported script (which has no nbddp) gets the same frames.

Modules travel by name, whatever their class. cloudpickle pickles a module by reference only
when its type is exactly ``types.ModuleType``; torch puts instances of its own module classes
into ``sys.modules`` (``torch.backends.cudnn`` is a ``CudnnModule``, ``torch.backends`` a
``GenericModule``), and cloudpickle's by-value fallback then fails with ``cannot pickle
'CudnnModule' object``: a notebook that ran ``import torch.backends.cudnn as cudnn`` or
``torch.backends.cudnn.benchmark = True`` could not launch. So any object that stands in
``sys.modules`` under a name (other than a plain module, which cloudpickle handles, and a module
registered to be pickled by value) is pickled as ``subimport(name)``: the receiving process
imports it and takes what its ``sys.modules`` holds under that name.

Non-goal: carrying the cell's source lines (the launch's ``Job`` carries them already).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as _cloudpickle_impl


class OriginPickler(cloudpickle.Pickler):  # type: ignore[misc] # cloudpickle is untyped
    """cloudpickle, with every code object's file name and first line kept as they were."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The copies cloudpickle reduces itself, by id: held until the pickler goes, so no
        # other object can take an id while the stream is written.
        self._copies: dict[int, types.CodeType] = {}
        self._standing = standing_in_sys_modules()

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            return self._with_origin(obj)
        name = self._standing.get(id(obj))
        if name is None and isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            name = getattr(obj, "__name__", None)  # one that came since the table was read
        if isinstance(name, str) and sys.modules.get(name) is obj:
            return _cloudpickle_impl.subimport, (name,)
        return super().reducer_override(obj)

    def _with_origin(self, code: types.CodeType) -> Any:
        if id(code) in self._copies:
            return NotImplemented  # the bare copy: cloudpickle's own reduction
        copy = code.replace()  # a new object, equal to code: its reduction cannot recurse here
        self._copies[id(copy)] = copy
        put_back = functools.partial(
            types.CodeType.replace,
            co_filename=code.co_filename,
            co_firstlineno=code.co_firstlineno,
        )
        return put_back, (copy,)


# What sys.modules held that is not a plain module, by id: read up to _tail, its last name then.
_table: dict[int, str] = {}
_tail: str | None = None
_size = -1


def standing_in_sys_modules() -> dict[int, str]:
    """Every object ``sys.modules`` holds that cloudpickle would not pickle by name itself, by
    ``id``, with its name there: module-like objects (torch's ``CudnnModule``...) and any other
    object a library put there. Plain modules are cloudpickle's (they may be pickled by value:
    ``cloudpickle.register_pickle_by_value``), and so is a module registered that way. An entry
    is checked again when it is used.

    Read from the end back to the last name read before: an import appends to ``sys.modules``.
    A whole pass touches every module object (and its name), whose memory a rank shares with
    the helper it was forked from: ~6 ms of page copies in a fresh rank (~2,100 modules), on
    every launch. The helper reads it before it forks (``worker/helper/server.py``), so a rank
    reads only what it imported itself."""
    global _tail, _size
    modules = sys.modules
    last = next(reversed(modules), None)
    if last == _tail and len(modules) == _size:
        return _table
    try:
        names = []
        for name in reversed(modules):
            if name == _tail:
                break
            names.append(name)
        else:
            _table.clear()  # the last name went: every entry is read again
    except RuntimeError:  # another thread imported meanwhile: read it all
        _table.clear()
        names = list(modules)
    for name in names:
        obj = modules.get(name)
        if obj is None or type(obj) is types.ModuleType:
            continue
        if isinstance(obj, types.ModuleType) and _cloudpickle_impl._is_registered_pickle_by_value(
            obj
        ):
            continue
        known = _table.get(id(obj))
        if known is None or modules.get(known) is not obj:
            _table[id(obj)] = name
    _tail, _size = last, len(modules)
    return _table
