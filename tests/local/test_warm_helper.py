"""What the warm helper holds between launches: what the last launch's ranks imported (so the
next launch's ranks start with it), never anything of the user's code but imports, and no more
memory or descriptors after many launches than after a few."""

from __future__ import annotations

import os

import psutil
import pytest
from conftest import TWO_CPU_QUIET, wait_until

import nbddp
from nbddp.local import forkserver

pytestmark = pytest.mark.ranks


@pytest.fixture
def ready_helper():
    """The helper, once it imported what earlier tests' ranks did (one of those may have made
    it unsafe to fork: then its successor)."""
    forkserver.prestart()
    assert forkserver.wait_until_ready(60), "the helper never became ready"
    forkserver.wait_until_preloaded(120)
    forkserver.prestart()
    assert forkserver.wait_until_ready(60), "the helper never became ready"
    return forkserver.helper_pid()


@pytest.fixture
def probe_dir(tmp_path, monkeypatch):
    """A directory on the import path (the ranks adopt it) for a test's modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def imports_at_fn(name: str) -> tuple[int, bool]:
    """Whether ``name`` was imported when fn started; then import it."""
    import importlib
    import sys

    loaded = name in sys.modules
    importlib.import_module(name)
    return os.getppid(), loaded


def test_what_a_launchs_ranks_imported_is_in_the_next_launchs_ranks(ready_helper, probe_dir):
    """Only the ranks import the module (the test process never does): each tells the helper as
    it exits, and the helper imports it before the next launch."""
    (probe_dir / "nbddp_rank_import_probe.py").write_text("VALUE = 1\n")
    launch = {**TWO_CPU_QUIET, "return_all": True, "args": ("nbddp_rank_import_probe",)}
    first = nbddp.notebook_launch(imports_at_fn, **launch)
    assert first == [(ready_helper, False)] * 2
    assert forkserver.wait_until_preloaded(120)
    second = nbddp.notebook_launch(imports_at_fn, **launch)
    assert second == [(ready_helper, True)] * 2


RECORDS = (
    "import os\n"
    "PATH = os.path.join(os.path.dirname(__file__), 'ran.txt')\n"
    "def record(what):\n"
    "    with open(PATH, 'a') as f:\n"
    "        f.write(f'{what} {os.getpid()}\\n')\n"
    "    return what\n"
    "class Unpickled:\n"
    "    def __reduce__(self):\n"
    "        return (record, ('unpickled',))\n"
    "record('imported')\n"
)


def runs_user_code(argument: str) -> tuple[int, int, str]:
    import nbddp_user_code_probe

    nbddp_user_code_probe.record("fn")
    return os.getpid(), os.getppid(), argument


def test_the_helper_imports_a_users_module_but_never_runs_fn_nor_unpickles_its_arguments(
    ready_helper, probe_dir
):
    (probe_dir / "nbddp_user_code_probe.py").write_text(RECORDS)
    import nbddp_user_code_probe as probe

    ranks: set[int] = set()
    for _ in range(2):
        out = nbddp.notebook_launch(
            runs_user_code, **TWO_CPU_QUIET, return_all=True, args=(probe.Unpickled(),)
        )
        assert [(parent, what) for _, parent, what in out] == [(ready_helper, "unpickled")] * 2
        ranks.update(pid for pid, _, _ in out)
        assert forkserver.wait_until_preloaded(120)
    ran: dict[str, set[int]] = {}
    for line in (probe_dir / "ran.txt").read_text().splitlines():
        what, pid = line.split()
        ran.setdefault(what, set()).add(int(pid))
    assert ready_helper in ran["imported"]  # the ranks' import warmed the helper: imports only
    assert ran["fn"] == ran["unpickled"] == ranks and ready_helper not in ranks


def quick() -> int:
    return os.getpid()


def settled(helper: psutil.Process) -> tuple[int, int]:
    """The helper's resident memory and open descriptors, once its ranks ended and its pool of
    children forked ahead is full again."""

    def only_the_pool() -> bool:
        try:
            children = [child.pid for child in helper.children()]
            return len(children) >= 2 and all(os.getsid(pid) == helper.pid for pid in children)
        except (psutil.Error, OSError):
            return False

    assert forkserver.wait_until_preloaded(120)
    assert wait_until(only_the_pool, timeout=30)
    return helper.memory_info().rss, helper.num_fds()


def test_the_helpers_memory_and_descriptors_stay_bounded_over_many_launches(ready_helper):
    helper = psutil.Process(ready_helper)
    for _ in range(3):  # the pool grows to the launch's size, the ranks' imports are in
        nbddp.notebook_launch(quick, **TWO_CPU_QUIET)
    memory, descriptors = settled(helper)
    for _ in range(20):
        nbddp.notebook_launch(quick, **TWO_CPU_QUIET)
    memory_after, descriptors_after = settled(helper)
    assert forkserver.helper_pid() == ready_helper
    assert descriptors_after <= descriptors + 2  # a pool child's socket more or less
    assert memory_after - memory < 8 << 20, f"grew {(memory_after - memory) >> 20} MiB"
    assert len(helper.children()) <= 16  # the pool's cap: its ranks were reaped
