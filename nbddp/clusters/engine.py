"""How the kernel reaches a cluster's node helpers: the :class:`Engine` protocol (Ray's actors,
Slurm's TCP links), and :class:`NodeClient`, the typed calls of one launch to one node's
:class:`~nbddp.clusters.nodes.NodeCore`.

An engine moves a call and its answer, and nothing else: which method, with which arguments,
answered by what, is :class:`NodeClient`'s, which names each ``NodeCore`` method by the method
itself, so a rename or a changed signature there fails the type check here.

Non-goal: what the calls mean for a run (``ranks.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast

from nbddp.clusters.nodes import NodeCore, NodeStart
from nbddp.plan import LaunchPlan
from nbddp.wire.messages import Output, RankEvent, Task

P = ParamSpec("P")
T = TypeVar("T")


class Engine(Protocol):
    """One launch's view of a cluster's node helpers: how the kernel reaches them."""

    ship_hint: str  # how to make a module importable on every node, for the error

    def reserve(self, plan: LaunchPlan) -> list[Any]:
        """Room for the plan's ranks: one node (a key the other calls take) per node rank."""

    def info(self, node: Any) -> dict[str, Any]:
        """What the node's helper says of its node (``NodeCore.info``)."""

    def call(self, node: Any, method: str, *args: Any) -> Any:
        """Call ``method`` of the node's helper; a pending answer for ``wait`` and ``get``."""

    def wait(self, pending: list[Any], timeout: float) -> list[Any]:
        """Those of ``pending`` answered within ``timeout`` (at least one, if any is)."""

    def get(self, pending: Any) -> Any:
        """The answer; raises :class:`~nbddp.clusters.NodeGone` when the helper is gone."""

    def share(self, buffers: list[Any]) -> Any:
        """The call's bytes as every node's ``start``/``send_task`` takes them (sent once)."""

    def forget(self, node: Any) -> None:
        """The helper is gone or killed: the next launch starts a new one."""

    def kill(self, node: Any) -> None:
        """End a helper that does not answer."""

    def release(self, intact: bool) -> None:
        """The launch is over: free (or keep, when ``intact``) what ``reserve`` took."""

    def gpus(self, node_rank: int) -> tuple[str, ...] | None:
        """The GPUs ``reserve`` took for that node's ranks, as ``CUDA_VISIBLE_DEVICES`` names
        them; None: the node helper's own view is theirs (Slurm gives its step the GPUs)."""


class Answer(Generic[T]):
    """The pending answer of one call to a node's helper. Hashable (``wait`` returns those of
    a list that are ready); :meth:`get` returns the value, or raises what the call raised."""

    __slots__ = ("_engine", "pending")

    def __init__(self, engine: Engine, pending: Any) -> None:
        self._engine = engine
        self.pending = pending

    def get(self) -> T:
        return cast(T, self._engine.get(self.pending))


def wait(engine: Engine, answers: list[Answer[T]], timeout: float) -> list[Answer[T]]:
    """Those of ``answers`` that are ready within ``timeout`` (at least one, if any is)."""
    by_pending = {a.pending: a for a in answers}  # Ray's refs and futures are hashable
    return [by_pending[pending] for pending in engine.wait(list(by_pending), timeout)]


class NodeClient:
    """One launch's calls to one node's helper, each typed by the ``NodeCore`` method it calls
    (its value comes back as an :class:`Answer`)."""

    def __init__(self, engine: Engine, node: Any, run_id: str) -> None:
        self.engine = engine
        self.node = node  # the engine's key of the node
        self._run_id = run_id

    def _call(
        self, method: Callable[Concatenate[NodeCore, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> Answer[T]:
        assert not kwargs, "engines pass positional arguments only"
        return Answer(self.engine, self.engine.call(self.node, method.__name__, *args))

    def store_port(self) -> Answer[int]:
        return self._call(NodeCore.store_port, self._run_id)

    def missing_modules(self, names: list[str]) -> Answer[list[str]]:
        return self._call(NodeCore.missing_modules, names)

    def start(self, start: NodeStart, shared: Any) -> Answer[dict[int, int]]:
        """``shared``: the call's bytes as ``Engine.share`` made them (the node gets them)."""
        return self._call(NodeCore.start, start, shared)

    def poll(self, timeout: float) -> Answer[tuple[list[RankEvent], bool]]:
        return self._call(NodeCore.poll, self._run_id, timeout)

    def send_all(self, message: Any) -> Answer[None]:
        return self._call(NodeCore.send_all, self._run_id, message)

    def send_task(self, task: Task, shared: Any) -> Answer[None]:
        return self._call(NodeCore.send_task, self._run_id, task, shared)

    def set_output(self, mode: Output) -> Answer[None]:
        return self._call(NodeCore.set_output, self._run_id, mode)

    def stop(self) -> Answer[None]:
        return self._call(NodeCore.stop, self._run_id)
