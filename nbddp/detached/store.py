"""Where detached runs are kept, and what is known of each without asking its supervisor.

One directory per run under the user's runs directory (``NBDDP_RUNS_DIR``, else
``~/.nbddp/runs``), owner-only (0700, its files 0600), named by the run's id:

    info.json        what was launched (written once, before the supervisor starts)
    key              the run's 32-byte key: what a kernel proves to attach (owner-only)
    supervisor.lock  flock'ed by the run's owner from the directory's first instant (the
                     kernel, then the supervisor, which inherits the lock): free = nobody
                     supervises the run any more
    supervisor.json  the supervisor's pid and the address kernels attach at
    events.log       every event, appended as it comes (``records.py``)
    output.log       what the ranks printed, as plain text
    status.json      the latest status and progress, rewritten at most once a second
    result.pkl       rank 0's value (``outcome.py``)

How long a finished run is kept: ``retention.py``.

Non-goal: other users' runs. Their directories cannot be entered, and any run not owned by
the caller is treated as unknown.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from typing import Any

from nbddp.detached.outcome import Ending
from nbddp.detached.records import last_event

RUNS_DIR_VARIABLE = "NBDDP_RUNS_DIR"

INFO, KEY, LOCK, SUPERVISOR = "info.json", "key", "supervisor.lock", "supervisor.json"
LOG, OUTPUT, STATUS, JOB_ID = "events.log", "output.log", "status.json", "job.json"
NEW = ".new-"  # a run directory being made
ID = re.compile(r"[0-9a-f]{8}")


def runs_root(create: bool = True) -> str:
    """The caller's runs directory, made owner-only if it is not there; refused (ValueError)
    when it belongs to someone else."""
    root = os.environ.get(RUNS_DIR_VARIABLE) or os.path.join(
        os.path.expanduser("~"), ".nbddp", "runs"
    )
    root = os.path.abspath(root)
    if create:
        os.makedirs(root, mode=0o700, exist_ok=True)
    try:
        owner = os.stat(root).st_uid
    except FileNotFoundError:
        return root
    except PermissionError:
        owner = -1
    if owner != os.getuid():
        raise ValueError(
            f"the runs directory {root} belongs to another user: detached runs are kept in a "
            f"directory of your own. Set {RUNS_DIR_VARIABLE} to one (on a cluster, on a "
            "filesystem every node sees)."
        )
    return root


def new_id() -> str:
    return secrets.token_hex(4)


class StoredRun:
    """One run's directory, read without its supervisor."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.id = os.path.basename(path)
        self._info: dict[str, Any] | None = None

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = _read_json(self.join(INFO)) or {}
        return self._info

    def key(self) -> bytes:
        with open(self.join(KEY), "rb") as f:
            return f.read()

    def supervisor(self) -> dict[str, Any] | None:
        """The supervisor's pid and attach address, once it listens."""
        return _read_json(self.join(SUPERVISOR))

    def status(self) -> dict[str, Any]:
        return _read_json(self.join(STATUS)) or {}

    @property
    def job_id(self) -> str | None:
        """The Slurm batch job of a run detached on Slurm (once submitted)."""
        job = _read_json(self.join(JOB_ID))
        return None if job is None else str(job.get("job_id"))

    def supervised(self) -> bool:
        """Whether something still owns the run: its lock is held (the launching kernel's,
        then the supervisor's), or its batch job is still in the queue (Slurm)."""
        if lock_is_held(self.join(LOCK)):
            return True
        job = self.job_id
        if job is not None:
            from nbddp.detached.queue import job_in_queue

            return job_in_queue(job)
        return False

    def ending(self) -> Ending | None:
        """How the run ended, from its record; None while it runs or when it was lost."""
        event = last_event(self.join(LOG), "end")
        if event is not None and isinstance(event.args[0], Ending):
            return event.args[0]
        return None

    def size(self) -> int:
        total = 0
        for entry in os.scandir(self.path):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_size
        return total

    def state(self) -> tuple[str, float | None]:
        """The run's status and, once it ended, when (``time.time()``)."""
        status = self.status()
        if status.get("ended"):
            return str(status.get("status", "failed")), float(status.get("updated", 0.0))
        if self.supervised():
            return str(status.get("status", "starting")), None
        # nobody supervises it and its status never said it ended: its supervisor was lost
        # (or its status could not be written). Read the record once, and say it from now on.
        ending = self.ending()
        log = self.join(LOG)
        try:
            ended_at = os.stat(log if os.path.exists(log) else self.path).st_mtime
        except OSError:
            ended_at = time.time()
        final = ending.status if ending is not None else "failed"
        with contextlib.suppress(OSError):
            write_json(
                self.join(STATUS),
                {
                    **status,
                    "status": final,
                    "ended": True,
                    "updated": ended_at,
                    "lost": ending is None,
                },
            )
        return final, ended_at

    def wait_unsupervised(self, timeout: float) -> bool:
        """Wait until nothing owns the run any more (its supervisor exited); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.supervised():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def lock_is_held(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:  # held; any other error (a filesystem without locks) tells nothing
        return exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
    finally:
        os.close(fd)
    return False


def create(info: dict[str, Any]) -> tuple[StoredRun, int]:
    """A new run's directory with its id, key and ``info``, and the descriptor of its held
    lock (the caller hands it on to the supervisor, or closes it to give the run up). Made
    under a temporary name and renamed whole: a run directory is never seen half made."""
    root = runs_root()
    while True:
        run_id = new_id()
        new = tempfile.mkdtemp(prefix=f"{NEW}{run_id}-", dir=root)
        lock = -1
        try:
            lock = os.open(os.path.join(new, LOCK), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
            _write(os.path.join(new, KEY), secrets.token_bytes(32))
            _write(os.path.join(new, INFO), json.dumps({**info, "id": run_id}).encode())
            path = os.path.join(root, run_id)
            try:
                os.rename(new, path)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                shutil.rmtree(new, ignore_errors=True)
                os.close(lock)
                continue  # that id is taken: draw another
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            if lock >= 0:
                os.close(lock)
            raise
        return StoredRun(path), lock


def find(run_id: Any) -> StoredRun:
    """The caller's run ``run_id``; ValueError when it has none by that id."""
    if not isinstance(run_id, str) or ID.fullmatch(run_id) is None:
        raise ValueError(
            f"{run_id!r} is not a detached run's id (8 hex digits, as nbddp.runs() lists them)."
        )
    root = runs_root(create=False)
    path = os.path.join(root, run_id)
    try:
        owner = os.stat(os.path.join(path, INFO)).st_uid
    except PermissionError:
        owner = -1
    except FileNotFoundError:
        raise ValueError(
            f"there is no detached run {run_id} of yours in {root} (nbddp.runs() lists them; "
            "a finished run is kept until forget() or the retention limit)."
        ) from None
    if owner != os.getuid():
        raise ValueError(f"run {run_id} belongs to another user: only its owner may use it.")
    return StoredRun(path)


def stored_runs() -> list[StoredRun]:
    """Every run of the caller's, newest first."""
    try:
        root = runs_root(create=False)
        names = os.listdir(root)
    except (FileNotFoundError, PermissionError):
        return []
    found = []
    for name in names:
        if ID.fullmatch(name) is None:
            continue
        run = StoredRun(os.path.join(root, name))
        if run.info:
            found.append(run)
    return sorted(found, key=lambda r: float(r.info.get("started", 0.0)), reverse=True)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_json(path: str, data: dict[str, Any]) -> None:
    """Replace ``path`` whole (a reader sees the old or the new one, never half)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(data).encode())
    os.replace(temporary, path)


def started_at(run: StoredRun) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(float(run.info.get("started", 0.0))).astimezone()
