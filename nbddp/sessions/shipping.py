"""A function shipped to a session's ranks without the notebook globals they hold already:
those resolve in the rank's namespace, so shipping them would only copy (a model, a dataset)
for nothing.
"""

from __future__ import annotations

import types
from typing import Any

from nbddp.wire.call import rebind_globals


def _by_value(fn: types.FunctionType) -> bool:
    """Shipped with its globals (the notebook's functions), not imported by name."""
    import cloudpickle

    module = fn.__module__
    registered = cloudpickle.list_registry_pickle_by_value()
    return module == "__main__" or any(
        module == m or module.startswith(m + ".") for m in registered
    )


def without_names(fn: Any, names: frozenset[str]) -> Any:
    """``fn`` without the notebook globals the ranks hold already: those resolve there, so
    shipping them would only copy (a model, a dataset) for nothing."""
    if not isinstance(fn, types.FunctionType) or not names or not _by_value(fn):
        return fn
    shared = names.intersection(fn.__globals__)
    if not shared:
        return fn
    return rebind_globals(fn, {k: v for k, v in fn.__globals__.items() if k not in shared})
