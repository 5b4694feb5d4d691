"""The shape rules of the code (docs/architecture.md), measured on the source as it is: no import
circle among the installed modules, no file past 400 lines, comments and docstrings at most 12%."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "shared")  # installed as pagedserve.services, pagedserve.shared (setup.py)
MAX_LINES = 400
MAX_COMMENT_SHARE = 0.12


def modules() -> dict[str, Path]:
    """Installed module name -> its file."""
    out = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(["pagedserve", *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node that runs: `if TYPE_CHECKING:` bodies left out, function-level imports kept."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def comment_lines(source: str) -> int:
    """Lines holding a comment (trailing ones too) or part of a docstring."""
    lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return len(lines)


def test_the_cycle_finder_finds_a_circle_and_only_that():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_comment_count_takes_comments_and_docstrings_not_strings():
    source = '"""Doc\nstring."""\nx = 1  # why\ny = "not a docstring"\n# alone\n\ndef f():\n    """One."""\n'
    assert comment_lines(source) == 5


def test_no_import_circle_among_the_installed_modules():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert import_cycles(graph) == []


def test_no_source_file_over_400_lines():
    files = [p for top in (*PACKAGES, "tests", "scripts") for p in (ROOT / top).rglob("*.py")]
    too_long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert too_long == {}


def test_comments_and_docstrings_are_at_most_12_percent_of_lines():
    sources = [path.read_text() for path in modules().values()]
    total = sum(len(s.splitlines()) for s in sources)
    share = sum(comment_lines(s) for s in sources) / total
    assert share <= MAX_COMMENT_SHARE, f"{share:.1%} of {total} lines"
