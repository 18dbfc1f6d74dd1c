"""The shape of the package: its modules import each other without a cycle, the worker side
never needs the kernel side, and the public names are the contract's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import nbddp

PACKAGE = Path(nbddp.__file__).parent
# What only the kernel runs: a rank (or the pre-warmed helper) must never need it.
KERNEL_SIDE = (
    "nbddp.launch",
    "nbddp.run",
    "nbddp.supervisor",
    "nbddp.in_kernel",
    "nbddp.magic",
    "nbddp.cell",
    "nbddp.display",
    "nbddp.forkserver",
    "nbddp.backend",
    "nbddp.pump",
    "nbddp.outcome",
    "nbddp.referee",
    "nbddp.ray_backend",
    "nbddp.ray_cluster",
    "nbddp.session",
    "nbddp.session_ranks",
    "nbddp.session_magic",
    "nbddp.task_referee",
)


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


def is_kernel_side(module: str) -> bool:
    return any(module == k or module.startswith(k + ".") for k in KERNEL_SIDE)


def reachable(start: str) -> set[str]:
    seen, pending = set(), [start]
    while pending:
        for target in GRAPH[pending.pop()]:
            if target not in seen:
                seen.add(target)
                pending.append(target)
    return seen


def test_the_worker_side_never_imports_the_kernel_side():
    for name in MODULES:
        if name.startswith("nbddp.worker"):
            kernel = {m for m in reachable(name) if is_kernel_side(m)}
            assert not kernel, f"{name} imports {sorted(kernel)}"


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


def test_no_module_is_much_longer_than_a_screenful_or_two():
    long = {
        name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, f"split these by job: {long}"


# The public names: API.md's, plus the two errors/warnings of the tree users catch or filter.
API = {
    "notebook_launch",
    "Run",
    "last_run",
    "rank",
    "local_rank",
    "world_size",
    "is_main",
    "device",
    "prepare_model",
    "prepare_loader",
    "unwrap",
    "log",
    "progress",
    "print",
    "barrier",
    "NbddpError",
    "WorkerError",
    "SerializationError",
    "LaunchTimeout",
    "RayCluster",
    "set_cluster",
    "Session",
}
EXTRA = {"RunStopped", "NbddpWarning"}


def test_the_public_names_are_the_contracts():
    assert set(nbddp.__all__) == API | EXTRA
    for name in nbddp.__all__:
        assert getattr(nbddp, name) is not None
    api_md = PACKAGE.parent.parent / "shared" / "API.md"
    if api_md.exists():  # the contract itself, where the checkout has it beside
        text = api_md.read_text()
        for name in API:
            assert name in text, name
