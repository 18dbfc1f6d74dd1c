"""How a ``%%ddp`` cell's failure shows in the notebook: as a normal cell's would, without the
frames of IPython's and nbddp's own code (one of which would echo the whole cell).

Non-goal: a rank's error (``errors/``), which these wrap or stand beside.
"""

from __future__ import annotations

from nbddp.errors import NbddpError
from nbddp.errors.render import ipython_lines


class CellFailed(NbddpError):
    """The in-kernel cell raised; IPython already showed its traceback, so show nothing more
    (``_render_traceback_``), but still end the cell in error, as a normal cell would."""

    def _render_traceback_(self) -> list[str]:
        return []


class CellInterrupted(KeyboardInterrupt):
    """A ``%%ddp`` cell's interrupt, shown without its frames: IPython's first one would echo
    the whole cell, the others are nbddp's wait. Still a ``KeyboardInterrupt`` (so named)."""

    def _render_traceback_(self) -> list[str]:
        from IPython import get_ipython

        return ipython_lines(get_ipython(), KeyboardInterrupt, self, None)


CellInterrupted.__name__ = CellInterrupted.__qualname__ = "KeyboardInterrupt"


def interrupted(interrupt: KeyboardInterrupt) -> KeyboardInterrupt:
    shown = CellInterrupted(*interrupt.args)
    shown.__dict__.update(vars(interrupt))  # e.g. the roll-call of a stalled run (stacks)
    return shown


class CellSyntaxError(NbddpError):
    """The cell does not parse. Shown as IPython shows a cell's own syntax error (``Cell
    In[n], line m``, the line and its caret), without IPython's and nbddp's frames, one of
    which would echo the whole cell."""

    def __init__(self, error: SyntaxError) -> None:
        self.error = error
        super().__init__(f"{type(error).__name__}: {error.msg} (line {error.lineno})")

    def _render_traceback_(self) -> list[str]:
        from IPython import get_ipython

        shell = get_ipython()
        lines: list[str] = shell.SyntaxTB.structured_traceback(type(self.error), self.error, [])
        return lines
