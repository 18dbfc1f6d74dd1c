"""The shape of the package: its modules import each other without a cycle, the worker side
never needs the kernel side, and the public names are the contract's."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nbddp

PACKAGE = Path(nbddp.__file__).parent

# What each part of the package may import besides itself: the architecture as a table. A part
# is a folder (``local``, ``wire``, ...) or a top-level module (``plan``, ``run``, ...). The rank
# side (``worker``) stands on the wire alone; ``notebook`` is the face and may use anything.
ALLOWED = {
    "errors": set(),
    # the GPUs a launch can name, read without a CUDA context; NCCL's release
    "devices": set(),
    "environment": {"devices"},
    "interrupts": set(),
    "recovery": set(),
    "wire": {"errors"},
    "worker": {"wire", "errors"},
    "backend": {"wire"},
    "diagnosis": {"wire", "errors"},
    # a run's model, read by every view and kept by a detached run's headless supervisor
    "state": {"backend", "diagnosis", "wire", "errors"},
    "display": {"state", "wire", "errors"},
    "rules": {"backend", "state", "interrupts", "recovery", "wire", "errors"},
    # the plan's data: a cluster only as a type (imported under TYPE_CHECKING)
    "plan": {"environment", "recovery", "wire"},
    # options checked and resolved into a plan: every ValueError of a launch
    "planning": {"clusters", "devices", "environment", "plan", "recovery", "wire"},
    "run": {"backend", "diagnosis", "display", "interrupts", "plan", "state", "errors"},
    "local": {
        "backend",
        "devices",
        "environment",
        "errors",
        "interrupts",
        "plan",
        "recovery",
        "state",
        "wire",
        "worker",
    },
    "clusters": {
        "backend",
        "display",
        "environment",
        "errors",
        "interrupts",
        "local",
        "plan",
        "wire",
        "worker",
    },
    # where the ranks of a plan run: this machine or a cluster's nodes
    "ranks": {"backend", "clusters", "local", "plan", "wire"},
    # a launch's backend over any Ranks, judged by the referee
    "supervised": {"backend", "errors", "interrupts", "plan", "rules", "wire"},
    # runs that outlive the kernel: a supervisor hosting the one launch path (ranks.ranks_for
    # and Supervised), its record, the kernels that follow it
    "detached": {
        "backend",
        "clusters",
        "environment",
        "errors",
        "interrupts",
        "local",
        "plan",
        "planning",  # attach()'s display option, as a launch reads it
        "ranks",
        "run",
        "state",
        "supervised",
        "wire",
    },
    "launch": {
        "backend",
        "detached",
        "interrupts",
        "local",
        "plan",
        "planning",
        "ranks",
        "recovery",
        "run",
        "supervised",
        "wire",
        "worker",
    },
    # ranks reached through ranks.ranks_for alone: never local/ or clusters/ (a test below)
    "sessions": {
        "backend",
        "diagnosis",
        "errors",
        "launch",
        "plan",
        "planning",
        "ranks",
        "recovery",  # a task's stop_grace default, as a launch's
        "rules",
        "run",
        "scripts",  # Session.run_script checks and reads a script as run_script does
        "wire",
        "worker",
    },
    # a script as it is (run_script): checked and read here, run as a launch's function
    "scripts": {"errors", "interrupts", "launch", "plan", "planning", "recovery", "worker"},
    # a launch as a script: no engine; the script's runner uses the rank side where installed
    "exporting": {"plan", "planning", "recovery", "wire", "worker", "errors"},
    "notebook": None,  # the IPython face: anything
    "nbddp": {"errors", "worker", "launch", "local", "notebook"},  # __init__ (+ lazy names)
}
# What a rank or the pre-warmed helper must never load (checked in a fresh interpreter).
KERNEL_SIDE = tuple(
    f"nbddp.{part}" for part in ALLOWED if part not in ("errors", "wire", "worker", "nbddp")
)


def part_of(module: str) -> str:
    """``nbddp.local.group`` -> ``local``; ``nbddp.plan`` -> ``plan``; ``nbddp`` -> ``nbddp``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "nbddp"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, except what sits under ``if TYPE_CHECKING:`` (never imported at run time)."""
    nodes, pending = [], [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            pending.extend(node.orelse)
            continue
        nodes.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return nodes


def imports_of(name: str) -> set[str]:
    """Every nbddp module ``name`` imports at run time, at the top or inside a function.
    ``from pkg import module`` counts as importing the module (the package's own init runs
    for any of its modules, so it is no edge of its own)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            submodules = [f"{prefix}.{alias.name}" for alias in node.names]
            targets = [t for t in submodules if t in MODULES] or [prefix]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


@pytest.mark.unit
def test_the_module_graph_has_no_cycle():
    cycles = cycles_in(GRAPH)
    assert not cycles, "import cycle: " + " -> ".join(cycles[0])


@pytest.mark.unit
def test_every_part_imports_only_what_the_table_allows():
    wrong = []
    for name, targets in sorted(GRAPH.items()):
        allowed = ALLOWED.get(part_of(name), set())
        assert part_of(name) in ALLOWED, f"{name}: a new part; add it to ALLOWED"
        if allowed is None:
            continue
        wrong += [
            f"{name} -> {t}" for t in sorted(targets) if part_of(t) not in allowed | {part_of(name)}
        ]
    assert not wrong, "imports the table does not allow:\n" + "\n".join(wrong)


@pytest.mark.unit
def test_sessions_reach_their_ranks_through_the_launch_path_only():
    """Where ranks run is picked in one place (``ranks.ranks_for``), for launches and
    sessions alike: a session that imported ``local/`` or ``clusters/`` would be a second path."""
    assert not {"local", "clusters"} & ALLOWED["sessions"]
    reached = {
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if part_of(name) == "sessions"
        for target in targets
        if part_of(target) in ("local", "clusters")
    }
    assert not reached, reached
    assert "nbddp.launch" in set().union(*(GRAPH[n] for n in GRAPH if part_of(n) == "sessions"))


@pytest.mark.unit
def test_only_the_notebook_part_imports_ipythons_core():
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                mods = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else [a.name for a in node.names]
                )
                if any(m.startswith("IPython.core") for m in mods):
                    assert part_of(name) == "notebook", f"{name} imports {mods}"


@pytest.mark.unit
def test_the_table_rejects_a_forbidden_import():
    """The check above would catch a rank module importing the launcher: shown on a copy."""
    GRAPH["nbddp.worker.rank.entry"].add("nbddp.environment")
    try:
        try:
            test_every_part_imports_only_what_the_table_allows()
        except AssertionError as exc:
            assert "nbddp.worker.rank.entry -> nbddp.environment" in str(exc)
        else:
            raise AssertionError("a forbidden import passed")
    finally:
        GRAPH["nbddp.worker.rank.entry"].discard("nbddp.environment")


@pytest.mark.ranks
def test_a_rank_loads_no_kernel_module_and_importing_nbddp_starts_nothing():
    code = (
        "import sys, time, psutil\n"
        "import nbddp.worker.rank.entry, nbddp.worker.helper.server, nbddp\n"
        "nbddp.rank()\n"
        "time.sleep(0.3)\n"
        f"kernel = {KERNEL_SIDE!r} + ('IPython', 'ipywidgets')\n"
        "loaded = [m for m in sys.modules if any(m == k or m.startswith(k + '.') "
        "for k in kernel)]\n"
        "print(loaded, psutil.Process().children())\n"
    )
    # on stdin: a command line naming Slurm's modules reads as a Slurm program to the tier guard
    done = subprocess.run(
        [sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] []"


@pytest.mark.unit
def test_nbddps_own_directory_is_computed_once_for_the_rank_side():
    """Modules of ``worker/`` tell nbddp's frames from the user's by ``worker.PACKAGE_DIR``:
    one computed from a module's own depth breaks when the module moves (it did, twice)."""
    import nbddp.worker

    assert Path(nbddp.worker.PACKAGE_DIR) == PACKAGE
    own = [
        name
        for name, path in MODULES.items()
        if name.startswith("nbddp.worker.")
        and "os.path.dirname(os.path.dirname(" in path.read_text()
    ]
    assert not own, f"use nbddp.worker.PACKAGE_DIR in: {own}"


@pytest.mark.ranks
def test_a_detached_runs_supervisor_loads_no_notebook_face_and_no_display():
    """A detached run's supervisor is headless and outlives the kernel: it loads the launch
    path and the run's model (``state/``), never IPython, the panel (``display/``),
    ``notebook/`` or ``sessions/`` (its modules, the Slurm batch job's included)."""
    face = (
        "nbddp.display",
        "nbddp.notebook",
        "nbddp.sessions",
        "nbddp.run",
        "IPython",
        "ipywidgets",
    )
    code = (
        "import sys, psutil\n"
        "import nbddp.detached.supervisor, nbddp.detached.batch, nbddp.clusters.slurm.allocation\n"
        f"face = {face!r}\n"
        "loaded = [m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in face)]\n"
        "print(loaded, psutil.Process().children())\n"
    )
    # on stdin: a command line naming Slurm's modules reads as a Slurm program to the tier guard
    done = subprocess.run(
        [sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] []"


# A module's length: past PROMPT lines the test prints it, a prompt to look for a second job
# to split out when the module is next changed; past WALL it fails. A split is designed by
# concept, never made to fit a number (code parked where there was room is worse than a long
# module). A file copied whole into generated scripts is exempt from the prompt: splitting it
# would need the copy to be spliced.
PROMPT_LINES, WALL_LINES = 350, 500
COPIED_WHOLE = {"nbddp.exporting.runner"}


@pytest.mark.unit
def test_no_module_is_much_longer_than_a_screenful_or_two(capsys: pytest.CaptureFixture[str]):
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long = {name: n for name, n in lengths.items() if n > WALL_LINES}
    assert not long, f"over {WALL_LINES} lines; split these by job: {long}"
    prompts = sorted(
        (n, name) for name, n in lengths.items() if n > PROMPT_LINES and name not in COPIED_WHOLE
    )
    with capsys.disabled():
        for n, name in prompts:
            print(f"\n{name}: {n} lines (past {PROMPT_LINES}: does it hold two jobs?)", end="")


def parts_at_each_level() -> dict[str, dict[str, set[str]]]:
    """For each package, the imports between its direct parts (subpackages and modules): an
    import from ``nbddp.worker.rank.entry`` of ``nbddp.worker.debugging.asking`` is the edge
    ``rank -> debugging`` inside ``nbddp.worker``, and ``worker -> ...`` nowhere else."""
    levels: dict[str, dict[str, set[str]]] = {}
    for source, targets in GRAPH.items():
        for target in targets:
            a, b = source.split("."), target.split(".")
            common = 0
            while common < min(len(a), len(b)) and a[common] == b[common]:
                common += 1
            if common >= len(a) or common >= len(b):
                continue  # a package and a module inside it
            level = levels.setdefault(".".join(a[:common]), {})
            level.setdefault(a[common], set()).add(b[common])
    return levels


def cycles_in(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle a depth-first walk of ``edges`` meets, as the path around it."""
    found: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


@pytest.mark.unit
def test_no_cycle_between_parts_at_any_level():
    """Parts (the folders and top-level modules of ``nbddp``, and the subfolders and modules
    inside each folder) import each other without a cycle, so each can be read, and moved,
    standing only on what is below it. Imports under ``TYPE_CHECKING`` are left out."""
    cycles = [
        f"{level}: " + " -> ".join(cycle)
        for level, edges in sorted(parts_at_each_level().items())
        for cycle in cycles_in(edges)
    ]
    assert not cycles, "cycles between parts:\n" + "\n".join(cycles)


@pytest.mark.unit
def test_a_cycle_between_parts_is_caught():
    """The check above on a copy with ``plan -> clusters`` put back (the knot it untied)."""
    GRAPH["nbddp.plan"].add("nbddp.clusters.choice")
    try:
        with pytest.raises(AssertionError, match="plan -> clusters"):
            test_no_cycle_between_parts_at_any_level()
    finally:
        GRAPH["nbddp.plan"].discard("nbddp.clusters.choice")


@pytest.mark.unit
def test_the_tests_mirror_the_package():
    """A change's tests are found by its path: ``nbddp/<folder>/`` (at any depth) is tested in
    ``tests/<folder>/``; a test file at the top of ``tests/`` is about a top-level module or the
    whole package, never about a folder (``docs/`` tests the documentation site)."""
    tests = Path(__file__).parent
    folders = {
        p.parent.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE
    }
    test_folders = {
        d.relative_to(tests).as_posix()
        for d in tests.rglob("*")
        if d.is_dir() and not any(part[0] in "._" for part in d.relative_to(tests).parts)
    }
    strays = {f for f in test_folders - folders if f.split("/")[0] != "docs"}
    assert not strays, f"test folders that name no part of the package: {sorted(strays)}"
    top = {f for f in folders if "/" not in f}
    misplaced = [f.name for f in tests.glob("test_*.py") if f.stem[len("test_") :] in top]
    assert not misplaced, f"move these into the folder of the part they test: {misplaced}"
    # the test folders have no __init__.py: pytest imports a test file by its base name
    names = [f.name for f in tests.rglob("test_*.py")]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"test files with the same name in two folders (rename one): {twice}"


@pytest.mark.unit
def test_the_version_has_one_source():
    """``nbddp.__version__`` is the package's version: pyproject.toml reads it from there."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "nbddp.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", nbddp.__version__)


# The contract, as the repository carries it (``docs/API.md``, a copy of the project's shared
# ``API.md``), so that this check runs wherever the tests run.
API_MD = PACKAGE.parent / "docs" / "API.md"
SHARED_API_MD = PACKAGE.parent.parent / "shared" / "API.md"
EXTRA = {"Run", "RunStopped", "NbddpWarning"}  # the handle, the other error and warning
# Names the contract has that no landed issue has built yet; each must really be missing, so
# that building it forces this list to shrink.
PENDING: set[str] = set()


def contract_names() -> set[str]:
    return set(re.findall(r"\bnbddp\.([A-Za-z_]\w*)", API_MD.read_text()))


@pytest.mark.unit
def test_the_public_names_are_the_contracts():
    names = contract_names()
    assert {"notebook_launch", "Session", "WorkerError"} <= names  # the reading works
    missing = {n for n in names - PENDING if not hasattr(nbddp, n)}
    assert not missing, f"API.md names that nbddp lacks: {sorted(missing)}"
    built = {n for n in PENDING if hasattr(nbddp, n)}
    assert not built, f"built now: take {sorted(built)} off PENDING"
    assert set(nbddp.__all__) == (names - PENDING) | EXTRA


@pytest.mark.unit
def test_the_repositorys_copy_of_the_contract_is_current():
    if not SHARED_API_MD.exists():  # CI's clone has shared/ beside it: there this never skips
        pytest.skip(f"no contract to compare with: {SHARED_API_MD} is not beside this clone")
    assert API_MD.read_text() == SHARED_API_MD.read_text(), "copy shared/API.md to docs/API.md"
