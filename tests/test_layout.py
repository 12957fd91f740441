"""The package's layout rules (docs/layout.md), read from the source with ``ast``.

* Imports point one way, down the layers of :data:`LAYERS`, and form no cycle; every import
  statement counts, lazy ones inside functions and ``TYPE_CHECKING`` blocks included. Only
  the facade (``anyorder/__init__.py``) may import from a higher layer, and no module imports
  a name from the facade.
* No module is over :data:`MAX_MODULE_LINES` lines and no function over
  :data:`MAX_FUNCTION_LINES` (from its ``def`` to its last line, decorators excluded).

Neither rule lists exceptions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "anyorder"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100

# bottom to top; a module may import its own layer (without a cycle) and the ones below
LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"errors", "bounds", "progress", "runlock", "atomic", "version"}),
    (
        "core",
        {"config", "orders", "flops", "memory", "precision", "hugepages", "layers", "cache"}
        | {"models"},
    ),
    ("data", {"data"}),
    ("weights", {"checkpoint", "interop"}),
    ("sampling", {"sampling", "sample"}),
    ("evaluation", {"evaluation"}),
    ("training", {"training"}),
    ("apps", {"api", "cli", "demo", "serve", "experiments", "plots", "harness", "hf", "vllm"}),
]
LAYER_OF = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}
FACADE = "anyorder"


def modules() -> dict[str, Path]:
    """Dotted name (without ``anyorder.``; the facade as ``anyorder``) -> file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or FACADE] = path
    return out


MODULES = modules()


def _package_of(name: str, path: Path) -> list[str]:
    parts = [] if name == FACADE else name.split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


def imports(name: str, path: Path) -> list[tuple[int, str, str]]:
    """(line, target module, what) for every import of an anyorder module in ``path``;
    ``target`` is the facade for a name the facade defines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == FACADE or alias.name.startswith(FACADE + "."):
                    found.append((node.lineno, _resolve(alias.name), alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path)[: len(_package_of(name, path)) - node.level + 1]
                dotted = ".".join([FACADE, *base, *([node.module] if node.module else [])])
            else:
                dotted = node.module or ""
            if dotted != FACADE and not dotted.startswith(FACADE + "."):
                continue
            for alias in node.names:
                sub = f"{dotted}.{alias.name}"
                target = _resolve(sub) if _resolve(sub) in MODULES else _resolve(dotted)
                found.append((node.lineno, target, f"from {dotted} import {alias.name}"))
    return found


def _resolve(dotted: str) -> str:
    name = dotted.removeprefix(FACADE).removeprefix(".")
    return name or FACADE


def layer(module: str) -> int:
    return LAYER_OF[module.split(".")[0]]


def test_every_module_has_a_layer() -> None:
    unknown = sorted(m for m in MODULES if m != FACADE and m.split(".")[0] not in LAYER_OF)
    assert not unknown, (
        f"modules without a layer (add them to LAYERS and docs/layout.md): {unknown}"
    )


def test_imports_point_down_the_layers() -> None:
    upward = []
    for name, path in MODULES.items():
        if name == FACADE or name.split(".")[0] not in LAYER_OF:
            continue
        for line, target, what in imports(name, path):
            if target == FACADE:
                upward.append(f"{path.relative_to(PACKAGE)}:{line}: {what} (a facade name)")
            elif (
                target in MODULES
                and target.split(".")[0] in LAYER_OF
                and layer(target) > layer(name)
            ):
                upward.append(
                    f"{path.relative_to(PACKAGE)}:{line}: {what} "
                    f"({LAYERS[layer(name)][0]} imports {LAYERS[layer(target)][0]})"
                )
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = {
        name: {t for _, t, _ in imports(name, path) if t in MODULES and t != name}
        for name, path in MODULES.items()
        if name != FACADE
    }
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_an_upward_and_a_lazy_import(tmp_path: Path) -> None:
    """The rule is only as good as its parser: a lazy upward import and a facade name."""
    src = tmp_path / "anyorder" / "orders.py"
    src.parent.mkdir()
    src.write_text(
        "def f():\n    from anyorder.training.loop import train\n"
        "from anyorder import build_model\nfrom anyorder import errors\n"
    )
    found = {what: target for _, target, what in imports("orders", src)}
    assert found["from anyorder.training.loop import train"].startswith("training")
    assert found["from anyorder import build_model"] == FACADE
    assert found["from anyorder import errors"] == "errors"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name: str) -> None:
    path = MODULES[name]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{path.relative_to(PACKAGE)} has {lines} lines (at most {MAX_MODULE_LINES})"
    )
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, (
        f"{path.relative_to(PACKAGE)}: functions over {MAX_FUNCTION_LINES} lines: {long}"
    )


def tree_in_layout_md() -> set[str]:
    """The module paths the tree in docs/layout.md names (relative to src/anyorder)."""
    text = (PACKAGE.parents[1] / "docs" / "layout.md").read_text()
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    paths, package = set(), ""
    for line in block.splitlines()[1:]:
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or not line.startswith("  "):
            continue
        entry = stripped.split()[0]
        if line.startswith("    "):
            paths.add(package + entry)
        elif entry.endswith("/"):
            package = entry
        else:
            paths.add(entry)
    return paths


def test_docs_layout_names_every_module() -> None:
    on_disk = {str(p.relative_to(PACKAGE)) for p in MODULES.values()}
    named = tree_in_layout_md()
    assert not on_disk - named, f"modules missing from docs/layout.md: {sorted(on_disk - named)}"
    assert not named - on_disk, f"docs/layout.md names no such module: {sorted(named - on_disk)}"
