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

Non-goal: carrying the cell's source lines (the launch's ``Job`` carries them already).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import cloudpickle


class OriginPickler(cloudpickle.Pickler):  # type: ignore[misc] # cloudpickle is untyped
    """cloudpickle, with every code object's file name and first line kept as they were."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The copies cloudpickle reduces itself, by id: held until the pickler goes, so no
        # other object can take an id while the stream is written.
        self._copies: dict[int, types.CodeType] = {}

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            return self._with_origin(obj)
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
