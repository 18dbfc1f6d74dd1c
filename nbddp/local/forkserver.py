"""Pre-warmed ranks, the kernel's side: launch as fast as a fork, with spawn's safety.

A helper process (``helper.py``; its server half is ``worker/helper/server.py``) is started from
a fresh interpreter, never a fork of the kernel. It imports torch, the rank runtime and what a
first training step imports, never touches CUDA, and forks one brand-new rank per request.
Each rank is a fresh child: nothing of a previous launch is in it (module state, process
group, CUDA context), and it reseeds every random generator, so it differs from a cold start
only in not paying for its imports.

* The kernel's modules are mirrored into the helper (``mirror.py``): the ranks start with what
  the notebook imported, as a fork launcher's would, and with what the last launch's ranks
  imported. A module whose import makes forking unsafe (a thread, CUDA, a process) gets a
  fresh helper without it, and a warning at the next launch; ``NBDDP_PRELOAD_EXCLUDE`` names
  modules never to preload, ``NBDDP_PRELOAD=0`` mirrors nothing (``worker/helper/preload.py``).
* It goes away with the kernel: when the kernel's end of the socket closes (exit, restart,
  SIGKILL), the helper exits, and its ranks with it (``PR_SET_PDEATHSIG``). If it dies, the
  next launch starts a new helper (and one that died importing a module gets one without it).
* ``NBDDP_PREWARM=0`` turns it off (every launch starts cold).

Why not the stdlib's ``multiprocessing.forkserver``: its children inherit the server's
stdout/stderr (we need a pipe pair per rank), it cannot run a script as ``__main__``, and it
reaps its children (we need their status without reaping, so signalling a pid stays safe).

Non-goal: sharing anything between launches beyond the imported, unused modules.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings

from nbddp import interrupts
from nbddp.environment import WORKER_VARIABLE
from nbddp.errors import NbddpWarning
from nbddp.local.helper import Helper
from nbddp.local.mirror import Mirror, after_each_cell, in_a_notebook, kernel_path
from nbddp.local.processes import ColdStarter, Starter, WorkerProcess
from nbddp.worker.helper.preload import mirroring, user_excluded

READY_WAIT = 10.0  # seconds a launch waits for a starting helper before starting cold


def enabled() -> bool:
    return os.environ.get("NBDDP_PREWARM", "1") != "0" and WORKER_VARIABLE not in os.environ


class WarmStarter:
    """Starts ranks through the helper when it is ready, cold otherwise. ``mirror``: tell the
    helper what this process imports (the kernel's starter; a cluster node's does not).
    ``helper``: one this process made itself (a detached run's supervisor forks its own)."""

    def __init__(self, mirror: bool = False, helper: Helper | None = None) -> None:
        self._cold = ColdStarter()
        self._helper: Helper | None = helper
        self._mirror: Mirror | None = None
        self._mirroring = mirror
        self._lock = threading.Lock()
        self.excluded: dict[str, str] = {}  # module -> why the helper may not import it
        self._warned: set[str] = set()

    def prestart(self, wait: bool = False) -> None:
        """Start the helper in the background (cheap: one Popen), or a new one when it died or
        can no longer be used; then tell it what this process imported (``wait``: sent before
        returning, else from a thread)."""
        with interrupts.deferred(), self._lock:  # a helper is owned, or not started
            helper = self._helper
            if helper is None or not helper.usable():
                if helper is not None:
                    self._learn(helper)
                    helper.retire()
                self._helper = Helper(self.excluded)
                self._mirror = Mirror()
        self.mirror(wait)

    def _learn(self, helper: Helper) -> None:
        """Why the helper is replaced, as a module the next one must not import."""
        if helper.unsafe is not None:
            module, reason = helper.unsafe
        elif helper.importing is not None and (helper.hung or helper.crashed()):
            module = helper.importing
            reason = "the helper " + ("hung" if helper.hung else "crashed") + " importing it"
        else:
            return
        if module:
            self.excluded[module] = reason
        else:  # a thread started later, by some module: stop mirroring for this process
            self._mirroring = False
            self.excluded["the notebook's modules"] = reason

    def mirror(self, wait: bool = True) -> None:
        """Send the helper the modules this process imported since the last look."""
        helper, mirror = self._helper, self._mirror
        if not (self._mirroring and mirroring() and in_a_notebook()) or not (helper and mirror):
            return

        def send() -> None:
            with mirror.lock, contextlib.suppress(OSError):
                excluded = user_excluded() | set(self.excluded)  # the variable, as it is now
                names = mirror.new_modules(excluded)
                if names and helper.usable():
                    helper.preload(names, kernel_path(), sorted(excluded))

        if wait:
            send()
        else:
            threading.Thread(target=send, name="nbddp-mirror", daemon=True).start()

    @property
    def helper(self) -> Helper | None:
        return self._helper

    def warm_up(self) -> None:
        """Before a launch: a usable helper (started if there is none: the first launch of a
        script, or after one died), waited for (it imports torch once, about what one cold
        rank costs), and told what the kernel imported."""
        with contextlib.suppress(OSError):
            self.prestart()
        helper = self._helper
        if helper is not None:
            helper.ready.wait(READY_WAIT)
        self.mirror()  # after what a thread may be sending: this launch's ranks have it all
        for module, reason in self.excluded.items():
            if module not in self._warned:
                self._warned.add(module)
                warnings.warn(
                    f"nbddp's warm helper no longer preloads {module}: {reason}. The ranks "
                    f"import it themselves (NBDDP_PRELOAD_EXCLUDE={module} skips the attempt).",
                    NbddpWarning,
                    stacklevel=2,
                )

    def start(
        self, argv: list[str], env: dict[str, str], stdout: int, stderr: int
    ) -> WorkerProcess:
        helper = self._helper
        if helper is None or not helper.alive() or not helper.ready.is_set() or helper.hung:
            return self._cold.start(argv, env, stdout, stderr)  # warm_up() waited already
        try:
            return helper.spawn(argv, env, stdout, stderr)
        except OSError:
            with contextlib.suppress(OSError):
                self.prestart()
            return self._cold.start(argv, env, stdout, stderr)


_starter: WarmStarter | None = None


def warm_starter() -> WarmStarter:
    global _starter
    if _starter is None:
        _starter = WarmStarter(mirror=True)
    return _starter


def default_starter() -> Starter:
    """The pre-warmed starter unless NBDDP_PREWARM=0; it starts cold by itself whenever its
    helper is not there or not ready."""
    return warm_starter() if enabled() else ColdStarter()


def prestart() -> None:
    """Get the helper going now, so the first launch is fast already, and keep it told of the
    notebook's imports after each cell (a no-op when the pre-warmed start is turned off)."""
    if enabled():
        with contextlib.suppress(OSError):  # then launches start cold; nothing else changes
            warm_starter().prestart()
        after_each_cell(_after_cell)


def _after_cell() -> None:
    if enabled() and _starter is not None:
        with contextlib.suppress(OSError):
            _starter.prestart()  # a new helper if this cell's imports made the last unusable


def helper_pid() -> int | None:
    """The helper's pid, if one runs (tests and diagnostics)."""
    helper = _starter.helper if _starter is not None else None
    return helper.process.pid if helper is not None and helper.alive() else None


def wait_until_ready(timeout: float = 30.0) -> bool:
    helper = _starter.helper if _starter is not None else None
    deadline = time.monotonic() + timeout
    return helper is not None and helper.ready.wait(max(0.0, deadline - time.monotonic()))


def wait_until_preloaded(timeout: float = 60.0) -> bool:
    """Send the helper what this process imported, and wait until it imported all it was told
    (tests and benchmarks)."""
    if _starter is None or _starter.helper is None:
        return False
    _starter.mirror()
    helper = _starter.helper
    with contextlib.suppress(OSError):
        helper.preload([], kernel_path(), [])  # answered once nothing is left to import
    return helper.preloaded.wait(timeout) and helper.alive()
