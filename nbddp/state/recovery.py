"""What the panel says of stopping well: a graceful stop under way, each restart and its
cause, and where the checkpoints go (the directory the next launch resumes from)."""

from __future__ import annotations

import os
import time


class Recovery:
    """A run's stopping-well lines; kept by the run's state, under its lock."""

    def __init__(self) -> None:
        self.stopping = ""  # by what a graceful stop was asked ("" none)
        self._restarts: list[str] = []
        self._directory = ""
        self._last = ""  # the last checkpoint, said

    def checkpoint(self, step: int, path: str, seconds: float, restored: bool) -> None:
        self._directory = os.path.dirname(path)
        if restored:
            self._last = f"resumed from step {step}"
        else:
            self._last = f"last: step {step} ({seconds:.2g} s to save)"

    def restarted(self, attempt: int, of: int, cause: str) -> None:
        at = time.strftime("%H:%M:%S")
        self._restarts.append(f"restart {attempt} of {of} at {at}, after: {cause}")

    def lines(self, ended: bool) -> tuple[str, ...]:
        shown = []
        if self.stopping and not ended:
            shown.append(
                f"stopping gracefully ({self.stopping}): every rank ends at the same step "
                "boundary; stop again to end at once"
            )
        shown += self._restarts
        if self._directory:
            shown.append(f"checkpoints: {_short(self._directory)} · {self._last}")
        return tuple(shown)


def _short(path: str) -> str:
    """The directory as the user would write it: relative to the working directory when
    inside it."""
    here = os.getcwd()
    if path.startswith(here + os.sep):
        return "./" + os.path.relpath(path, here)
    return path
