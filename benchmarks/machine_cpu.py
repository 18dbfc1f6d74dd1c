"""Every process's CPU on the machine while something runs, by kind (for ``suite_time.py``).

``suite_observer.py`` sees what each test's own process tree spends; this sees the rest too:
daemons that left the tree (Slurm's step daemons and the ranks under them) and the machine's
own processes (on a VM, its init and kernel threads grow with the load). A thread reads each
process's own user+system time once a second and keeps the last reading, so a process that
lives under a second is mostly missed, and one's last second is lost."""

from __future__ import annotations

import collections
import threading
import time

import psutil

HELPER_MODULE = "nbddp.worker.helper"  # on a warm helper's command line, and its ranks'

# (kind, test on the command line or the process name), first match wins
KINDS = [
    ("Slurm's daemons", lambda line, name: name.startswith(("slurm", "munge"))),
    (  # a zombie has no command line left: its life was missed, its CPU is still there
        "Python first seen exited (a zombie awaiting its reaper: its kind unknown)",
        lambda line, name: not line and name.startswith("python"),
    ),
    ("the VM's own (PID 1, kernel threads)", lambda line, name: not line or name == "process_api"),
    ("Chromium and Playwright", lambda line, name: "chrom" in name or "playwright" in line),
    ("Ray", lambda line, name: "ray::" in line or "/ray/" in line or "/bin/ray" in line),
    ("under Slurm (node helpers, ranks)", lambda line, name: "slurm" in line),
    ("JupyterLab", lambda line, name: "jupyterlab" in line),
    ("Jupyter kernels", lambda line, name: "ipykernel_launcher" in line),
    ("warm helpers' ranks and their children", lambda line, name: HELPER_MODULE in line),
    ("cold ranks and exported scripts (a file in /tmp)", lambda line, name: "python /tmp/" in line),
    (
        "multiprocessing's spawned and forkserver children",
        lambda line, name: "multiprocessing" in line,
    ),
    ("pytest and its workers", lambda line, name: "pytest" in line or "sys.stdin.readline" in line),
]


HELPER = "warm helpers (each imports torch once)"


def kind(line: str, name: str, parent: str = "") -> str:
    """``parent``: the parent's command line. A helper forks its ranks, so they keep its
    command line: the one whose parent is not a helper is the helper itself."""
    if HELPER_MODULE in line and HELPER_MODULE not in parent:
        return HELPER
    return next((k for k, test in KINDS if test(line, name)), "other processes")


def _command_line(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return ""


class MachineCPU:
    """Sample from ``start()`` to ``stop()``; ``by_kind()`` sums what each kind spent."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.seen: dict[tuple[int, float], list] = {}  # (pid, start) -> [first, last, kind]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="machine-cpu", daemon=True)

    def start(self) -> MachineCPU:
        self._look()  # what ran before counts from here, not from its start
        for row in self.seen.values():
            row[0] = row[1]
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._look()

    def _look(self) -> None:
        fields = ["pid", "ppid", "create_time", "cmdline", "name", "cpu_times"]
        for proc in psutil.process_iter(fields):
            info = proc.info
            if info["cpu_times"] is None:
                continue
            cpu = info["cpu_times"].user + info["cpu_times"].system
            key = (info["pid"], info["create_time"])
            row = self.seen.get(key)
            if row is None:  # born since the last look: all its time is new
                line = " ".join(info["cmdline"] or [])
                parent = _command_line(info["ppid"]) if HELPER_MODULE in line else ""
                self.seen[key] = [0.0, cpu, kind(line, info["name"] or "", parent)]
            else:
                row[1] = cpu

    def by_kind(self) -> list[tuple[str, float, int]]:
        """(kind, CPU seconds, processes), the costliest first."""
        cpu: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        for first, last, what in self.seen.values():
            cpu[what] += last - first
            count[what] += 1
        return [(what, seconds, count[what]) for what, seconds in cpu.most_common()]


if __name__ == "__main__":  # a look at the machine for ten seconds
    sampler = MachineCPU().start()
    time.sleep(10)
    sampler.stop()
    for what, seconds, processes in sampler.by_kind():
        print(f"{seconds:7.1f} core-s  {processes:5d}  {what}")
