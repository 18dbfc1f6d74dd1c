"""The wire's messages: the job spec survives its file, every message pickles to a few bytes
and comes back equal, and the documented protocol names every message there is."""

from __future__ import annotations

import ast
import pickle
import typing
from pathlib import Path

import pytest

import nbddp
from nbddp.wire import messages, prompts
from nbddp.wire.spec import JobSpec

pytestmark = pytest.mark.unit

PACKAGE = Path(nbddp.__file__).parent
# Modules holding the messages of another connection (each says so in its docstring): the
# kernel and its warm helper; a detached run's supervisor and its kernels; the kernel and a
# Slurm node's helper. Whatever else travels is the rank wire's.
OTHER_WIRES = {"nbddp.wire.helper", "nbddp.detached.link", "nbddp.clusters.slurm.messages"}
# A call that sends what it is given: conn.send(X(...)), self._send, send_all, _broadcast, _tell,
# ask.
SENDS = ("send", "broadcast", "tell", "ask")


def test_the_job_spec_comes_back_from_its_file_as_it_was_written():
    spec = JobSpec(
        address="/tmp/x/channel.sock",
        authkey="ab" * 16,
        run_id="nbddp-1-abcd",
        sys_path=("/a", "/b"),
        cwd="/work",
        device="cpu",
        device_index=(0, 0),
        backend="gloo",
        return_all=True,
        output="all",
        logging=(20, "%(message)s", None),
        session=True,
    )
    assert JobSpec.from_json(spec.to_json()) == spec


def message_classes() -> list[type]:
    return list(typing.get_args(messages.Message))


def travelling() -> dict[tuple[str, str], str]:
    """Every NamedTuple class some module of nbddp sends, read from the source of each module
    of the package wherever it is (``conn.send(Hello(rank))`` sends ``Hello``): (its module,
    its name) -> a module that sends it."""
    modules = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        ): ast.parse(path.read_text())
        for path in PACKAGE.rglob("*.py")
    }
    named_tuples = {
        (module, node.name)
        for module, tree in modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).endswith("NamedTuple") for base in node.bases)
    }
    found = {}
    for module, tree in modules.items():
        imported = {
            alias.asname or alias.name: node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func).rpartition(".")[2].lstrip("_").startswith(SENDS)
                and node.args
                and isinstance(node.args[0], ast.Call)
                and isinstance(node.args[0].func, ast.Name)
            ):
                name = node.args[0].func.id
                key = (imported.get(name, module), name)
                if key in named_tuples:
                    found.setdefault(key, module)
    return found


def test_every_message_pickles_small_and_comes_back_equal():
    for cls in message_classes():
        fields = {name: ann for name, ann in cls.__annotations__.items() if name in cls._fields}
        sample = cls(*[_sample(ann) for ann in fields.values()])
        data = pickle.dumps(sample, protocol=5)
        assert pickle.loads(data) == sample, cls
        assert len(data) < 400, (cls, len(data))


def _sample(annotation: object) -> object:
    annotation = getattr(annotation, "__forward_arg__", annotation)  # NamedTuple's ForwardRef
    assert isinstance(annotation, str)
    for prefix, value in (
        ("int", 1), ("float", 0.5), ("str", "x"), ("bytes", b"x"), ("bool", True),
        ("list", []), ("tuple", ()), ("dict", {}), ("frozenset", frozenset()),
    ):  # fmt: skip
        if annotation.startswith(prefix):
            return value
    return None


def test_the_protocol_docstring_names_every_message_of_the_rank_wire():
    """``Message`` is the union of what a rank and the kernel exchange; the module's docstring
    is the protocol's one drawing, so each of them is in it."""
    union = typing.get_args(messages.Message)
    assert len(union) >= 16
    missing = [cls.__name__ for cls in union if cls.__name__ not in (messages.__doc__ or "")]
    assert not missing, f"draw these in wire/messages.py's docstring: {missing}"


def test_the_prompts_docstring_draws_each_of_its_messages():
    drawn = [cls.__name__ for cls in message_classes() if cls.__module__ == prompts.__name__]
    assert len(drawn) == 5
    assert all(f"    {name}(" in (prompts.__doc__ or "") for name in drawn)


def test_every_message_of_the_rank_wire_is_in_the_union():
    """What a rank and the kernel exchange, wherever its class is defined and sent from, is
    one ``Message``: every module of nbddp is read for what it sends."""
    union = {(cls.__module__, cls.__name__) for cls in typing.get_args(messages.Message)}
    sent = travelling()
    assert sent.keys() & union, "the scan finds no message sent: does it still read sends?"
    missing = sorted(
        f"{module}.{name} (sent in {where})"
        for (module, name), where in sent.items()
        if (module, name) not in union and module not in OTHER_WIRES
    )
    assert not missing, f"add to wire/messages.py's Message (or name its own wire): {missing}"
