"""What travels between a rank and the kernel: every message as a small typed tuple (the job
spec a rank reads first is ``spec.py``'s). Both sides import this module; it imports neither
torch nor IPython.

Worker -> kernel, in this order on each rank's connection:

    Hello(rank)                       first frame, right after the handshake
    DeviceName(rank, name)            rank 0's device, for the panel's header
    Joined(rank)                      the rank is in the process group
    Rows(rank, first, blocks)         rows first, first + 1, ... of ``nbddp.log``; row k of
                                      every rank is averaged by the kernel
    MainRows(rank, rows)              rows only rank 0 logs (a library's tracker that runs on
                                      the main process), each with the library's step; taken
                                      as they are, not averaged
    Bars(rank, bars)                  a snapshot of rank 0's progress bars
    Display(rank, data, metadata, transient, update)
                                      a rich output (a MIME bundle: IPython's display(),
                                      a matplotlib figure, the cell's last value), for the
                                      cell; sent after flushing the rank's stdout/stderr, so
                                      the kernel shows the text printed before it first.
                                      At most ``MAX_DISPLAYS`` new outputs per rank and run,
                                      each at most ``MAX_DISPLAY_BYTES``
    Trained(rank, check)              just before Result: what the rank knows of its DDP
                                      models and collectives (``SyncCheck``), for the
                                      kernel's "did DDP happen?" verdict
    Result(rank, stream, early_exit)  fn returned (its value pickled for rank 0 or
                                      ``return_all``; the tensors' bytes follow as the frame's
                                      buffers); ``early_exit``: it called sys.exit(0)
    Failed(rank, report)              fn raised; the rank exits non-zero next
    Unsendable(rank, path, reason)    the return value cannot travel back
    ExitReport(rank, problems)        after ``Result``: what went wrong in its exit work

Kernel -> worker:

    Job(call, sources, shared)        the pickled (fn, args, kwargs), the notebook's cell
                                      sources for tracebacks, and the layout of the shared
                                      memory segment whose descriptor travels with the frame
    Shown()                           the rank's last new ``Display`` was handed on after
                                      what the rank printed before it; the rank waits for
                                      this, so that what it prints next comes after it
    AllJoined()                       every rank is in the process group. A rank that finished
                                      waits for this before it exits, so that none leaves
                                      while a peer still needs it to join (rank 0 hosts the
                                      rendezvous store); after it, a rank that leaves early
                                      is seen by its peers, and reported as the root cause

A session's ranks (``JobSpec.session``) stay up: after the ``Job`` (which carries no call) and
``Joined``, each runs one task after another, answering every ``Task`` with ``Result``,
``Failed`` or ``Unsendable``; just before its answer, rank 0 sends ``Names``, and a rank whose
count of collectives changed ``Issued``.

    Task(task, kind, call, sources, shared, return_all, output)   kernel -> rank
    Interrupt(task)                   KeyboardInterrupt into that task's code, if it still runs
    Probe()                           asks for a RankStatus, answered even while a task runs
    RankStatus(rank, busy, memory, device_memory)                  rank -> kernel
    Names(rank, names)                the names the session's namespace holds on rank 0
    Issued(rank, groups)              before a task's answer, when they changed: how many
                                      collectives the rank issued on each of its process
                                      groups (None: it cannot count them), to tell whether
                                      they are in step
    Close()                           the session ends: each rank runs its exit work, exits

Any rank, any time: ``AskStacks(query, native)``, answered by ``RankStacks(rank, query, report)``
(where its threads are; defined in ``stacks.py``); ``Prompt`` (pdb or ``input()`` waits for a
line typed in the notebook), answered by ``Reply``, and ``LeftPdb``/``Release``/``Quit``
(``prompts.py``); a graceful stop's ``StopAsked``, answered by ``Checks``, then ``StopAt``,
``StoppedAt``; a signal's ``StopRequested``; and rank 0's ``Checkpointed`` (``stopping.py``).

Messages are NamedTuples: pickled in a few bytes, immutable, and matched by class in the
supervisor (``match message: case Rows(rank, first, blocks): ...``).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from nbddp.wire.prompts import LeftPdb, Prompt, Quit, Release, Reply
from nbddp.wire.stacks import AskStacks, RankStacks
from nbddp.wire.stopping import Checkpointed, Checks, StopAsked, StopAt, StoppedAt, StopRequested

Output = Literal["rank0", "all", "none"]  # whose output a run shows

# Logged rows as a rank sends them: a block is consecutive rows with the same epoch and keys,
# one list of values per key.
Block = tuple[int | None, tuple[str, ...], list[list[float]]]


class BarSnapshot(NamedTuple):
    """One progress bar of rank 0 at one moment (``nbddp.progress``)."""

    id: int
    level: int  # 0 outermost; nested bars count up
    desc: str | None
    n: int
    total: int | None
    elapsed: float
    closed: bool


class ErrorReport(NamedTuple):
    """A rank's exception, described so the kernel can raise it well."""

    exc_type: str  # the class's name
    message: str  # str(exc), or a placeholder when that raised
    traceback: str  # from the user's frames down
    exception: bytes | None  # the exception itself, pickled, when it pickles
    time: float  # time.time() when it was caught
    mro: tuple[str, ...]  # qualified names of the class and its bases, for type checks
    module: str  # the class's module, to rebuild the class in the kernel
    hint: str = ""  # nbddp's word on what to change (a GPU-only line on a CPU rank)
    exitcode: int | None = None  # a script's exit code for it (sys.exit's, 1 for an exception)


class Hello(NamedTuple):
    rank: int


class DeviceName(NamedTuple):
    rank: int
    name: str


class Rows(NamedTuple):
    rank: int
    first: int
    blocks: list[Block]


class MainRows(NamedTuple):
    rank: int
    rows: list[tuple[int | None, dict[str, float]]]  # (step or None, values)


class Bars(NamedTuple):
    rank: int
    bars: list[BarSnapshot]


class ModelPrint(NamedTuple):
    """A DDP model's parameters at the end of a run, in a few numbers to compare across ranks."""

    name: str  # the wrapped module's class
    tensors: int  # how many parameters were fingerprinted (sharded ones are not)
    total: float  # the sum of their elements
    magnitude: float  # the sum of their absolute values
    squares: float  # the sum of their squares


class SyncCheck(NamedTuple):
    """What one rank knows of whether it trained together with the others."""

    models: tuple[ModelPrint, ...]  # every DDP model it built, in order
    collectives: int  # how many collectives its process groups ran
    stepped: bool  # an optimizer stepped
    alone: str = ""  # a library that ran this rank as a job of its own (Accelerate's state)


class Trained(NamedTuple):
    rank: int
    check: SyncCheck


MAX_DISPLAYS = 100  # new rich outputs a rank shows per run (updates in place not counted)
MAX_DISPLAY_BYTES = 8 << 20  # one bundle, encoded: a bigger one is replaced by a note


class Display(NamedTuple):
    """A rich output of a rank: IPython's display_data (or update_display_data)."""

    rank: int
    data: dict[str, Any]  # MIME type -> content (binary types base64, as Jupyter has them)
    metadata: dict[str, Any]
    transient: dict[str, Any]  # {"display_id": ...} for outputs updated in place
    update: bool = False


class Result(NamedTuple):
    rank: int
    stream: bytes | None  # None: this rank's value is not wanted (rank > 0, not return_all)
    early_exit: bool = False


class ExitReport(NamedTuple):
    rank: int
    problems: tuple[str, ...]  # one sentence each


class Failed(NamedTuple):
    rank: int
    report: ErrorReport


class Unsendable(NamedTuple):
    rank: int
    path: str
    reason: str


# -- a machine's ranks, as a judge hears them (rankgroup.py; forwarded by a cluster's node) --


class Received(NamedTuple):
    """A rank's message (Rows, Result, Failed, ...), with the frame's buffers."""

    rank: int
    message: Message
    buffers: list[Any]


class Ended(NamedTuple):
    """A rank's process ended (negative code: the signal), with its last lines of stderr."""

    rank: int
    code: int | None
    stderr_tail: str


class Started(NamedTuple):
    """Every rank of the group has its job."""


class Printed(NamedTuple):
    """Output of the ranks a cluster node shows (already prefixed), for the notebook."""

    text: str


class NodeLost(NamedTuple):
    """A cluster node's helper was lost: each of ``ranks`` ended with it."""

    ranks: tuple[int, ...]
    node: str
    reason: str


RankEvent = Received | Ended | Started | Printed | NodeLost


class SharedLayout(NamedTuple):
    """Where each out-of-band buffer sits: which shared file the message carries, what offset."""

    sizes: list[int]  # bytes of each file, in the order of the message's descriptors
    spans: list[tuple[int, int, int]]  # (file, offset, length) per buffer, in pickling order


class Job(NamedTuple):
    call: bytes
    sources: dict[str, tuple[Any, ...]]
    shared: SharedLayout | None
    store: bool = False  # rank 0's: the frame's last descriptor is the store's listening socket


class Task(NamedTuple):
    task: int
    kind: str  # "function": fn runs with the session namespace as its globals; "cell": a cell
    call: bytes
    sources: dict[str, tuple[Any, ...]]
    shared: SharedLayout | None
    return_all: bool
    output: str
    debug: bool = False  # an uncaught exception stops the rank in post-mortem pdb first


class Interrupt(NamedTuple):
    task: int


# The message of the KeyboardInterrupt a rank raises when an Interrupt came before its task
# started: the kernel then says the task never started there (rules/tracker.py).
BEFORE_THE_TASK = "interrupted before the task started"


class Probe(NamedTuple):
    pass


class RankStatus(NamedTuple):
    rank: int
    busy: bool
    memory: int  # the process's resident bytes
    device_memory: int | None  # bytes PyTorch holds on the rank's GPU (None on the CPU)


class Close(NamedTuple): ...


class Names(NamedTuple):
    rank: int
    names: tuple[str, ...]


class GroupCount(NamedTuple):
    """One process group as a rank sees it (``worker/diagnosis/collectives.py``)."""

    name: str  # torch's name of the group, the same on every member
    members: tuple[int, ...]  # its global ranks
    issued: int  # how many collectives this rank issued on it (torch's sequence number)


class Issued(NamedTuple):
    rank: int
    groups: tuple[GroupCount, ...] | None  # None: this torch cannot count them


class Joined(NamedTuple):
    rank: int


class AllJoined(NamedTuple):
    pass


class Shown(NamedTuple):
    pass


Message = (
    Hello
    | DeviceName
    | Joined
    | Rows
    | MainRows
    | Bars
    | Trained
    | Display
    | Result
    | Failed
    | Unsendable
    | ExitReport
    | Job
    | AllJoined
    | Shown
    | Task
    | Interrupt
    | Probe
    | RankStatus
    | Names
    | Issued
    | Close
    | AskStacks
    | RankStacks
    | Prompt
    | Reply
    | LeftPdb
    | Release
    | Quit
    | StopAsked
    | Checks
    | StopAt
    | StoppedAt
    | StopRequested
    | Checkpointed
)
