"""Slurm's command-line tools, as nbddp asks them: what a job holds (its nodes, each node's
address, CPUs and GPUs), its queue state, a sleeper job that holds an allocation, and its end.

Every question goes through ``scontrol``/``squeue``/``sbatch``/``scancel`` (as submitit does),
never through Slurm's libraries: the same tools the user has, with the same ``SLURM_CONF``.
Non-goal: starting processes on the nodes (``link.py``).
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import socket
import subprocess
from collections.abc import Sequence

from nbddp.clusters.placement import NodeInfo

TIMEOUT = 30.0  # seconds any one Slurm command may take
ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL"}
ENDED |= {"OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "REVOKED", "SPECIAL_EXIT"}
# why a job pends that waiting will not change: what it asks for is more than the partition,
# the account or the QOS allow
NEVER = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints"}
NEVER |= {"InvalidAccount", "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed"}


class SlurmCommandError(RuntimeError):
    """A Slurm command failed; its message is Slurm's."""


def run(args: Sequence[str], timeout: float = TIMEOUT) -> str:
    """A Slurm command's output; SlurmCommandError with its error text when it fails."""
    if shutil.which(args[0]) is None:
        raise SlurmCommandError(
            f"`{args[0]}` is not on this kernel's PATH: Slurm's client tools are needed "
            "(on a cluster: `module load slurm`; Debian: apt-get install slurm-client)."
        )
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(
            f"`{' '.join(args)}` did not answer within {timeout:g} s: is slurmctld reachable?"
        ) from None
    if done.returncode != 0:
        error = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        raise SlurmCommandError(f"`{' '.join(args)}`: {error}")
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """A hostlist expression (``node[01-03],gpu7``) as node names, in Slurm's order."""
    return run(["scontrol", "show", "hostnames", nodelist]).split()


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\S+?)=(\S*)", line))


def _count(ids: str) -> int:
    """How many of ``0-3,8`` (CPU ids)."""
    total = 0
    for part in filter(None, ids.split(",")):
        low, _, high = part.partition("-")
        total += int(high) - int(low) + 1 if high else 1
    return total


def _gpus(gres: str) -> int:
    """GPUs in a GRES field like ``gpu:2(IDX:0-1)`` or ``gpu:a100:4(IDX:0-3),nic:1``."""
    total = 0
    for match in re.finditer(r"(?:^|,)gpu(?::[^:,(]+)*?:(\d+)", gres):
        total += int(match.group(1))
    return total


def job_state(job_id: str) -> tuple[str, str]:
    """The job's state and its reason (``("PENDING", "Resources")``); ``("", "")`` once it
    left the queue."""
    text = run(["squeue", "--noheader", "--jobs", job_id, "--format=%T|%r"]).strip()
    if not text:
        return "", ""
    state, _, reason = text.splitlines()[0].partition("|")
    return state.strip(), reason.strip()


def job_nodes(job_id: str) -> list[NodeInfo]:
    """The nodes a running job holds, in Slurm's order: each node's name, the address Slurm
    reaches it at (``NodeAddr``), and the CPUs and GPUs the job holds there."""
    text = run(["scontrol", "show", "job", "--details", "--oneliner", job_id])
    fields = _fields(text)
    names = hostnames(fields.get("NodeList", ""))
    if not names:
        raise SlurmCommandError(
            f"Slurm job {job_id} holds no node (state {fields.get('JobState')})"
        )
    held: dict[str, tuple[int, int]] = {}
    # one "Nodes=<hostlist> CPU_IDs=... Mem=... GRES=..." group per set of alike nodes
    for group in re.finditer(r"\bNodes=(\S+) CPU_IDs=(\S*) Mem=\S* GRES=(\S*)", text):
        for name in hostnames(group.group(1)):
            held[name] = (_count(group.group(2)), _gpus(group.group(3)))
    addresses = node_addresses(names)
    infos = []
    for name in names:
        cpus, gpus = held.get(name, (1, 0))
        infos.append(NodeInfo(name, addresses[name], float(cpus), float(gpus)))
    return infos


def node_addresses(names: list[str]) -> dict[str, str]:
    """Each node's ``NodeAddr``: the address Slurm itself reaches it at (a node's name may
    resolve nowhere, or to 127.0.1.1 on the node itself)."""
    text = run(["scontrol", "show", "node", "--oneliner", ",".join(names)])
    addresses = {}
    for line in text.splitlines():
        fields = _fields(line)
        if "NodeName" in fields:
            address = fields.get("NodeAddr") or fields["NodeName"]
            addresses[fields["NodeName"]] = ipv4(address)
    missing = [n for n in names if n not in addresses]
    if missing:
        raise SlurmCommandError(f"scontrol knows no node {', '.join(missing)}")
    return addresses


def ipv4(address: str) -> str:
    """A node's address as an IPv4 address when its name resolves to one that is not
    loopback (gloo's interface is found by address); else as Slurm gave it."""
    try:
        ipaddress.IPv4Address(address)
        return address
    except ValueError:
        pass
    try:
        resolved = socket.gethostbyname(address)
    except OSError:
        return address
    return address if resolved.startswith("127.") else resolved


def submit_sleeper(options: Sequence[str]) -> str:
    """Submit a job that only holds its allocation (until cancelled or its time is up); its
    id. An impossible request raises SlurmCommandError with Slurm's reason, before anything
    is queued (``sbatch --test-only`` first: sbatch itself queues some of them)."""
    command = ["sbatch", "--job-name=nbddp", "--output=/dev/null", "--error=/dev/null"]
    command += [*options, "--wrap=exec sleep infinity"]
    run([command[0], "--test-only", *command[1:]])
    out = run([command[0], "--parsable", *command[1:]])
    return out.strip().split(";")[0]


def cancel(job_id: str) -> None:
    run(["scancel", job_id])
