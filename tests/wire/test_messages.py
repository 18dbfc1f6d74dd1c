"""The wire's messages: the job spec survives its file, every message pickles to a few bytes
and comes back equal, and the documented protocol names every message there is."""

from __future__ import annotations

import inspect
import pickle
import typing

from nbddp.wire import messages, prompts, stacks, stopping
from nbddp.wire.spec import JobSpec


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
    return [
        cls
        for module in (messages, prompts, stopping)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and issubclass(cls, tuple) and cls is not tuple
    ]


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
    """What a rank and the kernel exchange, wherever its class is defined (``prompts.py`` and
    ``stopping.py`` hold nothing else; the roll-call's two are in ``stacks.py``), is one
    ``Message``."""
    union = set(typing.get_args(messages.Message))
    elsewhere = [cls for cls in message_classes() if cls.__module__ != messages.__name__]
    assert len(elsewhere) == 11
    missing = {*elsewhere, stacks.AskStacks, stacks.RankStacks} - union
    assert not missing, sorted(cls.__name__ for cls in missing)
