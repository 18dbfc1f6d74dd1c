"""The warm helper stays safe to fork whatever it is asked to import: a module whose import
starts a thread (Python's or a native one), initialises CUDA, loads the CUDA driver or starts a
process makes it fork no more, and the starter replaces it with a fresh helper that never
imports that module."""

from __future__ import annotations

import _bisect
import os
import shutil

import psutil
import pytest
from conftest import wait_until

from nbddp.local.forkserver import WarmStarter
from nbddp.local.helper import Helper

pytestmark = pytest.mark.ranks

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
    "cuda_driver": (  # a library named as the driver is (a copy of a harmless one)
        "import ctypes, os\n"
        "DRIVER = ctypes.CDLL(os.path.join(os.path.dirname(__file__), 'libcuda.so.1'))\n",
        "it loaded the CUDA driver",
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
    shutil.copy(_bisect.__file__, tmp_path / "libcuda.so.1")
    for kind, (text, _) in PROBES.items():
        (tmp_path / f"nbddp_unsafe_{kind}.py").write_text(text)
    return tmp_path


def imports(helper: Helper, module: str, path: str) -> None:
    """Ask ``helper`` to import ``module`` and wait until it says nothing is left to import."""
    helper.preloaded.clear()
    helper.preload([module], [path], [])
    assert helper.preloaded.wait(120) and helper.alive(), "the helper never finished importing"


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
