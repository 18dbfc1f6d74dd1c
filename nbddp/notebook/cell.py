"""A notebook cell as a DDP job: which names go in and which come out (the kernel's half; the
ranks run the cell with ``worker/rank/cell.py``).

Name analysis uses the compiler's own scoping (``symtable``) for nested functions, classes and
comprehensions, and walks the top-level statements in order (``ast``) to tell a name the cell
reads before defining it (shipped from the notebook) from one it defines first (not shipped).
Where the order cannot be known statically (a branch, a loop) it ships the name if the notebook
has it: shipping too much is harmless, missing one would be a NameError.

Non-goal: IPython syntax inside the cell (``!cmd``, ``%magic``): workers have no IPython.
"""

from __future__ import annotations

import ast
import linecache
import symtable
import warnings
from dataclasses import dataclass
from typing import Any, cast

from nbddp.errors import NbddpWarning

# IPython's own names in the user namespace: never shipped, never brought back.
_IPYTHON_NAMES = frozenset(
    {
        "In",
        "Out",
        "get_ipython",
        "exit",
        "quit",
        "_",
        "__",
        "___",
        "_i",
        "_ii",
        "_iii",
        "_oh",
        "_ih",
        "_dh",
    }
)


@dataclass(frozen=True)
class CellNames:
    reads: frozenset[str]  # may be read from the notebook namespace
    writes: tuple[str, ...]  # bound (or deleted) at the notebook's top level, in order
    deletes: frozenset[str] = frozenset()  # deleted at the top level (``del x``)


def analyze(source: str) -> CellNames:
    """Names a cell reads from and writes to the notebook namespace (raises SyntaxError)."""
    tree = ast.parse(source)
    table = symtable.symtable(source, "<cell>", "exec")
    writes = [s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()]
    nested_reads: set[str] = set()
    for child in table.get_children():
        _nested_globals(child, nested_reads, writes)

    reads: set[str] = set()
    _scan(tree.body, set(), reads)
    keep = [n for n in dict.fromkeys(writes) if n not in _IPYTHON_NAMES]
    deletes = {
        target.id
        for node in _top_level_nodes(tree)
        if isinstance(node, ast.Delete)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return CellNames(
        reads=frozenset((reads | nested_reads) - _IPYTHON_NAMES),
        writes=tuple(keep),
        deletes=frozenset(deletes),
    )


def _top_level_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node of the cell's own scope: nested functions, lambdas and classes left out."""
    nodes: list[ast.AST] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))
    return nodes


def binding_line(source: str, name: str) -> int:
    """The line where the cell first binds ``name`` (1 when it does not)."""
    lines = [
        getattr(node, "lineno", 1)
        for node in _top_level_nodes(ast.parse(source))
        if name in _binds(node)
    ]
    return min(lines, default=1)


def _binds(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return {node.id}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


def warn_in_cell(message: str, filename: str, lineno: int) -> None:
    """A warning shown against the user's cell and line, not nbddp's own source."""
    warnings.warn_explicit(message, NbddpWarning, filename, lineno)


def _nested_globals(table: symtable.SymbolTable, reads: set[str], writes: list[str]) -> None:
    for symbol in table.get_symbols():
        if symbol.is_global() and symbol.is_referenced():
            reads.add(symbol.get_name())
        if symbol.is_declared_global() and symbol.is_assigned():
            writes.append(symbol.get_name())
    for child in table.get_children():
        _nested_globals(child, reads, writes)


class _Loads(ast.NodeVisitor):
    """Names read in the top-level scope of one statement; nested scopes are left to symtable
    except for what runs at definition time (decorators, defaults, bases, the first iterable
    of a comprehension)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, (ast.Load, ast.Del)):
            self.names.add(node.id)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):  # x += 1 reads x first
            self.names.add(node.target.id)
        self.generic_visit(node)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        for expr in [
            *getattr(node, "decorator_list", []),
            *node.args.defaults,
            *(d for d in node.args.kw_defaults if d is not None),
        ]:
            self.visit(expr)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)

    def _visit_comprehension(self, node: Any) -> None:
        self.visit(node.generators[0].iter)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _visit_comprehension


def _scan(block: list[ast.stmt], defined: set[str], reads: set[str]) -> None:
    """Walk statements in order, adding to ``reads`` what is read before it is surely bound.
    ``defined`` grows as the block binds names; inner blocks get their own copy where they
    may not run (branches, loop bodies)."""
    for statement in block:
        if isinstance(statement, (ast.With, ast.AsyncWith)):  # binds, then always runs its body
            for item in statement.items:
                reads |= _loads(item.context_expr) - defined
                if item.optional_vars is not None:
                    defined |= _stored(item.optional_vars)
            _scan(statement.body, defined, reads)
        elif isinstance(statement, (ast.For, ast.AsyncFor)):
            reads |= _loads(statement.iter) - defined
            _scan(statement.body, defined | _stored(statement.target), reads)
            _scan(statement.orelse, set(defined), reads)
        elif isinstance(statement, (ast.If, ast.While)):
            reads |= _loads(statement.test) - defined
            _scan(statement.body, set(defined), reads)
            _scan(statement.orelse, set(defined), reads)
        elif isinstance(statement, _TRY_STATEMENTS):
            statement = cast(ast.Try, statement)  # try/except* has the same fields
            _scan(statement.body, set(defined), reads)
            for handler in statement.handlers:
                if handler.type is not None:
                    reads |= _loads(handler.type) - defined
                inner = set(defined) | ({handler.name} if handler.name else set())
                _scan(handler.body, inner, reads)
            _scan(statement.orelse, set(defined), reads)
            _scan(statement.finalbody, set(defined), reads)
        else:
            reads |= _loads(statement) - defined
            defined |= _definite_bindings(statement)
            defined -= _deleted(statement)


_TRY_STATEMENTS: tuple[type[ast.stmt], ...] = (
    (ast.Try, ast.TryStar) if hasattr(ast, "TryStar") else (ast.Try,)
)


def _stored(target: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _loads(statement: ast.AST) -> set[str]:
    visitor = _Loads()
    visitor.visit(statement)
    return visitor.names


def _definite_bindings(statement: ast.stmt) -> set[str]:
    """Names surely bound once ``statement`` ran (branches and loops bind only maybe)."""
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        if isinstance(statement, ast.AnnAssign) and statement.value is None:
            return set()
        return {
            n.id
            for t in targets
            for n in ast.walk(t)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in statement.names if a.name != "*"}
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    return set()


def _deleted(statement: ast.stmt) -> set[str]:
    if isinstance(statement, ast.Delete):
        return {t.id for t in statement.targets if isinstance(t, ast.Name)}
    return set()


def register_source(filename: str, source: str) -> None:
    """Make the cell's lines known to tracebacks (shipped to the workers with the job)."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)


def shows_last_value(source: str) -> bool:
    """Like IPython: the last expression is shown unless the cell ends with ';'."""
    tree = ast.parse(source)
    return (
        bool(tree.body)
        and isinstance(tree.body[-1], ast.Expr)
        and not (source.rstrip().endswith(";"))
    )
