"""Guards that keep the architecture as the README's development section draws it.

Parses the package's own imports (every one: module level, function-local and
``TYPE_CHECKING``) and fails on an import cycle, on an import that runs against the layer
order, on a library file over the line budget, on torch in the store, on analysis reaching
into private members, and on a store-format version branch outside ``gradlog/store/``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SOURCES = {"gradlog": ROOT / "gradlog", "gradlog.cli": ROOT / "cli"}
"""Package name -> folder (``cli/`` ships as ``gradlog.cli``)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("gradlog.errors", "gradlog._version", "gradlog._tree", "gradlog._torch_private"),
    ("gradlog.grads",),
    ("gradlog.params", "gradlog.losses", "gradlog.distributed", "gradlog.memory"),
    ("gradlog.rules",),
    ("gradlog.backends", "gradlog.sparse"),
    ("gradlog.forms",),
    ("gradlog.store",),
    ("gradlog.config", "gradlog.planning"),
    ("gradlog.analysis",),
    ("gradlog.run",),
    ("gradlog.recording",),
    ("gradlog.recorder",),
    ("gradlog.integrations", "gradlog.demo"),
    ("gradlog.testing",),
    ("gradlog",),
    ("gradlog.cli",),
    ("gradlog.__main__",),
)
"""Bottom first. A module imports from its own unit and from strictly lower layers only."""

LINE_BUDGET = 600
BUDGET_EXCEPTIONS: dict[str, str] = {}
"""Library files allowed over :data:`LINE_BUDGET`, each with its reason."""


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (resolved to a file of the package)
    line: int
    local: bool  # inside a function
    type_only: bool  # under ``if TYPE_CHECKING``


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only: set[int] = set()
    local: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for n in ast.walk(node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(node) if n is not node)
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if not name.startswith("gradlog"):
                continue
            target = _resolve(name)
            if target is None or target == module:
                continue
            yield Import(module, target, node.lineno, id(node) in local, id(node) in type_only)


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports(module, path)]


def _unit(module: str) -> tuple[int, str]:
    """(layer, unit) of a module: the longest entry of :data:`LAYERS` it belongs to."""
    best: tuple[int, str] | None = None
    for layer, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (
                best is None or len(unit) > len(best[1])
            ):
                best = (layer, unit)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _unit(module)


def test_imports_follow_the_layer_order() -> None:
    wrong = []
    for imp in IMPORTS:
        (src_layer, src_unit), (dst_layer, dst_unit) = _unit(imp.source), _unit(imp.target)
        if src_unit != dst_unit and dst_layer >= src_layer:
            wrong.append(
                f"{MODULES[imp.source].relative_to(ROOT)}:{imp.line} {imp.source} "
                f"(layer {src_layer}) imports {imp.target} (layer {dst_layer})"
            )
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    edges: dict[str, set[str]] = {module: set() for module in MODULES}
    for imp in IMPORTS:
        edges[imp.source].add(imp.target)
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_library_files_keep_the_line_budget() -> None:
    over = []
    for path in sorted(MODULES.values()):
        rel = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > LINE_BUDGET and rel not in BUDGET_EXCEPTIONS:
            over.append(f"{rel}: {lines} lines")
    assert not over, f"over {LINE_BUDGET} lines (split by job):\n" + "\n".join(over)


def test_the_store_never_imports_torch() -> None:
    offenders = []
    for module, path in MODULES.items():
        if _unit(module)[1] != "gradlog.store":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )
            offenders += [f"{module}:{node.lineno}" for n in names if n.split(".")[0] == "torch"]
    assert not offenders, f"torch imported in the store: {offenders}"


def _private_accesses(path: Path) -> Iterator[str]:
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        private = node.attr.startswith("_") and not (
            node.attr.startswith("__") and node.attr.endswith("__")
        )
        if (private and owner not in ("self", "cls")) or node.attr == "__dict__":
            yield f"{label}:{node.lineno} .{node.attr}"


def test_analysis_uses_public_apis_only() -> None:
    found = [
        hit
        for module, path in MODULES.items()
        if _unit(module)[1] == "gradlog.analysis"
        for hit in _private_accesses(path)
    ]
    assert not found, "analysis reaches into private members:\n" + "\n".join(found)


@pytest.mark.parametrize("source", ["x = run._grad_array('w')", "y = reader.__dict__"])
def test_private_access_finder_finds(tmp_path: Path, source: str) -> None:
    path = tmp_path / "probe.py"
    path.write_text(source + "\nself._fine = 1\n")
    assert len(list(_private_accesses(path))) == 1


def test_format_versions_are_branched_on_in_the_store_only() -> None:
    found = set()
    for module, path in MODULES.items():
        if _unit(module)[1] == "gradlog.store":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and "format_version" in ast.unparse(node).lower():
                found.add(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "format-version branches outside gradlog/store/:\n" + "\n".join(sorted(found))


def test_every_package_ships() -> None:
    """pyproject lists packages explicitly (no find_packages): a new subpackage left off the
    list would work in an editable install and be missing from the wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    packages = {
        module for module, path in MODULES.items() if path.name == "__init__.py"
    } | {"gradlog.schemas"}
    assert packages - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_every_error_class_is_public() -> None:
    """Each exception and warning class of gradlog.errors is in its __all__ (so
    test_cli's check makes it importable from ``gradlog``): StoreReplacedError was left out,
    and ``except gradlog.StoreReplacedError:`` raised AttributeError."""
    import inspect

    from gradlog import errors

    defined = {name for name, obj in vars(errors).items() if inspect.isclass(obj)
               and issubclass(obj, (Exception, Warning)) and obj.__module__ == errors.__name__
               and not name.startswith("_")}
    assert defined <= set(errors.__all__), sorted(defined - set(errors.__all__))
