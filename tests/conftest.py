"""Shared fixtures: a guard that fails any test leaving a process or a temp dir behind, and a
real Jupyter kernel (jupyter_client) for tests that must run where users run."""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import psutil
import pytest

# Launch options most tests use: two gloo ranks on the CPU, with and without a panel.
TWO_CPU = {"num_workers": 2, "device": "cpu"}
TWO_CPU_QUIET = {**TWO_CPU, "display": "none"}

# The skip summary and CI's rule that only gpu tests may skip; every test in one tier, and each
# tier's promise kept; sharing the machine under xdist (groups, the alone lock, the speed);
# pytester, for the tests of those rules (test_ci.py).
pytest_plugins = ["skips", "tiers", "sharing", "bytecode", "pytester"]


def is_warm_helper(proc: psutil.Process) -> bool:
    """nbddp's pre-warmed helper, or a child it forked ahead for the next launch: owned and
    reported, not a leftover. A rank it forked has the same command line but leads a session
    of its own, so a rank left behind is still caught."""
    try:
        if "nbddp.worker.helper.server" not in " ".join(proc.cmdline()):
            return False
        parent = proc.parent()
        if parent is None or "nbddp.worker.helper.server" not in " ".join(parent.cmdline()):
            return True  # the helper itself
        return os.getsid(proc.pid) == parent.pid  # waiting in the helper's session
    except (psutil.Error, OSError):
        return False


def running(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie waiting for its parent to reap it has ended, and
    one reaped between two looks (the warm helper reaps its ranks on its own) is gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(condition: Callable[[], object], timeout: float = 30.0) -> bool:
    """Whether ``condition()`` came true within ``timeout`` seconds: a wait on a state the
    test can see (a file, a status, a process), never a fixed sleep standing in for one."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def in_all_reduce(run: Any, rank: int) -> bool:
    """Whether ``run``'s roll-call finds ``rank``'s main thread in torch's all_reduce, at its
    call into the backend: it waits in native code there, where no interrupt reaches it (a
    peer's failure interrupts it next; before the call it would return to idle instead)."""
    report = run.stacks()[rank] if run is not None else None
    if report is None or not report.threads[0].frames:
        return False
    frame = report.threads[0].frames[-1]  # the innermost
    return (
        frame.filename.endswith("distributed_c10d.py")
        and frame.function == "all_reduce"
        and ("allreduce(" in frame.line or ".wait(" in frame.line)
    )


def blocks(*rows: tuple) -> list:
    """Rows ``(epoch, {name: value})`` as a worker sends them: runs of rows with the same
    epoch and keys, a list of values per key."""
    sent: list = []
    for epoch, values in rows:
        if not sent or sent[-1][:2] != (epoch, tuple(values)):
            sent.append((epoch, tuple(values), [[] for _ in values]))
        for column, value in zip(sent[-1][2], values.values(), strict=True):
            column.append(value)
    return sent


def is_ray_process(proc: psutil.Process) -> bool:
    """A process of a (simulated) Ray cluster a test started: the cluster's to end, not ours.
    The ranks its nodes fork are no Ray processes and are still checked."""
    try:
        command = proc.cmdline()
        line = " ".join(command)
        return (
            proc.name() in ("raylet", "gcs_server")
            or "ray::" in line
            or "/site-packages/ray/" in line
            or " -m ray." in line
            or any(os.path.basename(part) == "ray" for part in command[:2])
        )
    except psutil.Error:
        return False


def _descendants() -> dict[int, psutil.Process]:
    alive = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if (
                proc.status() != psutil.STATUS_ZOMBIE
                and not is_warm_helper(proc)
                and not is_ray_process(proc)
            ):
                alive[proc.pid] = proc
        except psutil.NoSuchProcess:
            continue
    return alive


def _our_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"nbddp-{os.getpid()}-*")))


@contextmanager
def starts_nothing() -> Iterator[None]:
    """Fail if the block starts a process (a rank, the warm helper, anything: each
    ``subprocess.Popen``, ``os.fork`` or ``os.posix_spawn`` is counted, short-lived ones too)
    or makes a run directory (every launch, warm ones included, makes one before its ranks
    start): what "refused before anything starts" promises."""
    started: list[str] = []
    popen_init, mkdtemp = subprocess.Popen.__init__, tempfile.mkdtemp

    def counted_popen(self: subprocess.Popen, args: Any, *more: Any, **options: Any) -> None:
        started.append(f"subprocess.Popen({args!r})")
        popen_init(self, args, *more, **options)

    def counted_fork(real: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started.append(name)
            return real(*args, **kwargs)

        return call

    def counted_mkdtemp(*args: Any, **kwargs: Any) -> str:
        path = mkdtemp(*args, **kwargs)
        if "nbddp" in os.path.basename(path):
            started.append(f"a run directory {path}")
        return path

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with (
        mock.patch.object(subprocess.Popen, "__init__", counted_popen),
        mock.patch.object(os, "fork", counted_fork(os.fork, "os.fork()")),
        mock.patch.object(os, "posix_spawn", counted_fork(os.posix_spawn, "os.posix_spawn()")),
        mock.patch.object(tempfile, "mkdtemp", counted_mkdtemp),
    ):
        yield
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            # a child the warm helper, already up, forks ahead is its own doing
            if proc.pid not in before and not (proc.ppid() in before and is_warm_helper(proc)):
                started.append(" ".join(proc.cmdline()))
    assert not started, f"started: {started}"


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Fail a test that leaves a new child process (at any depth) or a private dir behind."""
    before = set(_descendants())
    dirs_before = _our_dirs()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        new = {pid: p for pid, p in _descendants().items() if pid not in before}
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for proc in new.values():
        proc.kill()
    assert not new, f"processes left behind: {[p.pid for p in new.values()]}"
    assert _our_dirs() <= dirs_before, "a run's private directory was left behind"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


_kernel_sockets: str | None = None


def kernel_config() -> Any:
    """The configuration of every kernel a test starts (``Kernel``, nbclient): Unix sockets in
    a directory of this process, not TCP. jupyter_client picks five free ports and the kernel
    binds them later; meanwhile another test's process can take one, and the kernel dies of
    "address in use" before it replies (CI, -n 3). A socket file cannot be taken that way."""
    from traitlets.config import Config

    global _kernel_sockets
    if _kernel_sockets is None:
        _kernel_sockets = tempfile.mkdtemp(prefix=f"kernels-{os.getpid()}-")
        atexit.register(shutil.rmtree, _kernel_sockets, ignore_errors=True)
    prefix = os.path.join(_kernel_sockets, uuid.uuid4().hex[:8])
    return Config({"KernelManager": {"transport": "ipc", "ip": prefix}})


def run_notebook(notebook: Any, timeout: float, path: str | os.PathLike[str] | None = None) -> None:
    """Execute ``notebook`` in place with nbclient (in ``path``, as a saved notebook would run
    there), in a fresh kernel on Unix sockets (:func:`kernel_config`)."""
    from nbclient import NotebookClient

    resources = {"metadata": {"path": str(path)}} if path is not None else {}
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        config=kernel_config(),
        resources=resources,
    )
    client.execute()


class Kernel:
    """A real IPython kernel, driven the way a notebook frontend drives it."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        self.manager = KernelManager(kernel_name="python3", config=kernel_config())
        self.manager.start_kernel(cwd=os.getcwd())
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=60)
        except BaseException:
            # A kernel that never answered is still ended, and its sockets closed: left to
            # the garbage collector, they warn (an error here) in whichever test runs next.
            self.client.stop_channels()
            self.manager.shutdown_kernel(now=True)
            raise

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def run(
        self, code: str, timeout: float = 120, messages: list[dict] | None = None
    ) -> tuple[str, dict]:
        """Execute a cell; return its output as text (streams, results, the HTML of displays
        and display updates) and the reply. ``messages`` collects every iopub message."""
        chunks: list[str] = []

        def collect(msg: dict) -> None:
            if messages is not None:
                messages.append(msg)
            content = msg["content"]
            if msg["msg_type"] == "stream":
                chunks.append(content["text"])
            elif msg["msg_type"] in ("execute_result", "display_data", "update_display_data"):
                data = content["data"]
                chunks.append(data.get("text/html", data.get("text/plain", "")) + "\n")
            elif msg["msg_type"] == "error":
                chunks.append("\n".join(content["traceback"]))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=collect)
        return "".join(chunks), reply["content"]

    def run_answering(
        self,
        code: str,
        answer: Callable[[str], str | None],
        timeout: float = 120,
        allow_stdin: bool = True,
        messages: list[dict] | None = None,
    ) -> tuple[str, dict]:
        """Execute a cell as a person at the notebook does: each ``input_request`` (the input
        box) is answered with ``answer(prompt)``; None leaves the box unanswered.
        ``allow_stdin=False``: a client without an input box (papermill, nbconvert)."""
        chunks: list[str] = []

        def collect(msg: dict) -> None:
            if messages is not None:
                messages.append(msg)
            content = msg["content"]
            if msg["msg_type"] == "stream":
                chunks.append(content["text"])
            elif msg["msg_type"] in ("execute_result", "display_data", "update_display_data"):
                data = content["data"]
                chunks.append(data.get("text/html", data.get("text/plain", "")) + "\n")
            elif msg["msg_type"] == "error":
                chunks.append("\n".join(content["traceback"]))

        def typed(msg: dict) -> None:
            line = answer(msg["content"]["prompt"])
            if line is not None:
                self.client.input(line)

        self._collect = collect
        try:
            reply = self.client.execute_interactive(
                code,
                timeout=timeout,
                output_hook=collect,
                allow_stdin=allow_stdin,
                stdin_hook=typed,
            )
        finally:
            del self._collect
        return "".join(chunks), reply["content"]

    def watch(self, until: Callable[[], bool], timeout: float = 30) -> bool:
        """Inside an ``answer`` of :meth:`run_answering`: take in the cell's output (as the
        page shows it meanwhile) until ``until()`` holds; False if ``timeout`` passed first."""
        import queue

        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                return False
            try:
                self._collect(self.client.get_iopub_msg(timeout=0.05))
            except queue.Empty:
                continue
        return True

    def run_seeing_everything(self, code: str, timeout: float = 60) -> tuple[list[dict], dict]:
        """Execute a cell; return every iopub message that arrived meanwhile, whichever cell
        it belongs to (ipykernel 7 files a background thread's output, such as a background
        run's panel updates, under the cell that started the thread), and the reply."""
        msg_id = self.client.execute(code)
        messages: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            messages.append(msg)
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                break
        while True:
            reply = self.client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return messages, reply["content"]

    def shutdown(self) -> None:
        pid = self.pid
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
        _sweep_after(pid)


def _sweep_after(pid: int) -> None:
    """A killed kernel cannot remove its runs' directories; the next launch's sweep does.
    Sweep now, and check that the sweep finds every one of them."""
    from nbddp.local import rundir

    left = glob.glob(os.path.join(tempfile.gettempdir(), f"nbddp-{pid}-*"))
    if not left:
        return
    rundir.sweep_stale_dirs()
    assert not [p for p in left if os.path.exists(p)], "a dead kernel's directory was not swept"


@pytest.fixture(scope="session")
def kernel_factory() -> Iterator[type[Kernel]]:
    yield Kernel


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    k = Kernel()
    k.run("import time\nimport torch\nimport nbddp")
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real Slurm in two network namespaces (``slurm_cluster.py``), one per test module."""
    from slurm_cluster import slurm_cluster, why_not

    reason = why_not()
    if reason is not None:
        pytest.skip(f"no test Slurm: {reason}")
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
