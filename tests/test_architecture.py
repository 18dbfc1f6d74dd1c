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
    "environment": set(),
    "interrupts": set(),
    "recovery": set(),
    "wire": {"errors"},
    "worker": {"wire", "errors"},
    "backend": {"wire"},
    "diagnosis": {"wire", "errors"},
    "display": {"backend", "diagnosis", "wire", "errors"},
    "rules": {"backend", "display", "interrupts", "recovery", "wire", "errors"},
    "plan": {"clusters", "environment", "recovery", "wire", "errors"},
    "run": {"backend", "diagnosis", "display", "interrupts", "plan", "wire", "errors"},
    "local": {
        "backend",
        "display",
        "environment",
        "errors",
        "interrupts",
        "plan",
        "recovery",
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
    # a launch's backend over any Ranks, judged by the referee
    "supervised": {"backend", "errors", "interrupts", "plan", "rules", "wire"},
    # runs that outlive the kernel: a supervisor hosting the one launch path (launch.ranks_for
    # and Supervised), its record, the kernels that follow it
    "detached": {
        "backend",
        "clusters",
        "display",
        "environment",
        "errors",
        "interrupts",
        "launch",
        "local",
        "plan",
        "run",
        "supervised",
        "wire",
    },
    "launch": {
        "backend",
        "clusters",
        "detached",
        "interrupts",
        "local",
        "plan",
        "recovery",
        "run",
        "supervised",
        "wire",
        "worker",
        "errors",
    },
    # ranks reached through launch.ranks_for alone: never local/ or clusters/ (a test below)
    "sessions": {
        "backend",
        "diagnosis",
        "errors",
        "launch",
        "plan",
        "recovery",  # a task's stop_grace default, as a launch's
        "rules",
        "run",
        "wire",
        "worker",
    },
    # a launch as a script: no engine; the script's runner uses the rank side where installed
    "exporting": {"plan", "recovery", "wire", "worker", "errors"},
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
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                cycle = [*path[path.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


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
    """Where ranks run is picked in one place (``launch.ranks_for``), for launches and
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
    GRAPH["nbddp.worker.entry"].add("nbddp.environment")
    try:
        try:
            test_every_part_imports_only_what_the_table_allows()
        except AssertionError as exc:
            assert "nbddp.worker.entry -> nbddp.environment" in str(exc)
        else:
            raise AssertionError("a forbidden import passed")
    finally:
        GRAPH["nbddp.worker.entry"].discard("nbddp.environment")


@pytest.mark.ranks
def test_a_rank_loads_no_kernel_module_and_importing_nbddp_starts_nothing():
    code = (
        "import sys, time, psutil\n"
        "import nbddp.worker.entry, nbddp.worker.forkserver, nbddp\n"
        "nbddp.rank()\n"
        "time.sleep(0.3)\n"
        f"kernel = {KERNEL_SIDE!r} + ('IPython', 'ipywidgets')\n"
        "loaded = [m for m in sys.modules if any(m == k or m.startswith(k + '.') "
        "for k in kernel)]\n"
        "print(loaded, psutil.Process().children())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] []"


MAX_LINES = 350  # past it, split a module by job (as errors/ and local/channels.py were)


@pytest.mark.unit
def test_no_module_is_much_longer_than_a_screenful_or_two():
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by job: {long}"


@pytest.mark.unit
def test_the_tests_mirror_the_package():
    """A change's tests are found by its path: ``nbddp/<folder>/`` is tested in
    ``tests/<folder>/``; a test file at the top of ``tests/`` is about a top-level module or the
    whole package, never about a folder (``docs/`` tests the documentation site)."""
    tests = Path(__file__).parent
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    subfolders = {d.name for d in tests.iterdir() if d.is_dir() and d.name[0] not in "._"}
    assert not subfolders - folders - {"docs"}, "test folders that name no part of the package"
    misplaced = [f.name for f in tests.glob("test_*.py") if f.stem[len("test_") :] in folders]
    assert not misplaced, f"move these into the folder of the part they test: {misplaced}"


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
# Contract names whose issue has not landed yet (each must really be missing: the test says when
# one is built): "Stopping well" (#32), "Debugging a rank" (#33), "Detached runs" (#34).
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
