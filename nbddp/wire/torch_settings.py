"""The kernel's torch settings, carried to every rank with the call, as a fork launcher's
children inherit them: the default dtype and device, ``torch.set_float32_matmul_precision``,
the TF32, reduced-precision and cuDNN flags, the scaled-dot-product attention backends,
deterministic algorithms, and the random state.

A notebook sets these in a cell (``torch.set_float32_matmul_precision("high")``, which
Lightning's own warning asks for; ``torch.backends.cudnn.benchmark = True``) and a one-rank run
in the kernel uses them; fresh rank processes would start from torch's defaults, and a 2-GPU run
without TF32 can be several times slower than the same code on one GPU. So the kernel takes a
:func:`snapshot` when the call is pickled, and each rank :func:`apply`-s it after its device is
set and before ``fn`` starts. Only what differs from the rank's own value is set, through the
API the kernel used (torch raises when a program reads the legacy TF32 flag after mixing it with
the ``fp32_precision`` one, so a setting made with the legacy API is carried with that API).

The random state is what a forked child has: torch's CPU generator and NumPy's global generator
(when the notebook imported NumPy) as the kernel's are when the call is made, on every rank
alike, so every rank draws the same numbers until it seeds; Python's ``random`` is not carried,
as Python reseeds it in every forked child. "Only where ``fn`` does not seed itself" therefore
needs no look at ``fn``: a function that seeds (``torch.manual_seed``, ``np.random.seed``,
``transformers.set_seed``, Lightning's ``seed_everything``) replaces the carried state from that
line on, as it would under a fork launcher. torch's state travels only when it is not the state
every process starts with (about 5 KB). A session's ranks keep their own streams between tasks:
the random state travels with a launch and with a session's first call only (``random=False``).
CUDA generators are not carried (a forked child cannot use its parent's CUDA state either);
``torch.manual_seed`` seeds them on the rank.

Non-goal: settings of other libraries (NumPy's print options, ``torch.set_printoptions``), and
anything a rank's code sets for itself.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

# Flags read and set as attributes of torch's modules: (module path, attribute). The legacy TF32
# flags come before the fp32_precision ones, so that a kernel that used only the legacy API
# needs no fp32_precision set on the rank (torch derives it).
_FLAGS = (
    ("torch.backends.cuda.matmul", "allow_tf32"),
    ("torch.backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("torch.backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
    ("torch.backends.cudnn", "enabled"),
    ("torch.backends.cudnn", "benchmark"),
    ("torch.backends.cudnn", "deterministic"),
    ("torch.backends.cudnn", "allow_tf32"),
    ("torch.backends", "fp32_precision"),
    ("torch.backends.cuda.matmul", "fp32_precision"),
    ("torch.backends.cudnn", "fp32_precision"),
    ("torch.backends.cudnn.conv", "fp32_precision"),
    ("torch.backends.cudnn.rnn", "fp32_precision"),
    ("torch.backends.mkldnn", "enabled"),
)
# Scaled-dot-product attention backends: (getter, setter) in torch.backends.cuda.
_SDP = (
    ("flash_sdp_enabled", "enable_flash_sdp"),
    ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    ("math_sdp_enabled", "enable_math_sdp"),
    ("cudnn_sdp_enabled", "enable_cudnn_sdp"),
)

Settings = dict[str, Any]


def snapshot(random: bool = True) -> Settings:
    """The kernel's settings now (empty when the kernel never imported torch: nothing to
    carry). ``random``: the random state too."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    settings: Settings = {}
    with _quiet():
        _read(settings, "matmul_precision", torch.get_float32_matmul_precision)
        _read(settings, "dtype", torch.get_default_dtype)
        _read(settings, "device", lambda: torch.get_default_device().type)
        _read(settings, "deterministic", torch.are_deterministic_algorithms_enabled)
        _read(settings, "warn_only", torch.is_deterministic_algorithms_warn_only_enabled)
        for path, name in _FLAGS:
            _read(settings, f"{path}.{name}", lambda p=path, n=name: getattr(_module(p), n))
        for getter, _ in _SDP:
            _read(settings, f"sdp.{getter}", lambda g=getter: getattr(torch.backends.cuda, g)())
        if random:
            settings["random"] = _random_state(torch)
    return settings


def apply(settings: Settings, device: Any = None) -> None:
    """Make this process's settings the kernel's (``device``: this rank's own, which a kernel
    whose default device is a GPU gives as the default here)."""
    if not settings:
        return
    import torch

    with _quiet():
        if "matmul_precision" in settings:
            _set(
                torch.get_float32_matmul_precision,
                torch.set_float32_matmul_precision,
                settings["matmul_precision"],
            )
        if "dtype" in settings:
            _set(torch.get_default_dtype, torch.set_default_dtype, settings["dtype"])
        _apply_device(torch, settings.get("device"), device)
        if "deterministic" in settings:
            wanted = (settings["deterministic"], settings.get("warn_only", False))
            current = (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            )
            if wanted != current:
                torch.use_deterministic_algorithms(wanted[0], warn_only=wanted[1])
        for path, name in _FLAGS:
            key = f"{path}.{name}"
            if key in settings:
                module = _module(path)
                _set(
                    lambda m=module, n=name: getattr(m, n),
                    lambda v, m=module, n=name: setattr(m, n, v),
                    settings[key],
                )
        for getter, setter in _SDP:
            if f"sdp.{getter}" in settings:
                _set(
                    lambda g=getter: getattr(torch.backends.cuda, g)(),
                    lambda v, s=setter: getattr(torch.backends.cuda, s)(v),
                    settings[f"sdp.{getter}"],
                )
        if "random" in settings:
            _set_random_state(torch, settings["random"])


def _apply_device(torch: Any, kind: str | None, device: Any) -> None:
    """The kernel's default device type, on this rank: a GPU default is this rank's own GPU
    (a rank without one keeps the CPU)."""
    if kind is None or kind == torch.get_default_device().type:
        return
    if kind == "cuda":
        if device is not None and getattr(device, "type", None) == "cuda":
            torch.set_default_device(device)
        return
    with contextlib.suppress(Exception):
        torch.set_default_device(kind)


def _random_state(torch: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    generator = torch.get_rng_state()
    if not torch.equal(generator, _initial_state(torch)):
        state["torch"] = generator
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            state["numpy"] = numpy.random.get_state()
    return state


def _initial_state(torch: Any) -> Any:
    """The state torch's CPU generator has in every process that has not used it."""
    global _initial
    if _initial is None:
        _initial = torch.Generator().get_state()
    return _initial


_initial: Any = None


def _set_random_state(torch: Any, state: dict[str, Any]) -> None:
    if "torch" in state:
        with contextlib.suppress(Exception):
            torch.set_rng_state(state["torch"])
    if "numpy" in state:
        with contextlib.suppress(Exception):
            import numpy

            numpy.random.set_state(state["numpy"])


def _module(path: str) -> Any:
    """``torch.backends.cudnn`` and the like: torch's module-like objects, by attribute."""
    obj: Any = sys.modules["torch"]
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _read(settings: Settings, key: str, getter: Any) -> None:
    """``settings[key] = getter()``, unless this torch lacks it or refuses to say (the legacy
    TF32 flag raises once the kernel mixed it with the new API: then the new one is carried)."""
    try:
        value = getter()
    except Exception:
        return
    if isinstance(value, (bool, int, float, str)) or type(value).__name__ == "dtype":
        settings[key] = value


def _set(getter: Any, setter: Any, value: Any) -> None:
    """``setter(value)`` where it differs from ``getter()`` (a rank's torch may lack one)."""
    try:
        if getter() == value:
            return
    except Exception:
        pass
    with contextlib.suppress(Exception):
        setter(value)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch warns about the TF32 API it prefers: the user's choice, not ours to report."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
