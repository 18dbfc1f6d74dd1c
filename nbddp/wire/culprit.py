"""Say which object cannot travel, and where it hides: the path from what was being sent down
to the culprit (``train -> global 'lock' -> _thread.lock``), where pickle itself only names a
type. Runs only on the error path, so pickling each candidate again is an acceptable cost.

Non-goal: making such objects picklable.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

PROTOCOL = 5
_MAX_DEPTH = 40

Check = Callable[[Any], BaseException | None]  # the failure of pickling one object, or None


def locate_unpicklable(obj: Any, root: str, error: BaseException, check: Check) -> tuple[str, str]:
    """Descend from ``obj`` to the deepest part that fails to pickle on its own (``check``).

    Returns ``(path, reason)``; the path ends with the culprit's type.
    """
    path = [root]
    reason = describe(error)
    seen = {id(obj)}
    current = obj
    for _ in range(_MAX_DEPTH):
        for label, child in _children(current):
            if id(child) in seen:
                continue
            seen.add(id(child))
            failure = check(child)
            if failure is not None:
                path.append(label)
                reason = describe(failure)
                current = child
                break
        else:
            break
    if not isinstance(current, (types.FunctionType, type)):
        path.append(_type_name(current))
    return " -> ".join(path), reason


def describe(exc: BaseException) -> str:
    """``Type: message`` of a pickling failure, whatever its ``__str__`` does."""
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
        yield from function_children(obj)
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


def function_children(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
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
