"""``pickle.loads`` for what crosses the wire, finished as ``torch.load`` finishes its own.

Unpickling a sparse tensor puts it on a list in torch (``torch._utils``) that only
``torch.load`` empties, after checking the tensors on it. A result, a call or a message that
carried a sparse tensor so left it there: held for as long as the process lives, and checked by
the kernel's next ``torch.load(weights_only=True)``, which then warns about a tensor it never
loaded (stop 47's CI: a restore in the kernel failed under ``-W error``). Each load here empties
the list as ``torch.load`` does (checking the tensors when the user turned torch's sparse
invariant checks on).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any


def loads(data: Any, buffers: Any = None) -> Any:
    try:
        return pickle.loads(data, buffers=buffers)
    finally:
        _settle_sparse_tensors()


def _settle_sparse_tensors() -> None:
    torch = sys.modules.get("torch")
    pending = getattr(getattr(torch, "_utils", None), "_sparse_tensors_to_validate", None)
    if pending:
        torch._utils._validate_loaded_sparse_tensors()  # type: ignore[union-attr]
