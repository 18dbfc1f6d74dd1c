"""F3: the timeouts Accelerate (so the HF Trainer's ``ddp_timeout``) and Lightning ask for
reach the collective watch, although both skip ``init_process_group`` in a rank whose group
nbddp already made (``worker/libraries/timeouts.py``)."""

from __future__ import annotations

import inspect
import sys
import types
import typing
from datetime import timedelta

import pytest

from nbddp.worker.diagnosis import collective_watch
from nbddp.worker.libraries import timeouts

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def nothing_asked():
    collective_watch.stop()
    yield
    collective_watch.stop()


def test_f3_accelerates_partial_state_timeout_is_asked():
    """F3: ``InitProcessGroupKwargs(timeout=)`` and ``TrainingArguments(ddp_timeout=)`` both
    reach ``PartialState(timeout=...)``."""
    made = []

    class PartialState:
        _shared_state: typing.ClassVar[dict] = {}

        def __init__(self, cpu=False, **kwargs):
            made.append(kwargs)
            type(self)._shared_state["made"] = True

    module = types.SimpleNamespace(PartialState=PartialState)
    timeouts.patch_accelerate_state(module)  # type: ignore[arg-type]
    timeouts.patch_accelerate_state(module)  # once only
    PartialState(timeout=timedelta(seconds=1800))
    assert collective_watch.asked() == 1800.0 and made == [{"timeout": timedelta(seconds=1800)}]
    PartialState(timeout=timedelta(seconds=5))  # the shared state exists: torch's rule
    assert collective_watch.asked() == 1800.0


def test_f3_lightnings_strategy_timeout_is_asked_also_where_it_was_imported_by_name(monkeypatch):
    calls = []

    def _init_dist_connection(env, backend, global_rank=None, world_size=None, **kwargs):
        calls.append(kwargs)

    fabric = types.ModuleType("lightning_fabric.utilities.distributed")
    fabric._init_dist_connection = _init_dist_connection  # type: ignore[attr-defined]
    strategy = types.ModuleType("lightning.pytorch.strategies.ddp")
    strategy._init_dist_connection = _init_dist_connection  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning.pytorch.strategies.ddp", strategy)
    timeouts.patch_lightning_distributed(fabric)
    strategy._init_dist_connection(None, "gloo", timeout=timedelta(minutes=3))
    assert collective_watch.asked() == 180.0 and calls == [{"timeout": timedelta(minutes=3)}]


def test_the_hooked_places_are_where_the_installed_libraries_take_their_timeout():
    """The hooks stand on the libraries as they are: if a release moves the timeout, this
    says so first."""
    accelerate_state = pytest.importorskip("accelerate.state")
    state_source = inspect.getsource(accelerate_state)
    assert "init_process_group(backend=self.backend, **kwargs)" in state_source
    assert "PartialState(cpu, **kwargs)" in state_source  # Accelerator's InitProcessGroupKwargs
    training_args = pytest.importorskip("transformers.training_args")
    assert 'accelerator_state_kwargs["timeout"]' in inspect.getsource(training_args)
    for package in ("lightning.pytorch", "pytorch_lightning"):
        ddp = pytest.importorskip(f"{package}.strategies.ddp")
        assert ddp._init_dist_connection.__module__ in timeouts.LIGHTNING_DISTRIBUTED
        assert '"timeout": self._timeout' in inspect.getsource(ddp.DDPStrategy.setup_distributed)
