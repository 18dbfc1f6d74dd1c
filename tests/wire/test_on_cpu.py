"""F14: what a one-rank run in the kernel returns comes back on the CPU, as a multi-rank run's
does (``wire/on_cpu.py``), checked with tensors that say they are on a GPU."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch

from nbddp.wire.on_cpu import to_cpu

pytestmark = pytest.mark.unit


class OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a GPU (its ``.cpu()`` is the real move)."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)

    def cpu(self, *args, **kwargs):  # type: ignore[override]
        return torch.Tensor(self.as_subclass(torch.Tensor)).clone()

    def detach(self):  # type: ignore[override]
        return self


def on_gpu(*values: float) -> torch.Tensor:
    return torch.tensor(values).as_subclass(OnGpu)


def moved(tensor) -> bool:
    return type(tensor) is torch.Tensor and tensor.device.type == "cpu"


class Pair(NamedTuple):
    loss: torch.Tensor
    step: int


@dataclasses.dataclass(frozen=True)
class Output:
    logits: torch.Tensor
    note: str = "x"


def test_f14_state_dicts_namedtuples_and_dataclasses_come_back_on_the_cpu():
    """F14: only exact dicts, lists and tuples were walked: ``state_dict()`` (an OrderedDict),
    namedtuples, dataclasses and HF's ModelOutput came back on the GPU."""
    state = collections.OrderedDict(weight=on_gpu(1.0), bias=on_gpu(2.0))
    back = to_cpu(state)
    assert type(back) is collections.OrderedDict and list(back) == ["weight", "bias"]
    assert all(moved(t) for t in back.values())
    pair = to_cpu(Pair(on_gpu(3.0), 7))
    assert type(pair) is Pair and moved(pair.loss) and pair.step == 7
    output = to_cpu(Output(on_gpu(4.0)))
    assert type(output) is Output and moved(output.logits) and output.note == "x"
    nested = to_cpu({"history": [Pair(on_gpu(5.0), 1)], "d": collections.defaultdict(list)})
    assert moved(nested["history"][0].loss)


def test_f14_a_model_on_a_gpu_comes_back_as_a_cpu_copy_and_the_users_stays(monkeypatch):
    """F14: ``value.cpu()`` moved the user's live model to the CPU (its optimizer's state
    stayed on the GPU)."""
    model = torch.nn.Linear(2, 1)
    model.weight = torch.nn.Parameter(on_gpu(1.0, 2.0).reshape(1, 2))
    back = to_cpu(model)
    assert back is not model and isinstance(back, torch.nn.Linear)
    assert isinstance(back.weight, torch.nn.Parameter) and type(back.weight.data) is torch.Tensor
    assert isinstance(model.weight.data, OnGpu)  # the user's own is where it was


def test_what_is_on_the_cpu_already_is_returned_as_it_is():
    state = collections.OrderedDict(weight=torch.ones(2))
    model = torch.nn.Linear(2, 1)
    assert to_cpu(state) is state and to_cpu(model) is model
    loop: list = [torch.ones(1)]
    loop.append(loop)
    assert to_cpu(loop) is loop
