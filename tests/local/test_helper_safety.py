"""The warm helper stays safe to fork whatever it is asked to import: a module whose import
starts a thread (Python's or a native one), initialises CUDA, starts the CUDA driver or starts a
process makes it fork no more, and the starter replaces it with a fresh helper that never
imports that module. Loading the driver's library, or asking NVML (which opens the GPU and
starts a thread), leaves forks able to use CUDA (measured on an H200, #44): those it keeps."""

from __future__ import annotations

import _bisect
import os
import shutil

import psutil
import pytest
from conftest import wait_until

from nbddp.local.forkserver import WarmStarter
from nbddp.local.helper import Helper

# Each probe does at import what a library might, and the reason the helper must give.
PROBES = {
    "thread": (
        "import threading\n"
        "threading.Thread(target=threading.Event().wait, name='poller', daemon=True).start()\n",
        "it started a thread (poller)",
    ),
    "native_thread": (  # faulthandler's watchdog is a C thread that threading cannot see
        "import faulthandler, sys\nfaulthandler.dump_traceback_later(3600, file=sys.stderr)\n",
        "it started a native thread",
    ),
    "cuda_initialised": (  # what torch.cuda's lazy init leaves (no GPU needed to see it)
        "import torch.cuda\ntorch.cuda._initialized = True\n",
        "it initialised CUDA",
    ),
    "process": (  # a child that ends when the helper's end of its stdin closes
        "import subprocess, sys\n"
        "CHILD = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
        " stdin=subprocess.PIPE)\n",
        "it started a process",
    ),
}


@pytest.fixture
def probes(tmp_path):
    """Every probe as a module ``nbddp_unsafe_<kind>`` in ``tmp_path``."""
    for kind, (text, _) in PROBES.items():
        (tmp_path / f"nbddp_unsafe_{kind}.py").write_text(text)
    return tmp_path


def imports(helper: Helper, module: str, path: str) -> None:
    """Ask ``helper`` to import ``module`` and wait until it says nothing is left to import."""
    helper.preloaded.clear()
    helper.preload([module], [path], [])
    assert helper.preloaded.wait(120) and helper.alive(), "the helper never finished importing"


@pytest.mark.ranks
@pytest.mark.parametrize("kind", list(PROBES))
def test_a_module_that_makes_forking_unsafe_stops_the_helpers_forks(probes, kind):
    (probes / "noop.py").write_text("")
    helper = Helper()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        assert helper.ready.wait(120), "the helper never became ready"
        assert helper.usable()
        imports(helper, f"nbddp_unsafe_{kind}", str(probes))
        assert helper.unsafe == (f"nbddp_unsafe_{kind}", PROBES[kind][1])
        assert not helper.usable()  # the starter replaces it before the next launch
        with pytest.raises(OSError, match="cannot fork safely"):
            for _ in range(17):  # past the children forked before the import (at most 16)
                helper.spawn([str(probes / "noop.py")], {}, devnull, devnull)
    finally:
        os.close(devnull)
        helper.close()


@pytest.mark.ranks
def test_the_starter_replaces_an_unsafe_helper_with_one_that_never_imports_the_module(probes):
    starter = WarmStarter()
    starter.prestart()
    first, second = starter.helper, None
    assert first is not None and first.ready.wait(120)
    try:
        threads = psutil.Process(first.process.pid).num_threads()
        imports(first, "nbddp_unsafe_native_thread", str(probes))
        assert first.unsafe is not None
        starter.prestart()  # what the next cell's end or launch does
        second = starter.helper
        assert second is not None and second is not first and not first.alive()
        assert starter.excluded == {"nbddp_unsafe_native_thread": "it started a native thread"}
        assert second.ready.wait(120)
        imports(second, "nbddp_unsafe_native_thread", str(probes))  # asked again: refused
        assert second.usable()
        # a thread of its own may come and go as it imports between launches; the module's
        # native thread would stay
        assert wait_until(lambda: psutil.Process(second.process.pid).num_threads() <= threads, 30)
        with pytest.warns(UserWarning, match="no longer preloads nbddp_unsafe_native_thread"):
            starter.warm_up()
    finally:
        for helper in (first, second):
            if helper is not None:
                helper.close()


def forks_and_answers(helper: Helper, folder, code: str) -> str:
    """A child forked by ``helper`` runs ``code`` (which sets ``answer``); what it answered."""
    script, answer = folder / "child.py", folder / "answer"
    script.write_text(f"{code}\nimport sys\nopen(sys.argv[1], 'w').write(str(answer))\n")
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        child = helper.spawn([str(script), str(answer)], dict(os.environ), devnull, devnull)
        assert wait_until(lambda: child.exitcode() is not None, 120), "the child never ended"
        child.release()
    finally:
        os.close(devnull)
    return answer.read_text() if answer.exists() else f"no answer (exit {child.exitcode()})"


@pytest.mark.ranks
def test_a_module_that_loads_the_cuda_drivers_library_keeps_the_helper(tmp_path):
    """Loading libcuda starts nothing (torch 2.11 loads it at import on a machine with a
    driver, and the first GPU check's ranks forked after it reached the GPU): the helper keeps
    forking. Here the library is a stand-in with the driver's name (a copy of a harmless one)."""
    shutil.copy(_bisect.__file__, tmp_path / "libcuda.so.1")
    (tmp_path / "nbddp_loads_libcuda.py").write_text(
        "import ctypes, os\n"
        "DRIVER = ctypes.CDLL(os.path.join(os.path.dirname(__file__), 'libcuda.so.1'))\n"
    )
    helper = Helper()
    try:
        assert helper.ready.wait(120), "the helper never became ready"
        imports(helper, "nbddp_loads_libcuda", str(tmp_path))
        assert helper.unsafe is None and helper.usable()
        code = "import nbddp_loads_libcuda\nanswer = 'forked'"
        assert forks_and_answers(helper, tmp_path, code) == "forked"
    finally:
        helper.close()


GPU_IMPORTS = {  # what a module does at import: whether the helper keeps it
    "nvml": ("import torch\nCOUNT = torch.cuda.device_count()\n", None),
    "cuinit": (
        "import ctypes\nctypes.CDLL('libcuda.so.1').cuInit(0)\n",
        "it started the CUDA driver (cuInit)",
    ),
}


@pytest.mark.ranks
@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(GPU_IMPORTS))
def test_nvml_at_import_keeps_the_helper_and_the_drivers_start_does_not(tmp_path, kind):
    """On a GPU: a module-level ``torch.cuda.device_count()`` (NVML: the GPU opened, a native
    thread) keeps the helper, whose forks then reach the GPU; a module that starts the CUDA
    driver is refused, named for it."""
    text, refused = GPU_IMPORTS[kind]
    (tmp_path / f"nbddp_gpu_{kind}.py").write_text(text)
    helper = Helper()
    try:
        assert helper.ready.wait(120), "the helper never became ready"
        imports(helper, f"nbddp_gpu_{kind}", str(tmp_path))
        if refused is not None:
            assert helper.unsafe is not None and helper.unsafe[1].startswith(refused)
            return
        assert helper.unsafe is None and helper.usable()
        code = "import torch\nanswer = torch.ones(1, device='cuda').device"
        assert forks_and_answers(helper, tmp_path, code) == "cuda:0"
    finally:
        helper.close()


@pytest.mark.unit
def test_the_gpu_files_a_process_holds_are_read_from_its_descriptors(tmp_path):
    """What ``cuInit`` (or NVML) leaves: descriptors on ``/dev/nvidia*``, told apart from the
    rest (the links need no GPU: a descriptor directory is a folder of symbolic links)."""
    from nbddp.worker.helper.preload import gpu_files

    for fd, target in enumerate(["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/null", "/tmp/x"]):
        os.symlink(target, tmp_path / str(fd))
    assert gpu_files(str(tmp_path)) == {"/dev/nvidiactl", "/dev/nvidia-uvm"}
    assert gpu_files(str(tmp_path / "gone")) == set()


@pytest.mark.unit
def test_an_import_that_asked_nvml_is_kept_and_one_that_started_the_driver_is_named(monkeypatch):
    """#44's first GPU check: the helper refused a module with "it started a native thread" (a
    module-level ``torch.cuda.device_count()``: NVML opened the GPU and started a thread, and a
    child forked after it still reached the GPU, as the second check measured). Such an import
    is kept; one that started the CUDA driver is refused, named for it; a thread alone is
    refused as before."""
    from nbddp.worker.helper import preload

    monkeypatch.setattr(preload, "gpu_files", lambda: set())
    monkeypatch.setattr(preload, "driver_started", lambda libraries: False)
    monkeypatch.setattr(preload.threading, "active_count", lambda: 1)  # pytest's own threads
    safety = preload.Safety()
    threads = safety.tasks
    monkeypatch.setattr(preload, "tasks", lambda: threads + 1)
    assert safety.broken(preload.children()) == "it started a native thread"

    opened = {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"}  # what device_count() opened
    monkeypatch.setattr(preload, "gpu_files", lambda: opened)
    assert safety.broken(preload.children()) is None  # NVML's thread: kept
    assert safety.broken() is None  # and the check before each fork counts it in

    monkeypatch.setattr(preload, "driver_started", lambda libraries: True)
    reason = safety.broken(preload.children())
    assert reason is not None and reason.startswith("it started the CUDA driver (cuInit)")
    assert "torch.cuda.init()" in reason


class _Driver:
    """A stand-in for libcuda: ``cuDeviceGetCount`` answers as the real one does."""

    def __init__(self, code: int) -> None:
        self.code = code

    def cuDeviceGetCount(self, count) -> int:
        return self.code


@pytest.mark.unit
def test_the_driver_is_asked_whether_it_was_started_without_starting_it(monkeypatch):
    """``driver_started`` asks the libcuda already mapped (RTLD_NOLOAD: never a fresh load) with
    ``cuDeviceGetCount``, which answers CUDA_ERROR_NOT_INITIALIZED (3) before ``cuInit``."""
    import ctypes

    from nbddp.worker.helper import preload

    asked = []

    def loads(code):
        def load(path, mode=0):
            asked.append((path, mode))
            return _Driver(code)

        return load

    mapped = ["/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/libcuda.so.580.159.04"]
    monkeypatch.setattr(ctypes, "CDLL", loads(3))
    assert preload.driver_started(mapped) is False
    assert asked == [("/usr/lib64/libcuda.so.580.159.04", os.RTLD_NOLOAD)]
    monkeypatch.setattr(ctypes, "CDLL", loads(0))
    assert preload.driver_started(mapped) is True
    assert preload.driver_started(mapped[:1]) is False  # no libcuda: nothing was started
