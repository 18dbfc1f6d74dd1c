"""``Session.run_script``: a script as it is, run on a session's ranks as one of its tasks.

The script is checked and read as for ``nbddp.run_script`` (``nbddp/scripts.py``); on the rank
it runs in a fresh ``__main__``, with the modules an earlier run imported imported anew, and
the rank's own ``__main__``, ``sys.argv`` and ``sys.path`` back afterwards
(``worker/rank/scripts.py``). Its ``sys.exit()`` ends the task, never the rank.

Non-goal: the session's namespace: a script does not read or write it (a ``%%ddp --session``
cell or ``session.run`` does).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from nbddp.plan import STALL_AFTER
from nbddp.recovery import STOP_GRACE
from nbddp.scripts import script_main
from nbddp.wire.call import dumps_call

if TYPE_CHECKING:
    from nbddp.sessions.session import Session


class ScriptRuns:
    """What ``Session`` gains from this module: ``run_script``."""

    def run_script(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        module: bool = False,
        timeout: float | None = None,
        block: bool = True,
        display: str = "auto",
        output: str = "rank0",
        stall_after: float | None = STALL_AFTER,
        debug: bool = False,
        stop_grace: float = STOP_GRACE,
    ) -> Any:
        """Run a script as it is on the session's ranks, as [nbddp.run_script][] does.

        Each rank runs ``script`` as ``__main__`` with ``sys.argv = [script, *args]``; the
        script's module state is fresh each time (the modules an earlier run imported, and
        those edited since, are imported anew), and its ``sys.exit()`` ends the task, not the
        rank. The session's namespace is not the script's. The options are
        [nbddp.Session.run][]'s.

        Returns:
            0 once every rank's script ended with code 0 (a running [nbddp.Run][] with
                ``block=False``).

        Raises:
            ValueError: A missing script or module, an argument that is not a string (before
                the task starts).
            nbddp.WorkerError: A rank raised, or exited with a non-zero code (``.exitcode``).
        """
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        main = script_main(script, args, module, session=True)
        session = cast("Session", self)
        plan = session._options(
            timeout, display, output, False, block, stall_after, debug, stop_grace
        )
        ranks = session._ready_ranks()
        call = dumps_call(main, (), {}, segment=session._plan.cluster is None)
        return session._run("function", call, plan, ranks)
