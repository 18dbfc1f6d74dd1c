"""Starting a detached run's supervisor, the kernel's side: make it, hand it the launch, wait
until its ranks started (or it says why they could not).

A supervisor is forked by the kernel's pre-warmed helper when it is ready (torch is then
imported already, and the supervisor's own helper, forked from it, is ready at once), or else
started as a fresh interpreter that forks itself away from the kernel. Either way it leaves
the kernel's process tree before it runs any of a launch (``worker/helper/leaving.py``), imports
what supervising needs, forks its helper, says it stands by, and waits for a launch on its
link: the pickled call with the descriptors of its shared memory (captured tensors are not
copied again), the run's directory, and the run's lock, held from the directory's first
instant.

Getting there takes a few hundred milliseconds (imports, two forks), far more than a warm
attached launch. So after a detached launch the kernel starts the next supervisor in the
background (:class:`Standby`): the next detached launch hands its run to one that already
stands by, and costs what an attached launch costs. A supervisor standing by ends when its
kernel does (its link closes); it holds no run, no rank, no GPU.

Non-goal: what the supervisor does (``supervisor.py``).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading

from nbddp.detached import store
from nbddp.detached.link import Handoff, Launched, LaunchFailed, StandingBy
from nbddp.detached.outcome import decode_error
from nbddp.environment import without_launchers
from nbddp.errors import NbddpError
from nbddp.local.forkserver import enabled, warm_starter
from nbddp.wire.frames import Connection

START_WAIT = 120.0  # seconds until the ranks started (a cold supervisor imports torch first)
SCRIPT = ".supervisor.py"  # in the runs directory: the same for every run
STANDBY_LOG = ".standby.log"  # what a supervisor says before it has a run (then: its run's)
_SCRIPT = """\
# Written by nbddp: the script of detached runs' supervisors (see nbddp/detached/).
if __name__ == "__main__":
    import os
    import sys

    sys.path.append({package_parent!r})
    link = int(sys.argv[1])
    if sys.argv[2:] == ["cold"]:  # started by the kernel itself: leave its tree
        if os.fork():
            os._exit(0)
        os.setsid()
    helper = None
    if os.environ.get("NBDDP_PREWARM", "1") != "0":  # a helper of its own, before any thread
        from nbddp.worker.helper.own_helper import fork_server

        helper = fork_server(keep=(link,))
    from nbddp.detached.supervisor import main

    os._exit(main(link, helper))
"""


def script_path() -> str:
    """The supervisors' script, (re)written when it is not this nbddp's."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = _SCRIPT.format(package_parent=package_parent)
    path = os.path.join(store.runs_root(), SCRIPT)
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except OSError:
        pass
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(temporary, path)
    return path


def start_supervisor(
    run: store.StoredRun, lock: int, handoff: Handoff, fds: list[int]
) -> tuple[Connection, Launched]:
    """Hand the launch to a supervisor standing by, or to one started now (``fds``: the call's
    shared memory); its link and its answer once the ranks started. Raises the launch's error
    if they could not."""
    conn = standby.take()
    if conn is None:
        conn, _ = _stand_by(run.join("supervisor.log"))
    try:
        conn.send(handoff, fds=[lock, *fds])
        reply = conn.recv(timeout=START_WAIT).message
    except (EOFError, OSError) as exc:
        conn.close()
        raise NbddpError(
            f"the detached run's supervisor did not start ({exc}); what it said is in "
            f"{run.join('supervisor.log')}."
        ) from None
    finally:
        standby.prepare()  # the next detached launch's, in the background
    if isinstance(reply, LaunchFailed):
        conn.close()
        raise decode_error(reply.error)
    if not isinstance(reply, Launched):
        conn.close()
        raise NbddpError(f"the detached run's supervisor answered {reply!r}; see {run.path}.")
    return conn, reply


def _stand_by(log_path: str) -> tuple[Connection, bool]:
    """A supervisor, started and standing by: its link, and whether it was forked warm.
    Raises NbddpError if it cannot start."""
    env = without_launchers(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    script = script_path()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        conn, warm = _started(script, env, log)
    finally:
        os.close(log)
    try:
        ready = conn.recv(timeout=START_WAIT).message
    except (EOFError, OSError) as exc:
        conn.close()
        raise NbddpError(
            f"a detached run's supervisor did not start ({exc}); see {log_path}."
        ) from None
    if not isinstance(ready, StandingBy):
        conn.close()
        raise NbddpError(f"a detached run's supervisor said {ready!r}; see {log_path}.")
    return conn, warm


def _started(script: str, env: dict[str, str], log: int) -> tuple[Connection, bool]:
    """The link to a supervisor forked warm, or else started cold. Each try has a socket
    pair of its own: a warm one that comes late finds its link closed and exits."""
    for warm in (True, False):
        if warm and not enabled():
            continue
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if warm:
                started = _forked_warm(script, env, [log, log, theirs.fileno()])
            else:
                _start_cold(script, env, log, theirs)
                started = True
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if started:
            return Connection(ours), warm
        ours.close()
    raise AssertionError("not reached: the cold start raises or starts")


def _forked_warm(script: str, env: dict[str, str], fds: list[int]) -> bool:
    helper = warm_starter().helper  # the caller waited for it (warm_up), interruptibly
    if helper is None or not helper.alive() or not helper.ready.is_set():
        return False
    try:
        helper.spawn_detached([script], env, fds)
    except OSError:
        return False
    return True


def _start_cold(script: str, env: dict[str, str], log: int, link: socket.socket) -> None:
    """A fresh interpreter that forks the supervisor and exits at once (reaped here)."""
    process = subprocess.Popen(
        [sys.executable, script, str(link.fileno()), "cold"],
        pass_fds=[link.fileno()],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    process.wait()


class Standby:
    """At most one supervisor standing by for this kernel's next detached launch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._warm = False  # whether it was forked by the pre-warmed helper
        self._preparing: threading.Thread | None = None
        self._discarded = False

    def take(self) -> Connection | None:
        """The link to the supervisor standing by (now this launch's), if one is alive and
        was started as this launch would start one (warm, or cold with NBDDP_PREWARM=0)."""
        with self._lock:
            conn, self._conn = self._conn, None
            warm = self._warm
        if conn is None:
            return None
        if warm != enabled():
            conn.close()
            return None
        readable, _, _ = select.select([conn], [], [], 0)
        if readable:  # its end closed (it died): not usable
            conn.close()
            return None
        return conn

    def prepare(self) -> None:
        """Start one in the background, unless one stands by or is starting."""
        with self._lock:
            if self._conn is not None or self._preparing is not None:
                return
            self._preparing = threading.Thread(
                target=self._prepare, name="nbddp-standby", daemon=True
            )
            self._preparing.start()

    def _prepare(self) -> None:
        conn, warm = None, False
        with contextlib.suppress(NbddpError, OSError, ValueError):  # the next launch then
            conn, warm = _stand_by(os.path.join(store.runs_root(), STANDBY_LOG))  # starts one
        with self._lock:
            self._preparing = None
            if conn is not None and self._conn is None and not self._discarded:
                self._conn, self._warm, conn = conn, warm, None
        if conn is not None:
            conn.close()

    def discard(self) -> None:
        """End the supervisor standing by (it exits when its link closes), and one that is
        starting; later launches start one again."""
        with self._lock:
            conn, self._conn = self._conn, None
            preparing = self._preparing
            self._discarded = True
        if preparing is not None:
            preparing.join()
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()
        with self._lock:
            self._discarded = False


standby = Standby()
