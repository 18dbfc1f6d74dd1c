"""A launch's ``(fn, args, kwargs)`` on its way to every rank: a small pickle stream, and the
bytes of every tensor and array it captures in shared memory, mapped by every rank: a CPU
tensor's own storage, moved there in place on its first launch (``in_place.py``: later
launches copy nothing), everything else copied once per launch into one segment
(``segment.py``), however many ranks there are.

The kernel's torch settings travel with it (``torch_settings.py``): each rank takes them after
its device is set, before ``fn`` starts.

A capture large enough to matter is said once, by name, before anything starts: a call whose
shared bytes exceed ``SHARED_WARN`` of this machine's memory, or whose pickle stream itself
(objects that are not tensors or arrays, unpickled by every rank into its own copy) exceeds
``IN_BAND_WARN`` bytes.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from nbddp.errors import SerializationError
from nbddp.errors.notices import warn_user
from nbddp.wire import in_place, payload, torch_settings, unpickling
from nbddp.wire import segment as shared
from nbddp.wire.culprit import describe, function_children, locate_unpicklable
from nbddp.wire.messages import SharedLayout
from nbddp.wire.payload import TransferPickler, check_picklable

SHARED_WARN = 0.25  # of the machine's memory
MAX_PLACED = 200  # storages shared in place per call (a descriptor each); more are copied
IN_BAND_WARN = 1 << 30  # bytes


class Call:
    """The pickled call: ``stream``, plus the shared memory files holding its out-of-band
    bytes: the segment of copies, and the files of storages shared in place (``placed``:
    duplicated descriptors, owned here). The kernel closes it once every rank has it (their
    mappings keep the pages)."""

    def __init__(
        self,
        stream: bytes,
        segment: shared.Segment | None = None,
        buffers: list[memoryview] | None = None,
        placed: list[tuple[int, int]] | None = None,
        spans: list[tuple[int, int, int]] | None = None,
    ) -> None:
        self.stream = stream
        self.segment = segment
        self.buffers = buffers or []  # not in a segment: views of the objects' own memory
        self.placed = placed or []  # (fd, size) of each storage file, after the segment
        self._spans = spans  # (file, offset, length) per buffer; None: the segment's own
        self.modules: set[str] = set()  # what the pickled call refers to by name

    @property
    def layout(self) -> SharedLayout | None:
        if self._spans is None:
            return self.segment.layout if self.segment is not None else None
        sizes = [self.segment.size] if self.segment is not None else []
        return SharedLayout(sizes + [size for _, size in self.placed], self._spans)

    @property
    def fds(self) -> list[int]:
        segment = [self.segment.fd] if self.segment is not None else []
        return segment + [fd for fd, _ in self.placed]

    @property
    def shared_size(self) -> int:
        placed = sum(size for _, size in self.placed)
        if self.segment is not None:
            return self.segment.size + placed
        return sum(b.nbytes for b in self.buffers) + placed

    def needs(self) -> set[str]:
        """The top-level modules the ranks must import to unpickle the call (those pickled
        by reference; by-value code, the notebook's own, needs none)."""
        import cloudpickle

        by_value = {name.split(".")[0] for name in cloudpickle.list_registry_pickle_by_value()}
        return {m for m in self.modules if m and m not in ("__main__", *by_value)}

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
        self.buffers = []
        for fd, _ in self.placed:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.placed = []


def dumps_call(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: Mapping[str, Any] | None = None,
    segment: bool = True,
    random: bool = True,
) -> Call:
    """Pickle a launch's call; tensors and arrays go to shared memory, a CUDA tensor to be
    rebuilt on each rank's own device. ``names`` are what the call carries by the names the
    user knows them by (a ``%%ddp`` cell's inputs), for the warnings and errors. Without
    ``segment`` (a cluster: Ray's object store carries the bytes) the buffers stay views,
    and no storage is shared in place. The kernel's torch settings go with it, its random
    state too unless ``random`` is False (a session's later tasks: its ranks keep theirs).

    A failure names the piece and the path to the culprit: ``train -> global 'lock' ->
    _thread.lock`` or ``kwargs['opt'] -> ...``."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    buffers: list[memoryview] = []  # to copy
    order: list[_Placed | int] = []  # per buffer: where it sits in place, or its copy's index
    storages: set[int] = set()  # the descriptors of the storages shared in place

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:  # True: keep it in the stream
        where = pickler.placed.pop(id(buffer), None)
        raw = buffer.raw()
        if raw.nbytes < shared.OUT_OF_BAND_MIN:
            return True
        if where is not None and (where[0] in storages or len(storages) < MAX_PLACED):
            storages.add(where[0])
            order.append((*where, raw.nbytes))
        else:
            order.append(len(buffers))
            buffers.append(raw)
        return False

    stream = io.BytesIO()
    in_place_min = shared.OUT_OF_BAND_MIN if segment and in_place.enabled() else None
    pickler = TransferPickler(
        stream, out_of_band, to_devices=True, in_place_min=in_place_min, in_place_max=MAX_PLACED
    )
    try:
        pickler.dump((fn, args, kwargs, torch_settings.snapshot(random)))
    except Exception as exc:
        pieces = [(name, fn), *_pieces(fn, args, kwargs, names)]
        raise _explained(f"{name} to the workers", exc, pieces) from None
    if not segment:
        call = Call(stream.getvalue(), buffers=buffers)
    else:
        call = _shared_call(stream.getvalue(), buffers, order)
        buffers = []  # views of the user's tensors: not kept
    call.modules = pickler.modules
    _warn_if_big(call, list(_pieces(fn, args, kwargs, names)))
    return call


_Placed = tuple[
    int, int, int, int
]  # a storage's file: descriptor, size; the buffer: offset, length


def _shared_call(stream: bytes, copies: list[memoryview], order: list[_Placed | int]) -> Call:
    """The call with its copies in a new segment (file 0, when there are any) and the files
    of the storages shared in place after it, one per storage however many tensors view it."""
    if all(isinstance(o, int) for o in order):  # nothing in place: the segment says it all
        return Call(stream, shared.Segment(copies) if copies else None)
    segment = shared.Segment(copies) if copies else None
    first = 1 if segment is not None else 0
    files: dict[int, int] = {}  # the storage's own descriptor: its index among the files
    placed: list[tuple[int, int]] = []
    spans: list[tuple[int, int, int]] = []
    try:
        for where in order:
            if isinstance(where, int):
                assert segment is not None
                start, length = segment.spans[where]
                spans.append((0, start, length))
                continue
            fd, size, offset, length = where
            if fd not in files:
                files[fd] = first + len(placed)
                placed.append((os.dup(fd), size))  # ours: the storage may go meanwhile
            spans.append((files[fd], offset, length))
    except BaseException:
        Call(stream, segment, placed=placed).close()
        raise
    return Call(stream, segment, placed=placed, spans=spans)


def loads_call(stream: bytes, layout: SharedLayout | None, fds: list[int], device: Any) -> Any:
    """A rank's side: the ``(fn, args, kwargs)`` to run, its tensors on the shared pages, and
    those captured from the kernel's GPU on ``device``; the kernel's torch settings are this
    process's from now on."""
    files = len(layout.sizes) if layout is not None else 0
    buffers = shared.map_buffers(fds[:files], layout) if layout is not None else []
    for fd in fds[files:]:
        os.close(fd)
    with payload.arriving_on(device):
        fn, args, kwargs, *settings = unpickling.loads(stream, buffers)
    for each in settings:
        torch_settings.apply(each, device)
    return fn, args, kwargs


def _pieces(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], names: Mapping[str, Any] | None
) -> Iterator[tuple[str, Any]]:
    """What the call carries besides fn's code, each with the label a user recognises."""
    if names is not None:
        yield from ((repr(n), value) for n, value in names.items())
        return
    label = getattr(fn, "__qualname__", None) or repr(fn)
    if isinstance(fn, types.FunctionType):
        yield from ((f"{label} -> {child}", value) for child, value in function_children(fn))
    yield from ((f"args[{i}]", value) for i, value in enumerate(args))
    yield from ((f"kwargs[{key!r}]", value) for key, value in kwargs.items())


def _explained(what: str, error: Exception, pieces: list[tuple[str, Any]]) -> Exception:
    for root, piece in pieces:
        failure = check_picklable(piece)
        if failure is not None:
            path, reason = locate_unpicklable(piece, root, failure, check_picklable)
            return SerializationError(what, path, reason)
    return SerializationError(what, what.split(" ")[0], describe(error))


def _warn_if_big(call: Call, pieces: list[tuple[str, Any]]) -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    wide = call.shared_size > SHARED_WARN * memory
    heavy = len(call.stream) > IN_BAND_WARN
    if not (wide or heavy):
        return
    if wide:
        label, size = _biggest(pieces, _shared_bytes)
        warn_user(
            f"the launch shares {_size(call.shared_size)} with its ranks, "
            f"{call.shared_size / memory:.0%} of this machine's {_size(memory)}; the largest "
            f"part is {label} ({_size(size)}). It is mapped once, not copied per rank; what a "
            "rank writes to it is copied page by page, into that rank's own memory."
        )
    if heavy:
        label, size = _biggest(pieces, _stream_bytes)
        warn_user(
            f"the launch's pickle is {_size(len(call.stream))}, mostly {label} "
            f"({_size(size)}): it is not made of tensors or arrays, so every rank unpickles a "
            "copy of its own. Hold such data as tensors or numpy arrays (shared, not copied), "
            "or load it inside the function."
        )


def _biggest(pieces: list[tuple[str, Any]], measure: Callable[[Any], int]) -> tuple[str, int]:
    sizes = [(measure(value), label) for label, value in pieces]
    size, label = max(sizes, default=(0, "the function itself"))
    return label, size


def _shared_bytes(obj: Any) -> int:
    total = 0

    def count(buffer: pickle.PickleBuffer) -> bool:
        nonlocal total
        size = buffer.raw().nbytes
        if size < shared.OUT_OF_BAND_MIN:
            return True
        total += size
        return False

    try:
        TransferPickler(_Counter(), count).dump(obj)
    except Exception:
        return 0
    return total


def _stream_bytes(obj: Any) -> int:
    counter = _Counter()
    try:
        TransferPickler(counter, lambda buffer: False).dump(obj)  # out-of-band bytes not counted
    except Exception:
        return 0
    return counter.size


class _Counter(io.RawIOBase):
    """A file that only counts what is written to it."""

    def __init__(self) -> None:
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        length = memoryview(data).nbytes
        self.size += length
        return length


def _size(nbytes: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def rebind_globals(fn: types.FunctionType, globals_: dict[str, Any]) -> types.FunctionType:
    """``fn`` with ``globals_`` as its globals, all else kept: how the kernel drops the names a
    session's ranks already hold, and how a rank runs a notebook function in its namespace."""
    copy = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy
