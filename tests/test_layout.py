"""The house's import rules, read from the source (issue 25): arrows point one way and never loop.

``benchmarks, devtools, loadtest, quality -> service -> robez_core``: nothing under ``service/`` imports
the tools above it, ``robez_core/`` imports nothing of ``service/``, and no module reaches itself again
through its imports, lazy ones inside functions and ``if TYPE_CHECKING:`` ones included (a cycle the
interpreter tolerates is still two modules that cannot be read, tested or moved apart).

And (issue 36): no module uses another module's ``_private`` names, and no product module (``robez_core/``,
``service/``) is over 800 lines, the numba kernels' one file excepted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("robez_core", "service", "loadtest", "quality", "benchmarks", "devtools")
# package -> the packages it must never import
FORBIDDEN = {
    "robez_core": {"service", "loadtest", "quality", "benchmarks", "devtools"},
    "service": {"loadtest", "quality", "benchmarks", "devtools"},
    "loadtest": {"benchmarks", "devtools"},
    "quality": {"benchmarks", "devtools"},
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The project modules ``node`` (in ``module``) imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    targets = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            targets.add(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = set().union(*(_targets(module, path, node, known) for node in _imports(tree)))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_arrows_point_one_way() -> None:
    upward = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if target.split(".")[0] in FORBIDDEN.get(module.split(".")[0], set())
    ]
    assert upward == []


def test_the_graph_is_read() -> None:
    """The checks above see real arrows (a reader that found none would pass them vacuously)."""
    graph = import_graph()
    assert "robez_core.errors" in graph["robez_core.config"]
    assert any(target.startswith("robez_core") for target in graph["service.app"])
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- private names and module size ------------------------------------------------------------------

PRODUCT = ("robez_core", "service")
MAX_PRODUCT_LINES = 800
# numba's cache notices only changes to the file of the function it compiled: every @njit in one file.
LINE_LIMIT_EXEMPT = {"robez_core/kernels/_jit.py"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of the module ``node`` imports from."""
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return base


def private_imports(modules: dict[str, Path] | None = None) -> list[str]:
    """``module: name from other`` for every use of another project module's ``_private`` name: ``from
    other import _name``, and ``alias._name`` where ``alias`` was bound by importing a project module.
    A private submodule (``from . import _jit``) is a module, not a name, and is not counted; a package
    reaching into its own private helpers through ``__init__`` is counted like any other module."""
    modules = _modules() if modules is None else modules
    known = set(modules)
    found: list[str] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> project module it is bound to
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                base = _base(module, path, node)
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in known:
                        aliases[alias.asname or alias.name] = target
                    elif _is_private(alias.name) and base in known and base != module:
                        found.append(f"{module}: {alias.name} from {base}")
            else:
                for alias in node.names:
                    if alias.name in known and alias.asname is not None:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _is_private(node.attr)
                and f"{aliases[node.value.id]}.{node.attr}" not in known
                and aliases[node.value.id] != module
            ):
                found.append(f"{module}: {node.attr} from {aliases[node.value.id]}")
    return sorted(set(found))


# Modules allowed to reach into another's private names, and why.
PRIVATE_IMPORTS_ALLOWED = {
    # An experiment on the kernel's source: it recompiles the adam kernel with one constant changed
    # (docs/benchmarks/kernel-constants.md), which no public API should offer.
    "benchmarks.core.sparse_step",
}


def _inside_its_package(offence: str) -> bool:
    """A private module's names (``robez_core/kernels/_jit.py``: the one @njit file, numba's cache keys on
    it) are its package's internals: the package's own modules (its checked API) may use them; no module
    outside the package may."""
    module, _, rest = offence.partition(": ")
    owner = rest.rsplit(" from ", 1)[1]
    package, _, leaf = owner.rpartition(".")
    return _is_private(leaf) and (module == package or module.startswith(package + "."))


def test_no_private_names_imported_across_modules() -> None:
    offences = [
        offence
        for offence in private_imports()
        if not _inside_its_package(offence) and offence.split(":")[0] not in PRIVATE_IMPORTS_ALLOWED
    ]
    assert offences == []


def oversized_product_modules(root: Path = ROOT) -> list[str]:
    """``path: lines`` of every product module over ``MAX_PRODUCT_LINES`` (the @njit file excepted)."""
    found = []
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            lines = len(path.read_text().splitlines())
            if lines > MAX_PRODUCT_LINES and relative not in LINE_LIMIT_EXEMPT:
                found.append(f"{relative}: {lines}")
    return found


def test_no_product_module_over_the_line_limit() -> None:
    assert oversized_product_modules() == []


def test_the_private_and_size_checks_see_offences(tmp_path: Path) -> None:
    """The two readers above find what they look for (a reader that found nothing would pass vacuously)."""
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "files.py").write_text("_durably = 1\nPUBLIC = 2\n")
    (tmp_path / "service" / "journal.py").write_text(
        "from .files import _durably, PUBLIC\nfrom service import files as f\nf._hidden()\nf.__name__\n"
    )
    (tmp_path / "service" / "big.py").write_text("x = 1\n" * (MAX_PRODUCT_LINES + 1))
    (tmp_path / "robez_core" / "kernels").mkdir(parents=True)
    (tmp_path / "robez_core" / "kernels" / "_jit.py").write_text("x = 1\n" * (MAX_PRODUCT_LINES + 1))
    modules = {"service.files": tmp_path / "service" / "files.py"}
    modules["service.journal"] = tmp_path / "service" / "journal.py"
    assert private_imports(modules) == [
        "service.journal: _durably from service.files",
        "service.journal: _hidden from service.files",
    ]
    assert oversized_product_modules(tmp_path) == [f"service/big.py: {MAX_PRODUCT_LINES + 1}"]


def test_a_private_modules_names_stay_inside_its_package() -> None:
    """The kernels' checked API may read ``_jit``'s names; a module outside ``robez_core.kernels`` may not."""
    sibling = "robez_core.kernels.serial: _gather_kernel from robez_core.kernels._jit"
    package = "robez_core.kernels: _gather_kernel from robez_core.kernels._jit"
    outsider = "service.store.tables: _gather_kernel from robez_core.kernels._jit"
    private_name_of_public_module = "robez_core.kernels.serial: _helper from robez_core.kernels.runtime"
    assert _inside_its_package(sibling) and _inside_its_package(package)
    assert not _inside_its_package(outsider)
    assert not _inside_its_package(private_name_of_public_module)
