"""The layers of zarrckpt (issue 15, item 5; STYLE.md habit 11), checked by machine.

Bottom to top: the utilities (``errors``, ``_optional``, ``_version``) < ``format`` <
``storage`` < ``engine`` < ``readers`` < ``distributed`` < ``planning`` < ``api`` <
``interop`` < ``tools`` < the facade ``zarrckpt/__init__.py`` and the public shims.

* ``.importlinter`` holds the contracts (imports only go down; format, storage, engine and
  readers work without torch; TensorStore only under ``storage``; jax only in
  ``interop.jax``); :func:`test_import_contracts_hold` runs ``lint-imports`` on it, so the
  README's test command (which CI runs) enforces them.
* No module takes a private name (``_x``, a module or an object) from another package.
* No import cycle among zarrckpt's modules, function-level (lazy) imports included.

Violations that are known and being fixed elsewhere are listed in ``KNOWN_*`` below, each
with a ``strict`` xfail test that fails once it is gone: then delete its entry (and its
``ignore_imports`` line in ``.importlinter``), so the lists only shrink.
"""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zarrckpt"

# Upward imports still made (issue 15 item 5; readers -> interop/xarray and interop/common,
# the first entries, are gone with the rewrite of readers/): format/dtypes.py's torch helpers
# (torch_dtype, to_numpy, from_numpy import torch inside the function) belong on the torch
# side. .importlinter ignores exactly these (test_ignored_imports_are_the_known_ones).
KNOWN_UPWARD_IMPORTS = {
    ("zarrckpt.format.dtypes", "torch"): "torch_dtype/to_numpy/from_numpy in the torch-free format layer",
}

# Import cycles still there, as sets of modules (issue 15 item 5; readers <-> interop/xarray
# is gone with the rewrite of readers/).
KNOWN_CYCLES: list[frozenset[str]] = []


# ---------------------------------------------------------------- import-linter


def test_import_contracts_hold():
    """``lint-imports`` (import-linter, from the test extra) keeps every contract of
    ``.importlinter``; an ``ignore_imports`` line that matches nothing also fails it."""
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.fail(f"lint-imports is not installed next to {sys.executable}: pip install -e '.[test]'")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-4000:]


def test_ignored_imports_are_the_known_ones():
    """``.importlinter`` ignores no import but the known ones listed here."""
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    ignored = set()
    for section in config.sections():
        for line in config[section].get("ignore_imports", "").splitlines():
            if line.strip():
                importer, imported = (part.strip() for part in line.split("->"))
                ignored.add((importer, imported))
    assert ignored == set(KNOWN_UPWARD_IMPORTS)


@pytest.fixture(scope="module")
def graph():
    grimp = pytest.importorskip("grimp")  # installed with import-linter
    return grimp.build_graph("zarrckpt", include_external_packages=True, exclude_type_checking_imports=True,
                             cache_dir=None)


@pytest.mark.xfail(strict=True, reason="known (issue 15 item 5); once this passes, drop the entry")
@pytest.mark.parametrize("importer,imported", sorted(KNOWN_UPWARD_IMPORTS))
def test_known_upward_import_is_gone(graph, importer, imported):
    assert not graph.direct_import_exists(importer=importer, imported=imported), \
        KNOWN_UPWARD_IMPORTS[importer, imported]


# ---------------------------------------------------------------- cycles


def _cycles(graph) -> list[frozenset[str]]:
    """The strongly connected components of more than one zarrckpt module (Tarjan)."""
    modules = sorted(m for m in graph.modules if m == "zarrckpt" or m.startswith("zarrckpt."))
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in modules:
        if start in index:
            continue
        work = [(start, 0)]
        while work:  # iterative, so a deep graph needs no recursion
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def _describe(graph, cycle: frozenset[str]) -> str:
    lines = []
    for a in sorted(cycle):
        for b in sorted(cycle):
            if graph.direct_import_exists(importer=a, imported=b):
                where = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
                lines.append(f"  {a} -> {b} (line {', '.join(map(str, where))})")
    return "\n".join(lines)


def test_no_import_cycles(graph):
    """No cycle among zarrckpt's modules, counting imports inside functions (a lazy import
    hides a cycle from the interpreter, not from the design)."""
    new = [c for c in _cycles(graph) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles:\n" + "\n\n".join(_describe(graph, c) for c in new)


def test_known_cycles_are_still_there(graph):
    """KNOWN_CYCLES only shrinks: a listed cycle that is gone must be dropped from it."""
    gone = [sorted(k) for k in KNOWN_CYCLES if not any(k <= c for c in _cycles(graph))]
    assert not gone, f"these cycles are gone; drop them from KNOWN_CYCLES: {gone}"


def test_nothing_inside_imports_the_facade(graph):
    """``zarrckpt/__init__.py`` sits on top: no module of the package imports it."""
    importers = sorted(graph.find_modules_that_directly_import("zarrckpt"))
    assert importers == [], f"import the module that defines the name instead: {importers}"


# ---------------------------------------------------------------- private names


@dataclass(frozen=True)
class Use:
    """``importer`` takes ``name`` from the zarrckpt module ``module`` (``name`` None: the
    module itself), by ``from module import name`` or as ``alias.name`` of an imported module."""

    importer: str
    module: str
    name: str | None
    line: int


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package) for every module of zarrckpt."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def package_uses() -> list[Use]:
    """Every use of a zarrckpt module or of a name from one, in every module of the package,
    top-level and inside functions alike."""
    modules = package_modules()
    uses = []
    for mod, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> zarrckpt module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_package else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != "zarrckpt" and not source.startswith("zarrckpt."):
                    continue
                for a in node.names:
                    if a.name == "*":
                        uses.append(Use(mod, source, None, node.lineno))
                    elif f"{source}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
                        uses.append(Use(mod, f"{source}.{a.name}", None, node.lineno))
                    else:
                        uses.append(Use(mod, source, a.name, node.lineno))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "zarrckpt" or a.name.startswith("zarrckpt."):
                        uses.append(Use(mod, a.name, None, node.lineno))
                        if a.asname:
                            aliases[a.asname] = a.name
                        elif a.name == "zarrckpt":
                            aliases["zarrckpt"] = "zarrckpt"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                source = aliases[node.value.id]
                if f"{source}.{node.attr}" in modules:
                    uses.append(Use(mod, f"{source}.{node.attr}", None, node.lineno))
                else:
                    uses.append(Use(mod, source, node.attr, node.lineno))
    return uses


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_private_name_crosses_a_package():
    """A private module (``storage._tensorstore``) or object (``_helper``) is imported only
    inside the package that holds it (``zarrckpt._optional``: anywhere in zarrckpt); a
    helper another package needs is public (no underscore, listed in ``__all__``)."""
    modules = package_modules()
    bad = set()
    for use in package_uses():
        parts = use.module.split(".")
        owner = next((".".join(parts[:i]) for i, p in enumerate(parts) if _private(p)), None)
        what = use.module
        if owner is None and use.name is not None and _private(use.name):
            owner = use.module if modules[use.module][1] else use.module.rsplit(".", 1)[0]
            what = f"{use.module}.{use.name}"
        if owner is not None and not _within(use.importer, owner):
            bad.add(f"{use.importer} (line {use.line}) uses {what}, private to {owner}")
    assert not bad, "\n".join(sorted(bad))
