"""The sections of ``gpu_check.py``, one function each, run in a subprocess of their own.

Each takes a :class:`Check` (``gpu``: False in the CPU rehearsal, where the GPU parts are
stubbed: the ranks run on the CPU, nvidia-smi readings are absent) and records facts and
checks (``ok`` None: not checkable here). Functions the ranks run are at module level: the
ranks import this module by name (the section's ``sys.path`` is theirs).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


class Check:
    """What one section found: facts, and checks with what was expected."""

    def __init__(self, gpu: bool, out: Path) -> None:
        self.gpu = gpu
        self.device = "cuda" if gpu else "cpu"
        self.out = out
        self.facts: dict[str, Any] = {}
        self.checks: list[dict[str, Any]] = []

    def fact(self, name: str, value: Any) -> None:
        self.facts[name] = value

    def check(self, what: str, expected: Any, got: Any, ok: bool | None) -> None:
        self.checks.append({"what": what, "expected": str(expected), "got": str(got), "ok": ok})

    def on_gpu(self, ok: bool) -> bool | None:
        """A check that means something on a GPU only (None in the rehearsal)."""
        return ok if self.gpu else None

    def two_ranks(self) -> dict[str, Any]:
        """2 ranks sharing GPU 0 with gloo (the one-GPU machine), or 2 CPU ranks."""
        if self.gpu:
            return {"device": "cuda", "gpus": [0, 0], "backend": "gloo", "display": "none"}
        return {"device": "cpu", "num_workers": 2, "display": "none"}


def smi(*args: str) -> str | None:
    """nvidia-smi's output (None where there is none)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=20, check=False)
    return done.stdout.strip() if done.returncode == 0 else f"failed: {done.stderr.strip()}"


def memory_used() -> int | None:
    """MiB used on GPU 0, as nvidia-smi sees it (every process's)."""
    text = smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0")
    try:
        return int(text.splitlines()[0]) if text else None
    except ValueError:
        return None


def compute_apps() -> list[tuple[int, int]] | None:
    """(pid, MiB) of every process holding a CUDA context."""
    text = smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    if text is None or text.startswith("failed"):
        return None
    apps = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            apps.append((int(parts[0]), int(parts[1]) if parts[1].isdigit() else -1))
    return apps


def memory_back(baseline: int | None, within: float, slack: int = 300) -> tuple[float | None, Any]:
    """Seconds until GPU 0's used memory is back within ``slack`` MiB of ``baseline``."""
    if baseline is None:
        return None, "no nvidia-smi"
    started = time.monotonic()
    while time.monotonic() - started < within:
        now = memory_used()
        if now is not None and now <= baseline + slack:
            return time.monotonic() - started, now
        time.sleep(0.2)
    return None, memory_used()


def run_processes(variable: str, value: str) -> list[int]:
    """Pids whose environment holds ``variable=value`` (a run's processes)."""
    wanted = f"{variable}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
            if wanted in f.read().split(b"\0"):
                found.append(int(entry))
    return found


def wait_for(path: Path, within: float) -> bool:
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- 0. environment ----------------------------------------------------------------------------


def environment(c: Check) -> None:
    import importlib.metadata
    import importlib.util
    import platform

    import torch

    from nbddp.devices import nccl_version, version_text

    c.fact("python", f"Python {platform.python_version()}")
    c.fact("cores", f"{os.cpu_count()} ({len(os.sched_getaffinity(0))} usable)")
    c.fact("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    c.fact("gpus seen (NVML)", torch.cuda.device_count() if torch.cuda.is_available() else 0)
    listing = smi("-L")
    c.fact("nvidia-smi -L", listing or "no nvidia-smi")
    c.fact("gpu", listing.splitlines()[0].split(" (UUID")[0] if listing else "no GPU")
    query = "name,memory.used,memory.total,mig.mode.current,compute_mode,driver_version"
    c.fact("nvidia-smi query", smi(f"--query-gpu={query}", "--format=csv,noheader"))
    try:
        built = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:
        built = f"unknown ({type(exc).__name__})"
    loaded = nccl_version()
    c.fact("nccl", f"NCCL {built} as built, {version_text(loaded)} as loaded")
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            c.fact(f"pip {name}", importlib.metadata.version(name))
    shm = shutil.disk_usage("/dev/shm")
    c.fact("/dev/shm", f"{shm.free / GIB:.1f} GiB free of {shm.total / GIB:.1f}")
    c.fact("MPS pipe", os.path.exists("/tmp/nvidia-mps"))
    c.fact(
        "kernel packages", {m: _importable(m) for m in ("IPython", "ipykernel", "jupyter_client")}
    )
    commit = os.environ.get("NBDDP_COMMIT") or _git_commit()
    c.fact("commit", commit)
    c.check(
        "reading all this started no CUDA in this process",
        False,
        torch.cuda.is_initialized(),
        not torch.cuda.is_initialized(),
    )
    c.check(
        "NCCL's version read from the library torch loaded",
        "a version",
        version_text(loaded),
        c.on_gpu(loaded is not None),
    )


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # hidden (the rehearsal), or a broken install
        return False


def _git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        if done.returncode == 0:
            return done.stdout.strip()
    return "unknown (no .git here: pass NBDDP_COMMIT)"


# -- 1. the gpu tests --------------------------------------------------------------------------

GPU_TESTS = [
    "tests/test_gpu.py",
    "tests/worker/rank/test_tutorials.py",
    "tests/exporting/test_export.py",
    "tests/local/test_helper_safety.py",
    "tests/docs/test_code_blocks.py",  # the pages with GPU blocks (gpu_blocks), in a kernel
]


def gpu_tests(c: Check) -> None:
    import xml.etree.ElementTree as ET

    report = c.out / "gpu-tests.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu or gpu_blocks" if c.gpu else "gpu",  # the pages' CPU blocks need IPython
        *GPU_TESTS,
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "--timeout",
        "60",
        f"--junitxml={report}",
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False
    )
    c.fact("pytest tail", done.stdout[-2500:])
    if not report.exists():
        c.check("the gpu tests ran", "a junit report", done.returncode, False)
        return
    suite = ET.parse(report).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    c.fact("counts", counts)
    failed = [
        case.get("name")
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    skipped = {
        case.get("name"): (case.find("skipped").get("message") or "")[:120]
        for case in suite.iter("testcase")
        if case.find("skipped") is not None
    }
    c.fact("failed", failed)
    c.fact("skipped", skipped)
    c.check(
        "every gpu test collected without an import error",
        0,
        counts["errors"],
        counts["errors"] == 0,
    )
    c.check("no gpu test failed", [], failed, c.on_gpu(not failed))
    c.check(
        "gpu tests that ran",
        "> 5 on one GPU",
        counts["tests"] - counts["skipped"],
        c.on_gpu(counts["tests"] - counts["skipped"] > 5),
    )


# -- 2. imports that would start CUDA in the helper ---------------------------------------------

POPULAR = [
    "torch._dynamo",
    "transformers",
    "transformers.trainer",
    "accelerate",
    "lightning.pytorch",
    "peft",
    "timm",
    "torch_geometric",
    "sentence_transformers",
    "torchvision",
    "torchmetrics",
    "cupy",
    "jax",
    "numba.cuda",
]
_PROBE = """
import importlib, json, os, sys
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
sys.path.insert(0, sys.argv[1])
from probe_state import state
import torch
print(json.dumps(["torch", "imported", *state()]), flush=True)
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
        done = "imported"
    except Exception as exc:
        done = f"absent ({type(exc).__name__})"
    print(json.dumps([name, done, *state()]), flush=True)
"""

# One GPU call each, in a fresh process after `import torch`: what it starts (threads, the GPU's
# device files, CUDA) and whether a child forked after it still reaches the GPU. This is what
# decides which imports the warm helper may keep (nbddp/worker/helper/preload.py).
CALLS = {
    "import torch (nothing more)": "pass",
    "torch.cuda.device_count()": "torch.cuda.device_count()",
    "torch.cuda.is_available() with PYTORCH_NVML_BASED_CUDA_CHECK=1": (
        "os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'] = '1'; torch.cuda.is_available()"
    ),
    "torch.cuda.is_available() without the variable": (
        "os.environ.pop('PYTORCH_NVML_BASED_CUDA_CHECK', None); torch.cuda.is_available()"
    ),
    "nbddp.devices.nccl_version()": "import nbddp.devices; nbddp.devices.nccl_version()",
    "import torch._dynamo": "import torch._dynamo",
    "import test_gpu (tests/test_gpu.py)": "import test_gpu",
    "torch.cuda.init()": "torch.cuda.init()",
    "cuInit(0) through ctypes (as cupy or numba do)": (
        "import ctypes; ctypes.CDLL('libcuda.so.1').cuInit(0)"
    ),
}
_CALL = """
import json, os, select, sys
sys.path[:0] = [sys.argv[1], sys.argv[2], sys.argv[3]]
from probe_state import state
import torch
before = state()
try:
    exec(sys.argv[4])
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {str(exc)[:160]}"
after = state()
read, write = os.pipe()
child = os.fork()
if child == 0:
    try:
        answer = str(torch.ones(1, device="cuda").device) if torch.cuda.is_available() else "cpu"
    except Exception as exc:
        answer = f"{type(exc).__name__}: {str(exc)[:160]}"
    os.write(write, answer.encode())
    os._exit(0)
ready, _, _ = select.select([read], [], [], 20)
forked = os.read(read, 400).decode() if ready else "no answer in 20 s"
if not ready:
    os.kill(child, 9)
os.waitpid(child, 0)
print(json.dumps({"before": before, "after": after, "error": error, "forked child": forked}),
      flush=True)
"""


def probe_calls() -> dict[str, Any]:
    """Each of :data:`CALLS` in its own fresh process, all at once (16 cores there)."""
    here = str(Path(__file__).parent)
    started = {
        name: subprocess.Popen(
            [sys.executable, "-c", _CALL, here, str(ROOT), str(ROOT / "tests"), code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, code in CALLS.items()
    }
    found: dict[str, Any] = {}
    for name, process in started.items():
        try:
            out, err = process.communicate(timeout=40)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            found[name] = json.loads(lines[-1]) if lines else f"no answer: {err[-300:]}"
        except subprocess.TimeoutExpired:
            process.kill()
            found[name] = "cut at 40 s"
    return found


# what a DDP notebook imports before a launch: the helper is told to preload these
PRELOADED = ["torch._dynamo", "transformers", "transformers.trainer", "accelerate",
             "lightning.pytorch", "peft", "timm", "torchvision", "torchmetrics"]  # fmt: skip


def helper_imports(c: Check) -> None:
    here = str(Path(__file__).parent)
    try:
        printed = subprocess.run(
            [sys.executable, "-c", _PROBE, here, *POPULAR],
            capture_output=True,
            text=True,
            timeout=22,
            check=False,
        ).stdout
    except subprocess.TimeoutExpired as slow:  # what it printed so far
        printed = slow.stdout.decode() if isinstance(slow.stdout, bytes) else slow.stdout or ""
        c.fact("the import probe", "cut at 22 s")
    rows = [json.loads(line) for line in printed.splitlines() if line.startswith("[")]
    c.fact(
        "imports, in order in one process (name, state, libcuda mapped, CUDA initialised, "
        "threads, GPU files open, the CUDA driver started)",
        rows,
    )
    c.fact("imports that open the GPU or start CUDA", [r[0] for r in rows if r[3] or r[5] or r[6]])
    calls = probe_calls()
    c.fact("GPU calls, each in a fresh process (state before and after; a forked child)", calls)
    import nbddp
    from nbddp.local.forkserver import helper_pid, warm_starter

    starter = warm_starter()
    starter.prestart(wait=True)
    helper = starter.helper
    present = [r[0] for r in rows if r[1] == "imported" and r[0] in PRELOADED]
    if helper is None:
        c.check("the warm helper started", "a helper", None, False)
        return
    helper.preload(present, list(sys.path), [])
    c.fact("helper preloaded within 15 s", helper.preloaded.wait(15))
    pid = helper_pid()
    maps = Path(f"/proc/{pid}/maps").read_text() if pid else ""
    c.fact("libcuda mapped in the helper (loaded, not started: safe to fork)", "libcuda.so" in maps)
    from nbddp.worker.helper.preload import gpu_files

    c.fact("GPU files the helper holds", sorted(gpu_files(f"/proc/{pid}/fd")) if pid else None)
    c.check("the helper still forks after the preload", None, helper.unsafe, helper.unsafe is None)
    devices = nbddp.notebook_launch(where_is_the_rank, **c.two_ranks(), return_all=True)
    c.check(
        "ranks forked after the preload reach their device",
        c.device,
        devices,
        all(d.startswith(c.device) for d in devices),
    )


def where_is_the_rank() -> str:
    import torch

    import nbddp

    t = torch.ones(2, device=nbddp.device())
    return str(t.device)


# -- 3. the stall banner on GPU ranks ----------------------------------------------------------


def stall_banner(c: Check) -> None:
    import nbddp

    if c.gpu:
        c.fact("CPU share of a process waiting in synchronize()", f"{_spin_share():.0%}")
    marks = Path(tempfile.mkdtemp())
    run = nbddp.notebook_launch(
        waits_in_all_reduce, (str(marks),), **c.two_ranks(), stall_after=4, block=False
    )
    try:
        wait_for(marks / "0", 30)
        started = time.monotonic()
        shown = None
        while time.monotonic() - started < 20 and shown is None:
            watch = run._rollcalls.watch
            shown = watch.stalled if watch is not None else None
            time.sleep(0.2)
        c.check(
            "the stall banner shows for gloo ranks waiting in a collective",
            "within 20 s",
            None if shown is None else f"{time.monotonic() - started:.1f} s",
            shown is not None,
        )
        c.fact("roll-call", str(shown or run.stacks())[:1200])
    finally:
        run.stop()
    c.fact(
        "NCCL ranks spinning in a collective (F2 on a GPU)",
        "needs two NCCL ranks: 2 GPUs, or NCCL 2.30+ on one (section 7 says which)",
    )


def _spin_share() -> float:
    """CPU time a process uses while its main thread waits on a 2 s GPU kernel."""
    import torch

    hz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 1_980_000) * 1000
    torch.cuda._sleep(int(hz * 2))
    before_cpu, before = time.process_time(), time.monotonic()
    torch.cuda.synchronize()
    return (time.process_time() - before_cpu) / max(1e-6, time.monotonic() - before)


def waits_in_all_reduce(marks: str) -> None:
    import torch
    import torch.distributed as dist

    import nbddp

    if nbddp.rank() == 1:
        time.sleep(60)  # elsewhere: the run is stopped long before
    t = torch.ones(4, device=nbddp.device())
    Path(marks, str(nbddp.rank())).touch()
    dist.all_reduce(t)


# -- 4. a one-rank NCCL session ----------------------------------------------------------------


def nccl_session(c: Check) -> None:
    import nbddp

    baseline = memory_used()
    with nbddp.Session(num_workers=1, device=c.device) as session:
        facts = session.run(in_a_nccl_rank, display="none")
        apps = compute_apps()
    c.fact("the rank", facts)
    c.fact("processes holding a CUDA context while the session lived", apps)
    expected_backend = "nccl" if c.gpu else "gloo"
    c.check("backend", expected_backend, facts["backend"], facts["backend"] == expected_backend)
    c.check(
        "F1: the roll-call's recorder names the NCCL all_reduce",
        "all_reduce",
        facts["collectives"],
        "all_reduce" in facts["collectives"],
    )
    c.check(
        "F16: barrier() does not warn about the device",
        [],
        facts["warnings"],
        not facts["warnings"],
    )
    if apps is not None:
        pids = [pid for pid, _ in apps]
        c.check(
            "one CUDA context, the rank's (none for the kernel or the helper)",
            [facts["pid"]],
            pids,
            pids == [facts["pid"]],
        )
    seconds, now = memory_back(baseline, 15)
    c.check(
        "GPU memory back after close()",
        "within 15 s",
        f"{seconds} s ({now} MiB)",
        c.on_gpu(seconds is not None),
    )


def in_a_nccl_rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import nbddp
    from nbddp.worker.diagnosis.stacks import recent_collectives

    t = torch.ones(1024, device=nbddp.device())
    dist.all_reduce(t)
    if t.is_cuda:
        torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.barrier()
    return {
        "backend": dist.get_backend(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "device": str(nbddp.device()),
        "pid": os.getpid(),
        "collectives": [c.op for c in recent_collectives()[0]],
        "warnings": [str(w.message)[:120] for w in caught if "device" in str(w.message)],
    }


# -- 5. the one-rank run in the kernel ---------------------------------------------------------

KEPT: list[Any] = []


def in_kernel(c: Check) -> None:
    import weakref

    import torch
    import torch.distributed as dist

    import nbddp

    state = nbddp.notebook_launch(a_state_dict, num_workers=1, device=c.device, display="none")
    places = sorted({str(t.device) for t in state.values()})
    c.check("F14: a state_dict comes back on the CPU", ["cpu"], places, places == ["cpu"])
    before = torch.cuda.memory_allocated() if c.gpu else None
    kept: Any = None
    try:
        nbddp.notebook_launch(allocates_then_raises, num_workers=1, device=c.device, display="none")
    except nbddp.WorkerError as error:
        kept = error  # as IPython keeps sys.last_value
    c.fact("the error kept", str(kept).splitlines()[0] if kept is not None else None)
    gc.collect()
    alive = KEPT[-1]() is not None if KEPT and isinstance(KEPT[-1], weakref.ref) else None
    after = torch.cuda.memory_allocated() if c.gpu else None
    c.check(
        "F6: a failed run gives fn's memory back though the error is kept",
        "fn's tensor freed",
        f"alive={alive}, allocated {before} -> {after}",
        alive is False and (not c.gpu or after <= (before or 0) + 2**20),
    )
    del kept
    c.check(
        "the world is undone",
        "no group, no RANK",
        (dist.is_initialized(), os.environ.get("RANK")),
        not dist.is_initialized() and "RANK" not in os.environ,
    )
    if c.gpu and torch.cuda.device_count() < 2:
        c.fact("F4 (gpus=[1] in the kernel)", "needs 2 GPUs: tests/test_gpu.py has its test")


def a_state_dict() -> Any:
    import torch

    import nbddp

    return torch.nn.Linear(64, 64).to(nbddp.device()).state_dict()


def allocates_then_raises() -> None:
    import weakref

    import torch

    import nbddp

    activations = torch.ones(256 * 2**20 // 4, device=nbddp.device())  # 256 MiB
    KEPT.append(weakref.ref(activations))
    raise RuntimeError("out of memory (as the retry's first attempt)")


# -- 6. memory after Stop and after SIGKILL ----------------------------------------------------


def stop_and_kill(c: Check) -> None:
    import nbddp

    marks = Path(tempfile.mkdtemp())
    baseline = memory_used()
    run = nbddp.notebook_launch(holds_memory_and_loads, (str(marks),), **c.two_ranks(), block=False)
    ready = wait_for(marks / "1", 60) and wait_for(marks / "0", 10)
    run_id = (marks / "0").read_text() if ready else ""
    c.fact("GPU memory used by the 2 ranks (MiB)", (memory_used() or 0) - (baseline or 0))
    asked = time.monotonic()
    run.stop()
    run.wait(30)
    c.check(
        "Stop ends the run",
        "within 10 s",
        f"{time.monotonic() - asked:.1f} s",
        time.monotonic() - asked < 10,
    )
    time.sleep(0.5)
    left = run_processes("NBDDP_RUN_ID", run_id) if run_id else ["no run id"]
    c.check("no process of the run is left (DataLoader workers included)", [], left, not left)
    seconds, now = memory_back(baseline, 15)
    c.check(
        "GPU memory back after Stop",
        "within 15 s",
        f"{seconds} s ({now} MiB)",
        c.on_gpu(seconds is not None),
    )
    (marks / "1").unlink()
    run = nbddp.notebook_launch(waits_on_the_gpu, (str(marks),), **c.two_ranks(), block=False)
    if not wait_for(marks / "1", 60):
        c.check("rank 1 started", "its pid", None, False)
        run.stop()
        return
    time.sleep(1)
    killed = time.monotonic()
    os.kill(int((marks / "1").read_text()), signal.SIGKILL)
    try:
        run.result(timeout=30)
        said = "no error"
    except nbddp.WorkerError as error:
        said = str(error).splitlines()[0][:160]
    except Exception as error:
        said = f"{type(error).__name__}: {error}"[:160]
    c.check(
        "SIGKILL of rank 1: a typed error at once",
        "WorkerError naming SIGKILL within 5 s",
        f"{time.monotonic() - killed:.1f} s: {said}",
        "SIGKILL" in said and time.monotonic() - killed < 5,
    )
    seconds, now = memory_back(baseline, 15)
    c.check(
        "GPU memory back after the SIGKILL",
        "within 15 s",
        f"{seconds} s ({now} MiB)",
        c.on_gpu(seconds is not None),
    )


def holds_memory_and_loads(marks: str) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import nbddp

    size = (2 * GIB if nbddp.device().type == "cuda" else 32 * 2**20) // 4
    held = torch.ones(size, device=nbddp.device())
    loader = DataLoader(TensorDataset(torch.arange(10_000)), batch_size=8, num_workers=2)
    Path(marks, str(nbddp.rank())).write_text(os.environ["NBDDP_RUN_ID"])
    while True:
        for (batch,) in loader:
            held[: len(batch)] += 1


def waits_on_the_gpu(marks: str) -> None:
    import torch

    import nbddp

    Path(marks, str(nbddp.rank())).write_text(str(os.getpid()))
    while True:
        if nbddp.device().type == "cuda":
            torch.cuda._sleep(10**8)
            torch.cuda.synchronize()
        else:
            time.sleep(0.1)


# -- 7. two NCCL ranks on one GPU --------------------------------------------------------------


def nccl_two_ranks(c: Check) -> None:
    import nbddp
    from nbddp import planning
    from nbddp.devices import MULTI_RANK_NCCL, nccl_version, version_text

    version = nccl_version() if c.gpu else (2, 28, 9)
    c.fact("NCCL loaded", version_text(version))
    if version is None or version < MULTI_RANK_NCCL or not c.gpu:
        if not c.gpu:
            planning.nccl_version = lambda: (2, 28, 9)  # type: ignore[assignment]
        try:
            planning.make_plan(gpus=[0, 0], device="cuda", gpu_count=1)
            said = "allowed"
        except ValueError as error:
            said = str(error)
        c.check(
            "the refusal names the NCCL in use",
            version_text(version),
            said[:200],
            version_text(version) in said,
        )
        if c.gpu:
            return
        planning.nccl_version = lambda: (2, 30, 7)  # type: ignore[assignment]
        plan = planning.make_plan(gpus=[0, 0], device="cuda", gpu_count=1)
        c.check(
            "NCCL 2.30+: allowed, told to NCCL",
            "NCCL_MULTI_RANK_GPU_ENABLE=1",
            dict(plan.env),
            plan.env.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1",
        )
    ranks = (
        {"device": "cuda", "gpus": [0, 0], "display": "none"}
        if c.gpu
        else {"device": "cpu", "num_workers": 2, "display": "none"}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sums = nbddp.notebook_launch(a_ddp_step, **ranks, return_all=True, timeout=60)
    c.check(
        "all_reduce and a DDP step",
        [3.0, 3.0],
        [s[0] for s in sums],
        [s[0] for s in sums] == [3.0, 3.0],
    )
    c.fact("backend, warning", (sums[0][1], [str(w.message)[:100] for w in caught]))
    started = time.monotonic()
    try:
        nbddp.notebook_launch(asks_5_s, **ranks, timeout=60)
        said = "no error"
    except nbddp.WorkerError as error:
        said = str(error).splitlines()[0][:200]
    took = time.monotonic() - started
    c.check(
        "F3: the asked 5 s timeout fails the run",
        "collective timed out after 5 s, < 25 s",
        f"{took:.1f} s: {said}",
        "collective timed out after 5 s" in said and took < 25,
    )
    started = time.monotonic()
    values = nbddp.notebook_launch(returns_right_after, **ranks, return_all=True, timeout=60)
    c.check(
        "F8: a rank returning right after its all_reduce does not hang its peer",
        "[2.0, 2.0] in < 20 s",
        f"{values} in {time.monotonic() - started:.1f} s",
        values == [2.0, 2.0],
    )


def a_ddp_step() -> tuple[float, str]:
    import torch
    import torch.distributed as dist

    import nbddp

    t = torch.ones(1, device=nbddp.device()) * (nbddp.rank() + 1)
    dist.all_reduce(t)
    model = nbddp.prepare_model(torch.nn.Linear(8, 1))
    model(torch.randn(4, 8, device=nbddp.device())).sum().backward()
    return float(t.item()), dist.get_backend()


def asks_5_s() -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import nbddp

    dist.init_process_group(dist.get_backend(), timeout=timedelta(seconds=5))
    if nbddp.rank() == 1:
        time.sleep(40)
    t = torch.ones(1, device=nbddp.device())
    dist.all_reduce(t)
    t.item()


def returns_right_after() -> float:
    import torch
    import torch.distributed as dist

    import nbddp

    if nbddp.rank() == 1:
        time.sleep(3)
    t = torch.ones(1, device=nbddp.device())
    dist.all_reduce(t)
    return 2.0 if nbddp.rank() == 0 else float(t.item())  # rank 0 returns, not waiting


# -- 8. TF32 carried ---------------------------------------------------------------------------


def tf32_carried(c: Check) -> None:
    import torch

    import nbddp

    size = 4096 if c.gpu else 256
    torch.set_float32_matmul_precision("high")
    try:
        kernel = matmuls(size)
        ranks = nbddp.notebook_launch(precision_and_time, (size,), **c.two_ranks(), return_all=True)
    finally:
        torch.set_float32_matmul_precision("highest")
    c.check(
        "F7: the ranks use the kernel's matmul precision",
        ["high", "high"],
        [r[0] for r in ranks],
        [r[0] for r in ranks] == ["high", "high"],
    )
    c.fact(
        "20 fp32 matmuls: kernel alone, each of 2 ranks sharing the device (s)",
        (round(kernel, 4), [round(r[1], 4) for r in ranks]),
    )


def matmuls(size: int) -> float:
    import torch

    import nbddp

    device = (
        nbddp.device()
        if nbddp.world_size() > 1
        else (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    )
    a = torch.randn(size, size, device=device)
    a @ a
    if a.is_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        a = a @ a / size
    if a.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def precision_and_time(size: int) -> tuple[str, float]:
    import torch

    return torch.get_float32_matmul_precision(), matmuls(size)


# -- 9. time to the first GPU step -------------------------------------------------------------


def first_step(c: Check) -> None:
    """Like for like: two ranks sharing GPU 0 with gloo (NCCL 2.28 refuses two ranks on one
    GPU), each taking one DDP step, under nbddp (warm launches, and a session) and under
    torchrun (cold, as a script is)."""
    import nbddp

    marks = Path(tempfile.mkdtemp())
    launches = []
    nbddp.notebook_launch(one_step, (str(marks / "warmup"),), **c.two_ranks())
    for i in range(3):
        called = time.time()
        nbddp.notebook_launch(one_step, (str(marks / f"l{i}"),), **c.two_ranks())
        launches.append(float((marks / f"l{i}").read_text()) - called)
    c.fact(
        "warm launch of 2 ranks to the first DDP step (s, each of 3)",
        [round(t, 3) for t in launches],
    )
    opened = time.time()
    session_options = {k: v for k, v in c.two_ranks().items() if k != "display"}
    with nbddp.Session(**session_options) as session:
        session.run(one_step, (str(marks / "s1"),), display="none")
        first = float((marks / "s1").read_text()) - opened
        called = time.time()
        session.run(one_step, (str(marks / "s2"),), display="none")
        again = float((marks / "s2").read_text()) - called
    c.fact(
        "a 2-rank session: start to the first DDP step, a later task's step (s)",
        (round(first, 3), round(again, 3)),
    )
    script = marks / "step.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "from gpu_check_sections import one_step\n"
        f"one_step(sys.argv[1], {c.device!r})\n"
    )
    cold = []
    for i in range(2):
        called = time.time()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                str(script),
                str(marks / f"t{i}"),
            ],
            capture_output=True,
            timeout=45,
            check=True,
        )
        cold.append(float((marks / f"t{i}").read_text()) - called)
    c.fact(
        "torchrun --nproc-per-node=2 (gloo, GPU 0), cold, to the first DDP step (s, each of 2)",
        [round(t, 3) for t in cold],
    )
    c.check(
        "a warm launch reaches the first step before a cold torchrun",
        "faster",
        f"{statistics.median(launches):.2f} s against {statistics.median(cold):.2f} s",
        c.on_gpu(statistics.median(launches) < statistics.median(cold)),
    )


def one_step(mark: str, on: str | None = None) -> None:
    """One DDP step on this rank's device (nbddp's, or ``on`` under torchrun: both ranks on
    GPU 0), then rank 0 writes when."""
    import torch
    import torch.distributed as dist

    import nbddp

    device = torch.device(on) if on else nbddp.device()
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    model = torch.nn.parallel.DistributedDataParallel(model.to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model(torch.randn(64, 512, device=device)).sum().backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        Path(mark).write_text(repr(time.time()))


# -- 10. a %%ddp cell in a real kernel ---------------------------------------------------------


def ddp_cell(c: Check) -> None:
    try:
        from jupyter_client.manager import start_new_kernel
    except ImportError:
        c.fact(
            "kernel packages",
            "not here: stage them with benchmarks/gpu_wheels.sh and carry "
            "'.whl' (the section needs IPython, ipykernel, jupyter_client)",
        )
        c.check("a %%ddp cell on the device", "a kernel", "none", None)
        return
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        cell = (
            (
                "%%ddp -n 1 --device cuda\nx = torch.ones(3, device=nbddp.device()) * 2\n"
                "(str(x.device), float(x.sum()))\n"
            )
            if c.gpu
            else (
                "%%ddp -n 2 --device cpu --display none\nx = torch.ones(3) * (nbddp.rank() + 1)\n"
                "(str(x.device), float(x.sum()))\n"
            )
        )
        outputs = []
        for code in ("import torch, nbddp\n%load_ext nbddp", cell):
            reply = client.execute_interactive(code, timeout=30, output_hook=outputs.append)
            if reply["content"]["status"] != "ok":
                c.check("the cell ran", "ok", reply["content"], False)
                return
        shown = " ".join(
            str(m["content"].get("data", {}).get("text/plain", ""))
            + str(m["content"].get("text", ""))
            for m in outputs
        )
        expected = "('cuda:0', 6.0)" if c.gpu else "('cpu', 3.0)"
        c.check("the %%ddp cell's value", expected, shown[-300:], expected in shown)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


# -- 11. launch latency as CPU ranks grow ------------------------------------------------------


def cpu_scaling(c: Check) -> None:
    import nbddp

    sizes = [2, 4, 8, 16] if (os.cpu_count() or 1) * 4 >= 16 else [2, 4]
    rows = {}
    for n in sizes:
        nbddp.notebook_launch(where_is_the_rank, num_workers=n, device="cpu", display="none")
        times = []
        for _ in range(3):
            started = time.perf_counter()
            nbddp.notebook_launch(reduces, num_workers=n, device="cpu", display="none")
            times.append(time.perf_counter() - started)
        rows[n] = round(statistics.median(times), 3)
    c.fact("warm launch of a trivial all_reduce, by CPU ranks (s, median of 3)", rows)
    c.check("16 ranks launch", "a time", rows.get(16), c.on_gpu(16 in rows))


def reduces() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


SECTIONS = {
    0: environment,
    1: gpu_tests,
    2: helper_imports,
    3: stall_banner,
    4: nccl_session,
    5: in_kernel,
    6: stop_and_kill,
    7: nccl_two_ranks,
    8: tf32_carried,
    9: first_step,
    10: ddp_cell,
    11: cpu_scaling,
}


def run_one(number: int, out: Path, rehearsal: bool) -> int:
    """Section ``number``, its result written as ``section-N.json`` in ``out``."""
    check = Check(gpu=not rehearsal, out=out)
    error = None
    try:
        SECTIONS[number](check)
    except BaseException:
        error = traceback.format_exc()
    result = {"facts": check.facts, "checks": check.checks, "error": error}
    (out / f"section-{number}.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str)[:4000], flush=True)
    return 0 if error is None else 1
