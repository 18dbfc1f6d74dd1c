"""F7: the kernel's torch settings are the ranks' when ``fn`` starts (``wire/torch_settings.py``):
taken in one process, given to a process at torch's defaults, read back equal."""

from __future__ import annotations

import random

import pytest
import torch

from nbddp.wire import torch_settings

pytestmark = pytest.mark.unit


@pytest.fixture
def defaults():
    """Every test starts and ends at torch's defaults (this process is the 'rank' too)."""
    saved = torch_settings.snapshot()
    yield
    _reset()
    torch_settings.apply(saved)


def _reset() -> None:
    with torch_settings._quiet():
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_default_dtype(torch.float32)
        torch.set_default_device("cpu")
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.allow_tf32 = True


def _observed() -> tuple:
    with torch_settings._quiet():
        return (
            torch.get_float32_matmul_precision(),
            torch.get_default_dtype(),
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.allow_tf32,
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cuda.matmul.fp32_precision,
        )


def test_f7_the_notebooks_settings_come_back_on_a_process_at_the_defaults(defaults):
    """F7: set in the kernel, carried, applied on a process at torch's defaults: equal."""
    torch.set_float32_matmul_precision("high")
    torch.set_default_dtype(torch.float64)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    kernel = _observed()
    settings = torch_settings.snapshot()
    _reset()
    assert _observed() != kernel
    torch_settings.apply(settings)
    assert _observed() == kernel


def test_the_new_tf32_api_is_carried_without_mixing_apis(defaults):
    """torch raises on a read of the legacy flag once the two APIs were mixed: a kernel that
    used the new one is carried with it, and reading back raises nothing."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    settings = torch_settings.snapshot()
    _reset()
    torch_settings.apply(settings)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"


def test_a_gpu_default_device_is_the_ranks_own_gpu_and_a_cpu_rank_keeps_the_cpu(defaults):
    settings = {**torch_settings.snapshot(random=False), "device": "cuda"}
    torch_settings.apply(settings, torch.device("cpu"))  # a gloo rank without a GPU
    assert torch.get_default_device() == torch.device("cpu")
    torch_settings.apply({**settings, "device": "meta"}, torch.device("cpu"))
    assert torch.get_default_device().type == "meta"


def test_the_random_state_is_the_kernels_until_fn_seeds_as_after_a_fork(defaults):
    """torch's and NumPy's generators as the kernel left them; Python's ``random`` is not
    carried (Python reseeds it in a forked child)."""
    numpy = pytest.importorskip("numpy")
    torch.manual_seed(3)
    numpy.random.seed(3)
    random.seed(3)
    settings = torch_settings.snapshot()
    expected = (torch.rand(2).tolist(), numpy.random.rand())
    torch.manual_seed(99)
    numpy.random.seed(99)
    random.seed(99)
    torch_settings.apply(settings)
    assert (torch.rand(2).tolist(), numpy.random.rand()) == expected
    assert random.random() == random.Random(99).random()  # its own, untouched
    torch_settings.apply(settings)
    torch.manual_seed(7)  # fn seeds itself: its own numbers from here on, as after a fork
    assert torch.rand(1).item() == torch.rand(1, generator=torch.Generator().manual_seed(7)).item()
    assert torch_settings.snapshot(random=False).get("random") is None


def test_torchs_state_travels_only_when_used(defaults):
    torch.manual_seed(67280421310721)  # torch's own default seed: the state of a fresh process
    assert "torch" not in torch_settings.snapshot()["random"]
    torch.rand(1)
    assert "torch" in torch_settings.snapshot()["random"]


def test_a_kernel_without_torch_carries_nothing(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "torch")
    assert torch_settings.snapshot() == {}


def test_an_older_torch_without_a_setting_skips_it_on_both_ends(defaults, monkeypatch):
    """torch 2.2 (our oldest) has no cuDNN attention backend: the kernel's snapshot skips it,
    and a rank whose torch lacks it ignores a snapshot that carries it."""
    settings = torch_settings.snapshot()
    assert "sdp.cudnn_sdp_enabled" in settings
    monkeypatch.delattr(torch.backends.cuda, "cudnn_sdp_enabled")
    monkeypatch.delattr(torch.backends.cuda, "enable_cudnn_sdp")
    older = torch_settings.snapshot()
    assert "sdp.cudnn_sdp_enabled" not in older
    assert older["sdp.flash_sdp_enabled"] == settings["sdp.flash_sdp_enabled"]
    torch_settings.apply(
        {**settings, "sdp.cudnn_sdp_enabled": not settings["sdp.cudnn_sdp_enabled"]}
    )
