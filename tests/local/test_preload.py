"""The warm helper carries what the ranks will need, as a fork launcher's ranks have it: the
modules a real kernel imported (mirrored as it imports them), never a stale local module, and
never at the price of a fork with threads."""

from __future__ import annotations

import re

import psutil
import pytest
from conftest import running

pytestmark = pytest.mark.e2e

AT_START = (
    "def at_start(*names):\n"
    "    import os, sys\n"
    "    return os.getppid(), [name in sys.modules for name in names]\n"
)


@pytest.fixture
def kernel_with(kernel_factory, tmp_path):
    """A fresh kernel whose import path has ``tmp_path``, where a test writes its modules."""
    kernels = []

    def start(**modules: str):
        for name, text in modules.items():
            (tmp_path / f"{name}.py").write_text(text)
        kernel = kernel_factory()
        kernels.append(kernel)
        out, reply = kernel.run(
            f"import os, sys, warnings\nsys.path.insert(0, {str(tmp_path)!r})\n"
            "import nbddp\nfrom nbddp.local import forkserver\n" + AT_START + "\n"
            "def launch(fn, *args):\n"
            "    return nbddp.notebook_launch(fn, num_workers=2, device='cpu', display='none',"
            " return_all=True, args=args)\n"
            "print(forkserver.wait_until_ready(60), forkserver.helper_pid())"
        )
        assert reply["status"] == "ok" and out.startswith("True"), out
        return kernel, int(out.split()[-1])

    yield start
    for kernel in kernels:
        kernel.shutdown()


def helper_pid(out: str) -> int:
    """The pid a cell printed as ``helper pid N`` (a warning's lines may come after it: the
    kernel's stderr and stdout interleave as they arrive)."""
    [pid] = re.findall(r"^helper pid (\d+)$", out, re.MULTILINE)
    return int(pid)


def launches(out: str) -> list[str]:
    """What each ``print(launch(at_start, ...))`` printed, in order."""
    return [line for line in out.splitlines() if line.startswith("[(")]


def run(kernel, code: str) -> str:
    out, reply = kernel.run(code)
    assert reply["status"] == "ok", out
    return out


def test_a_module_the_kernel_imported_is_in_the_ranks_when_fn_starts(kernel_with):
    kernel, helper = kernel_with(nbddp_mirrored_probe="VALUE = 1\n")
    run(kernel, "import nbddp_mirrored_probe, xml.dom.minidom")  # mirrored after the cell
    names = "'nbddp_mirrored_probe', 'xml.dom.minidom'"
    out = run(kernel, f"print(launch(at_start, {names}))\nprint(launch(at_start, {names}))")
    first, second = out.splitlines()[-2:]
    for launch in (first, second):  # the next launch, and already this one: asked before it
        assert launch == f"[({helper}, [True, True]), ({helper}, [True, True])]"


def last(out: str) -> str:
    return out.splitlines()[-1]


def reads_value() -> str:
    return (
        "def reads_value():\n"
        "    import sys\n"
        "    preloaded = 'nbddp_edited_probe' in sys.modules\n"
        "    import nbddp_edited_probe\n"
        "    return preloaded, nbddp_edited_probe.VALUE\n"
    )


def test_a_local_module_edited_between_launches_reaches_the_ranks_fresh(kernel_with, tmp_path):
    kernel, _ = kernel_with(nbddp_edited_probe="VALUE = 1\n")
    run(kernel, "import nbddp_edited_probe\n" + reads_value())
    assert last(run(kernel, "print(launch(reads_value))")) == "[(True, 1), (True, 1)]"
    (tmp_path / "nbddp_edited_probe.py").write_text("VALUE = 22\n")  # the kernel keeps 1
    assert last(run(kernel, "print(launch(reads_value))")) == "[(False, 22), (False, 22)]"
    out = run(kernel, "print(forkserver.wait_until_preloaded(60))\nprint(launch(reads_value))")
    assert out.splitlines()[-2:] == ["True", "[(True, 22), (True, 22)]"]  # the helper's is new


def test_a_module_that_starts_a_thread_at_import_gets_a_fresh_helper_without_it(kernel_with):
    kernel, first = kernel_with(
        nbddp_threaded_probe=(
            "import threading\n"
            "threading.Thread(target=threading.Event().wait, name='probe', daemon=True).start()\n"
        )
    )
    threads = psutil.Process(first).num_threads()
    run(kernel, "import nbddp_threaded_probe")
    out = run(
        kernel,
        "print(launch(at_start, 'nbddp_threaded_probe'))\n"  # served, by whichever helper
        "print(launch(at_start, 'nbddp_threaded_probe'))\n"
        "print('helper pid', forkserver.helper_pid())",
    )
    assert "no longer preloads nbddp_threaded_probe: it started a thread (probe)" in out
    second = helper_pid(out)
    assert second != first and not running(first)  # the unsafe one is gone
    assert launches(out)[-1] == f"[({second}, [False]), ({second}, [False])]"
    assert psutil.Process(second).num_threads() <= threads  # no thread of the module's


def test_a_module_whose_import_crashes_the_helper_is_left_out_of_the_next(kernel_with):
    kernel, first = kernel_with(
        nbddp_crashing_probe=(
            "import os\nif os.environ.get('NBDDP_WORKER') == 'helper':\n    os.abort()\n"
        )
    )
    run(kernel, "import nbddp_crashing_probe")
    out = run(
        kernel,
        "print(launch(at_start, 'nbddp_crashing_probe'))\n"
        "print(launch(at_start, 'nbddp_crashing_probe'))\n"
        "print('helper pid', forkserver.helper_pid())",
    )
    assert "no longer preloads nbddp_crashing_probe: the helper crashed importing it" in out
    second = helper_pid(out)
    assert second != first
    assert launches(out)[-1] == f"[({second}, [False]), ({second}, [False])]"


def test_lightning_imported_by_the_helper_still_knows_each_ranks_rank(kernel_with):
    """Lightning reads the rank from the environment when it is imported, and the helper
    imported it where no rank is set: each rank sets it anew, as a fresh import would."""
    kernel, helper = kernel_with()
    run(kernel, "import lightning.fabric.utilities.rank_zero")
    out = run(
        kernel,
        "def rank_zero_rank():\n"
        "    from lightning_utilities.core.rank_zero import rank_zero_only\n"
        "    return rank_zero_only.rank\n"
        "print(launch(at_start, 'lightning.fabric'))\nprint(launch(rank_zero_rank))",
    )
    assert out.splitlines()[-2:] == [f"[({helper}, [True]), ({helper}, [True])]", "[0, 1]"]


def test_a_module_whose_import_hangs_the_helper_is_left_out_of_the_next(kernel_with):
    kernel, first = kernel_with(
        nbddp_hanging_probe=(
            "import os, time\nif os.environ.get('NBDDP_WORKER') == 'helper':\n    time.sleep(60)\n"
        )
    )
    run(kernel, "from nbddp.local import helper\nhelper.IMPORT_WAIT = 3.0")
    run(kernel, "import nbddp_hanging_probe")
    out = run(
        kernel,
        "print(launch(at_start, 'nbddp_hanging_probe'))\n"  # its ranks start cold
        "print(launch(at_start, 'nbddp_hanging_probe'))\n"
        "print('helper pid', forkserver.helper_pid())",
    )
    assert "no longer preloads nbddp_hanging_probe: the helper hung importing it" in out
    second = helper_pid(out)
    assert second != first and not running(first)
    assert launches(out)[-1] == f"[({second}, [False]), ({second}, [False])]"


def test_a_module_named_in_nbddp_preload_exclude_and_matplotlib_are_left_to_the_ranks(
    kernel_with,
):
    """A module whose import must not be repeated in the helper is named in the variable (set
    in any cell before the import); matplotlib is never preloaded (it reads the backend nbddp
    sets for ranks at import). A module imported beside them still is."""
    kernel, helper = kernel_with(nbddp_excluded_probe="", nbddp_kept_probe="")
    run(
        kernel,
        "os.environ['NBDDP_PRELOAD_EXCLUDE'] = 'nbddp_excluded_probe'\n"
        "import nbddp_excluded_probe, nbddp_kept_probe, matplotlib.pyplot",
    )
    names = "'nbddp_excluded_probe', 'nbddp_kept_probe', 'matplotlib'"
    out = run(kernel, f"print(launch(at_start, {names}))")
    assert last(out) == f"[({helper}, [False, True, False]), ({helper}, [False, True, False])]"
