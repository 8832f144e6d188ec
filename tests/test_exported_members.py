"""zarrckpt's public surface, checked as httpx checks its own (its tests/test_exported_members.py;
STYLE.md habit 8): ``zarrckpt.__all__`` is exactly the public names of the facade, sorted, and
every module of the package declares a sorted ``__all__`` that names everything other
zarrckpt modules take from it (``from module import name`` or ``module.name``)."""

from __future__ import annotations

import ast
import types
from collections import defaultdict

import pytest

import zarrckpt
from test_layers import package_modules, package_uses  # the tests folder is on sys.path (conftest.py)

MODULES = package_modules()


def test_all_is_exactly_the_public_names_of_the_facade():
    public = sorted(
        name for name, value in vars(zarrckpt).items()
        if (not name.startswith("_") or name == "__version__")
        and not isinstance(value, types.ModuleType)  # subpackages, once imported
        # zarrckpt's own (typing.Any and __future__.annotations are not)
        and (isinstance(value, str) or getattr(value, "__module__", "").startswith("zarrckpt"))
    )
    assert zarrckpt.__all__ == public


def test_all_of_the_facade_is_sorted_and_resolves():
    assert zarrckpt.__all__ == sorted(zarrckpt.__all__)
    assert len(set(zarrckpt.__all__)) == len(zarrckpt.__all__)
    for name in zarrckpt.__all__:
        assert getattr(zarrckpt, name) is not None


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements run at import (module body, and inside its if/try blocks)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return out


def declared_all(module: str) -> list[str] | None:
    """The module's ``__all__`` as written (a literal, or ``from x import __all__``)."""
    path, is_package = MODULES[module]
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) and node.value is not None else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))
        if isinstance(node, ast.ImportFrom) and any(a.name == "__all__" for a in node.names):
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1] if node.level else []
            return declared_all(".".join(base + [node.module]))
    return None


def _bound_names(module: str) -> set[str] | None:
    """Names the module binds at import; None when it star-imports (not decidable here)."""
    path, _ = MODULES[module]
    names = set()
    for node in _top_level(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*":
                    return None
                names.add(a.asname or a.name.split(".")[0])
    return names


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_declares_a_sorted_all(module):
    names = declared_all(module)
    assert names is not None, f"{module} has no __all__ (an empty one if it exports nothing)"
    assert names == sorted(names), f"{module}.__all__ is not sorted: {names}"
    assert len(set(names)) == len(names), f"{module}.__all__ repeats a name"
    bound = _bound_names(module)
    if bound is not None:
        assert not set(names) - bound, f"{module}.__all__ names what it does not define: {set(names) - bound}"


def _imported_from() -> dict[str, dict[str, set[str]]]:
    """module -> public name -> the other zarrckpt modules that take it from there."""
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for use in package_uses():
        if use.name is not None and use.importer != use.module \
                and (not use.name.startswith("_") or use.name == "__version__"):
            out[use.module][use.name].add(use.importer)
    return out


IMPORTED = _imported_from()


@pytest.mark.parametrize("module", sorted(IMPORTED))
def test_names_imported_across_modules_are_in_all(module):
    """What another module takes from ``module`` is its interface, so it is in its
    ``__all__`` (private names never cross a package: tests/test_layers.py)."""
    listed = set(declared_all(module) or ())
    missing = {name: sorted(users) for name, users in IMPORTED[module].items() if name not in listed}
    assert not missing, f"{module}.__all__ lacks names that other modules import: {missing}"

