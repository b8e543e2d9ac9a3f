"""Imports point one way: core <- runtime <- passes <- front-end.

Every import of a project module, at module level or inside a function, is checked against
the layer of the module that makes it. A lower layer importing a higher one fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"tokpipe_compiler": ROOT / "tokpipe_compiler",
                "tokpipe_compiler.passes": ROOT / "passes",
                "tokpipe_compiler.runtime": ROOT / "runtime"}
LAYERS = {"core": 0, "runtime": 1, "passes": 2, "front-end": 3}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "tokpipe_compiler":
        return "outside"
    if len(parts) > 1 and parts[1] in ("core", "runtime", "passes"):
        return parts[1]
    return "front-end"


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            relative = path.relative_to(folder).with_suffix("").parts
            if relative[-1] == "__init__":
                relative = relative[:-1]
            found[".".join((package, *relative))] = path
    return found


def imported(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every project import in the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = node.module or ""
            if node.level:
                target = ".".join(base + ([node.module] if node.module else []))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in out if name.startswith("tokpipe_compiler")]


def test_layer_of():
    assert layer_of("tokpipe_compiler.core.errors") == "core"
    assert layer_of("tokpipe_compiler.runtime.transport") == "runtime"
    assert layer_of("tokpipe_compiler.passes.split") == "passes"
    assert layer_of("tokpipe_compiler.planning.driver") == "front-end"
    assert layer_of("tokpipe_compiler") == "front-end"


@pytest.mark.parametrize("module", sorted(m for m in modules() if layer_of(m) != "front-end"))
def test_imports_point_down(module):
    own = LAYERS[layer_of(module)]
    wrong = [f"line {line}: {name} ({layer_of(name)})"
             for line, name in imported(module, modules()[module])
             if LAYERS[layer_of(name)] > own]
    assert not wrong, f"{module} ({layer_of(module)}) imports a higher layer:\n" + "\n".join(wrong)


def test_core_imports_only_torch():
    allowed = {"torch", "__future__", "typing", "dataclasses", "enum", "collections", "itertools",
               "logging", "os", "re", "pathlib", "operator", "fractions", "math", "functools",
               "sys", "warnings", "linecache"}
    for module, path in modules().items():
        if layer_of(module) != "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            for name in names:
                top = name.split(".")[0]
                assert top in allowed or top == "tokpipe_compiler", f"{module} imports {name}"
