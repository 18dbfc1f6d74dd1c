"""A real Slurm on one machine, for tests marked ``slurm``: ``slurmctld`` and ``slurmd -N nodea``
in one network namespace, ``slurmd -N nodeb`` in another, joined by a veth pair (10.201.0.1 and
10.201.0.2), one ``munged`` for both, every file in a private directory. Needs root and
Debian's ``slurmctld slurmd slurm-client munge``; :func:`why_not` says what is missing.

The pitfalls it avoids (``shared/research/scale-out.md`` §2c): cgroup autodetection fails in a
container (``cgroup.conf`` names v1; nothing uses it with ``proctrack/linuxproc``), node names
resolve nowhere (every address is a ``NodeAddr``), and each ``slurmd`` needs its own spool, pid
and log files (``%n``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Named per process: two runs on one machine (a developer's and CI's) never touch each other's.
_RUN = os.getpid() % 100000
NAMESPACES = (f"nbddp-slurm-a{_RUN}", f"nbddp-slurm-b{_RUN}")
VETHS = (f"nbddp-sa{_RUN}", f"nbddp-sb{_RUN}")  # each node's end of the pair
ADDRESSES = ("10.201.0.1", "10.201.0.2")
NODES = ("nodea", "nodeb")
PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "squeue", "scontrol", "ip")


def why_not() -> str | None:
    """Why this machine cannot run the test Slurm, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"needs {', '.join(missing)}: apt-get install slurmctld slurmd slurm-client munge"
    return None


_UNDER_WAY = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING"}


class Slurm:
    """The running cluster: run a client command inside node A's namespace with ``run``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", NAMESPACES[0], *args]

    def run(
        self, args: list[str], timeout: float = 60, **options: object
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **options,  # type: ignore[call-overload]
        )

    def submit_and_wait(self, batch: str, cwd: Path, timeout: float = 300) -> str:
        """``sbatch`` the file and wait until the job ended; its last state (``COMPLETED``,
        ``FAILED``, ...). Not ``sbatch --wait``: it looks at 2, 10 and 42 s (its sleep grows
        fourfold while under MinJobAge / 3), so a job of 3 s was seen ended after 10."""
        done = self.run(["sbatch", "--parsable", batch], cwd=cwd)
        assert done.returncode == 0, done.stderr
        job = done.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while True:
            shown = self.run(["scontrol", "show", "job", "--oneliner", job])
            fields = dict(f.partition("=")[::2] for f in shown.stdout.split() if "=" in f)
            state = fields.get("JobState", "")
            queued = any(line.split()[0] == job for line in self.queue())
            if state and state not in _UNDER_WAY and not queued:
                return state
            assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
            time.sleep(0.5)  # a poll of Slurm's state: Slurm tells no one when a job ends

    def queue(self) -> list[str]:
        """The jobs and their states. A squeue that failed (slurmctld busy on a loaded
        machine) is asked again, never read as an empty queue."""
        for _ in range(10):
            done = self.run(["squeue", "--noheader", "--format=%i %T"])
            if done.returncode == 0:
                return [line for line in done.stdout.splitlines() if line.strip()]
            time.sleep(1)  # a poll of slurmctld, which answers again once it has caught up
        raise RuntimeError(f"squeue failed ten times: {done.stderr.strip()}")


def _conf(root: Path, munge_socket: Path) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeAddr={a} CPUs=1 RealMemory=1000 State=UNKNOWN"
        for n, a in zip(NODES, ADDRESSES, strict=True)
    )
    return f"""ClusterName=nbddptest
SlurmctldHost={os.uname().nodename}({ADDRESSES[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _namespaces() -> None:
    a, b = NAMESPACES
    _cleanup_namespaces()
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(
        ["ip", "link", "add", VETHS[0], "type", "veth", "peer", "name", VETHS[1]], check=True
    )
    for ns, end, address in zip(NAMESPACES, VETHS, ADDRESSES, strict=True):
        subprocess.run(["ip", "link", "set", end, "netns", ns], check=True)
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", end], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", end, "up"], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    del a, b


def _cleanup_namespaces() -> None:
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextmanager
def slurm_cluster(root: Path, timeout: float = 60) -> Iterator[Slurm]:
    """Start the cluster under ``root``; end every daemon and namespace afterwards."""
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    socket_path = root / "munge" / "munge.socket"
    (root / "slurm.conf").write_text(_conf(root, socket_path))
    (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    slurm = Slurm(root)
    daemons: list[subprocess.Popen[bytes]] = []
    log = open(root / "daemons.log", "ab")  # noqa: SIM115 (open while the daemons run)
    _namespaces()
    try:
        daemons.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={socket_path}",
                    f"--key-file={key}",
                    f"--pid-file={root / 'munge' / 'munged.pid'}",
                    f"--log-file={root / 'munge' / 'munged.log'}",
                    f"--seed-file={root / 'munge' / 'munged.seed'}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait_for(socket_path.exists, timeout, "munged's socket")
        start = {"env": slurm.env, "stdout": log, "stderr": log}
        daemons.append(subprocess.Popen(slurm.command(["slurmctld", "-D", "-i"]), **start))  # type: ignore[call-overload]
        for ns, node in zip(NAMESPACES, NODES, strict=True):
            daemons.append(
                subprocess.Popen(  # type: ignore[call-overload]
                    ["ip", "netns", "exec", ns, "slurmd", "-D", "-N", node], **start
                )
            )

        def idle() -> bool:
            done = slurm.run(["sinfo", "--noheader", "--format=%T %D"], timeout=10)
            return done.returncode == 0 and done.stdout.split() == ["idle", "2"]

        _wait_for(idle, timeout, "both nodes idle in sinfo", root)
        yield slurm
    finally:
        if len(daemons) > 1:
            with contextlib.suppress(RuntimeError):  # one that cannot answer is ended as well
                for job in slurm.queue():
                    slurm.run(["scancel", job.split()[0]])
                deadline = time.monotonic() + 15
                while slurm.queue() and time.monotonic() < deadline:  # COMPLETING, then gone
                    time.sleep(0.3)
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        _cleanup_namespaces()
        log.close()


def _wait_for(ready: object, timeout: float, what: str, root: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            logs = ""
            if root is not None:
                logs = "\n".join(
                    f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(root.glob("*.log"))
                )
            raise TimeoutError(f"the test Slurm: no {what} after {timeout} s\n{logs}")
        time.sleep(0.3)
