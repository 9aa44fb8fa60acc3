"""The layering of docs/architecture.md, kept by the code: no import points up, no two packages import each other.

Every import of a Tessera module is read with `ast`, at the top of a file and inside functions alike (an
import inside a function is still a dependency). A unit is a subpackage of `tessera` (`tessera.plan`) or a
top-level module (`tessera.workload`). A unit may import itself and units of lower layers only; units of the
same layer are independent of each other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Bottom first. docs/architecture.md lists the same layers in the same order (checked below).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "paths", "documents", "console"),
    ("graph", "limits"),
    ("hardware", "weights", "workload", "kernels", "sched", "program"),
    ("capture",),
    ("triton_kernels", "cost"),
    ("plan",),
    ("runtime",),
    ("sim", "engines"),
    ("serve",),
    ("report", "router"),
    ("evaluation",),
    ("cli",),
    ("__main__",),
]
LAYER_OF = {unit: index for index, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path, source: Path = SOURCE) -> str:
    """The dotted module name of a source file under ``source``."""
    parts = list(path.relative_to(source).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """The layering unit of a Tessera module: its subpackage or top-level module ('' for `tessera` itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported_modules(path: Path, modules: set[str], source: Path = SOURCE) -> list[tuple[int, str]]:
    """(line, module) of every Tessera module `path` imports, anywhere in the file."""
    name = module_name(path, source)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from tessera.plan import build` imports the module tessera.plan.build (named once, not also
            # as the package tessera.plan)
            submodules = [f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in modules]
            candidates = submodules or [stem]
        else:
            continue
        for candidate in candidates:
            if candidate.startswith("tessera") and candidate in modules:
                found.append((node.lineno, candidate))
    return found


def import_violations(source: Path = SOURCE) -> list[str]:
    """Every import that breaks the layering, as 'file:line: a -> b (why)'."""
    files = sorted(source.rglob("*.py"))
    modules = {module_name(path, source) for path in files}
    problems = []
    for path in files:
        unit = unit_of(module_name(path, source))
        if unit == "":
            continue  # the package root only names the version
        if unit not in LAYER_OF:
            problems.append(f"{path.relative_to(source)}: unit {unit!r} is in no layer of LAYERS")
            continue
        for line, target in imported_modules(path, modules, source):
            other = unit_of(target)
            if other == unit or other == "":
                continue
            if other not in LAYER_OF:
                continue  # reported once for its own files
            if LAYER_OF[other] >= LAYER_OF[unit]:
                how = "same layer" if LAYER_OF[other] == LAYER_OF[unit] else "upward"
                problems.append(f"{path.relative_to(source)}:{line}: {unit} -> {other} ({how}, imports {target})")
    return problems


def module_cycles(source: Path = SOURCE) -> list[list[str]]:
    """Cycles of module imports inside one unit (strongly connected components of two or more modules)."""
    files = sorted(source.rglob("*.py"))
    modules = {module_name(path, source) for path in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        name = module_name(path, source)
        # an import of a package's __init__ is an import of the package, not a dependency cycle with it
        graph[name] = {
            target
            for _, target in imported_modules(path, modules, source)
            if target != name and not name.startswith(target + ".") and not target.startswith(name + ".")
        }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_points_up_or_sideways():
    assert import_violations() == []


def test_no_module_cycles():
    assert module_cycles() == []


def test_every_layer_exists():
    units = {unit_of(module_name(path)) for path in SOURCE.rglob("*.py")} - {""}
    assert units == set(LAYER_OF), "LAYERS must name exactly the units under src/tessera"


def test_the_architecture_page_lists_the_layers_in_order():
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| *(\d+) *\| *([^|]+?) *\|", section, flags=re.MULTILINE)
    documented = [tuple(re.findall(r"`([a-z_]+)`", units)) for _, units in rows]
    assert documented == LAYERS


def _copy_of_source(tmp_path: Path) -> Path:
    copy = tmp_path / "src"
    for path in SOURCE.rglob("*.py"):
        target = copy / path.relative_to(SOURCE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    return copy


@pytest.mark.parametrize(
    ("file", "line", "expected"),
    [
        # an upward import at the top of a file
        ("graph/ir.py", "from tessera.plan import problem\n", "graph -> plan (upward, imports tessera.plan.problem)"),
        # hidden inside a function
        (
            "cost/model.py",
            "def _hidden():\n    from tessera.runtime.executor import Executor\n",
            "cost -> runtime (upward, imports tessera.runtime.executor)",
        ),
        # two packages of one layer
        ("hardware/cluster.py", "import tessera.weights\n", "hardware -> weights (same layer, imports tessera.weights)"),
    ],
)
def test_a_deliberate_violation_is_caught(tmp_path, file, line, expected):
    copy = _copy_of_source(tmp_path)
    path = copy / "tessera" / file
    before = {problem.split(": ", 1)[1] for problem in import_violations(copy)}
    path.write_text(path.read_text() + "\n" + line)
    assert [p.split(": ", 1)[1] for p in import_violations(copy) if p.split(": ", 1)[1] not in before] == [expected]


def test_a_deliberate_cycle_is_caught(tmp_path):
    copy = _copy_of_source(tmp_path)
    path = copy / "tessera" / "plan" / "problem.py"
    path.write_text(path.read_text() + "\ndef _hidden():\n    from tessera.plan import milp\n")
    assert any({"tessera.plan.milp", "tessera.plan.problem"} <= set(cycle) for cycle in module_cycles(copy))
