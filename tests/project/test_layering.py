"""The package's shape: who imports whom, how big things are, where NOTEs live.

graphscale's modules stand in layers (``LAYERS``, bottom first): a module
imports only modules on lower layers, counting imports inside functions, so
there is no import circle; the core and the tools never import an adapter
(they ask the registry, ``_core/registry.py``); no module writes into
another graphscale module (it calls a function of it); no module outgrows one
concern; every ``NOTE [ ... ]`` a comment or docstring cites exists, in the
file it names; and every file path the package cites exists.  Read from the
source with ``ast``: nothing is imported.

This file: layers, folders, the import graph and writes across modules.
How big modules, functions and native files may grow, and the NOTEs and
paths the package cites: test_sizes_and_citations.py.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.package import MODULES

# The folders, bottom first: the core, then the native extension's loader and
# the Python planner side by side (neither imports the other), the parts of a
# governed backward, the two routes, the entry (the patch and install), then
# the adapters and the tools side by side, then the face (graphscale/__init__.py,
# __main__.py, observe.py).
FOLDERS: list[tuple[str, ...]] = [("_core",), ("_native", "_planner"), ("_backward",), ("_routes",), ("_entry",),
                                  ("_adapters", "_tools"), ("face",)]
MAX_FLOORS = 6  # import floors inside one folder: rooms, not a tower

# Modules, bottom first, folder by folder.  A module may import only modules on lower layers.
LAYERS: list[tuple[str, ...]] = [
    # _core/: groups, the snapshot, the adapter registry, errors, observation points
    ("_core", "_core.errors", "_core.registry", "_core.observation", "_core.table", "_core.releases"),
    ("_core.group",),
    ("_core.snapshot",),
    # _native/: the extension's build and loader
    ("_native.build",),
    ("_native",),
    # _planner/: the Python planner, twin of _native/planner/ file for file
    ("_planner", "_planner.nodes", "_planner.request"),
    ("_planner.walk", "_planner.pins", "_planner.probe"),
    ("_planner.potentials",),
    ("_planner.plan",),
    # _backward/: what a governed backward is made of
    ("_backward", "_backward.overrides", "_backward.gate", "_backward.dynamo", "_backward.frames", "_backward.hints",
     "_backward.backend"),
    ("_backward.python_backend", "_backward.native_backend", "_backward.unreached"),
    ("_backward.running",),
    ("_backward.call", "_backward.decide"),
    # _routes/: the native route, the Python route, the self-test of one against the other
    ("_routes", "_routes.hooks", "_routes.native"),
    ("_routes.python", "_routes.selftest"),
    # _entry/: the patched torch.autograd.backward, install
    ("_entry", "_entry.entry"),
    ("_entry.install",),
    # _tools/: explain, audit, diagnose, demo, env
    ("_tools", "_tools.explained", "_tools.leaf_rows"),
    ("_tools.audit_windows", "_tools.replay"),
    ("_tools.explain", "_tools.audit", "_tools.diagnose", "_tools.env"),
    ("_tools.demo",),
    # _adapters/: above everything they plug into
    ("_adapters", "_adapters.deepspeed.reads", "_adapters.fsdp"),
    ("_adapters.deepspeed.checks", "_adapters.deepspeed.hooks", "_adapters.deepspeed.failed",
     "_adapters.deepspeed.compiled", "_adapters.deepspeed.ending"),
    ("_adapters.deepspeed.engine", "_adapters.deepspeed.watch"),
    ("_adapters.deepspeed",),
    # the face
    ("observe",),
    ("__init__",),
    ("__main__",),
]


def _imports(name: str, path: Path) -> set[str]:
    """Every graphscale module ``name`` imports, anywhere in the file."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package = []
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "graphscale" or alias.name.startswith("graphscale."):
                    found.add(alias.name.removeprefix("graphscale").lstrip(".") or "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module is None or not (node.module == "graphscale" or node.module.startswith("graphscale.")):
                    continue
                base: list[str] = node.module.split(".")[1:]
            else:
                base = (package[: len(package) - (node.level - 1)] if node.level > 1 else list(package))
                base = base + (node.module.split(".") if node.module else [])
            prefix = ".".join(base)
            if node.module is None or node.level == 0 and not base:
                for alias in node.names:  # from . import _x / from graphscale import _x
                    candidate = f"{prefix}.{alias.name}" if prefix else alias.name
                    found.add(candidate if candidate in MODULES else (prefix or "__init__"))
            else:
                found.add(prefix or "__init__")
    found.discard(name)
    return found


LAYER = {m: k for k, layer in enumerate(LAYERS) for m in layer}


def folder(module: str) -> str:
    """The folder a module lives in ("face" for the package's own files)."""
    top = module.split(".")[0]
    return top if top.startswith("_") and top != "__init__" and top != "__main__" else "face"


FOLDER = {f: k for k, tier in enumerate(FOLDERS) for f in tier}
ADAPTERS = {m for m in MODULES if folder(m) == "_adapters"}
TOOLS = {m for m in MODULES if folder(m) == "_tools"}
CORE_AND_TOOLS = {m for m in MODULES if folder(m) not in ("_adapters", "face")}


def test_every_module_has_a_layer() -> None:
    assert set(MODULES) == set(LAYER), (
        f"modules without a layer: {sorted(set(MODULES) - set(LAYER))}; "
        f"layers naming no module: {sorted(set(LAYER) - set(MODULES))}"
    )


def test_every_module_lives_in_a_folder_of_the_architecture() -> None:
    assert {folder(m) for m in MODULES} <= set(FOLDER), sorted({folder(m) for m in MODULES} - set(FOLDER))
    layer_folders = [FOLDER[folder(m)] for layer in LAYERS for m in layer]
    assert layer_folders == sorted(layer_folders), "LAYERS must list the folders bottom first, one after another"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_folder_imports_only_its_own_folder_and_folders_below(name: str) -> None:
    here = FOLDER[folder(name)]
    bad = sorted(m for m in _imports(name, MODULES[name])
                 if FOLDER[folder(m)] > here or (FOLDER[folder(m)] == here and folder(m) != folder(name)))
    assert not bad, f"graphscale/{name} ({folder(name)}/) imports {bad}, from a folder on its own tier or above"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_imports_only_modules_below_it(name: str) -> None:
    upward = sorted(m for m in _imports(name, MODULES[name]) if LAYER.get(m, -1) >= LAYER[name])
    assert not upward, f"graphscale/{name} imports {upward}, on its own layer or above"


@pytest.mark.parametrize("name", sorted(CORE_AND_TOOLS))
def test_the_core_and_the_tools_never_import_an_adapter_or_the_package(name: str) -> None:
    bad = sorted(_imports(name, MODULES[name]) & (ADAPTERS | {"__init__"}))
    assert not bad, f"graphscale/{name} imports {bad}: ask graphscale/_core/registry.py's registry instead"


def test_the_import_graph_has_no_cycle() -> None:
    graph = {m: _imports(m, p) & set(MODULES) for m, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(start: str) -> list[str] | None:
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_folder_is_a_tower() -> None:
    """Within a folder, the longest chain of imports between its own modules
    is at most MAX_FLOORS: a folder is a set of rooms a reader enters in any
    order, not a tower climbed floor by floor."""
    graph = {m: _imports(m, p) & set(MODULES) for m, p in MODULES.items()}
    floor: dict[str, int] = {}
    for layer in LAYERS:  # bottom first: a module's imports have their floors already
        for m in layer:
            floor[m] = 1 + max((floor[d] for d in graph[m] if folder(d) == folder(m) and d in floor), default=0)
    towers = {f: max(k for m, k in floor.items() if folder(m) == f) for f in {folder(m) for m in MODULES}}
    assert max(towers.values()) <= MAX_FLOORS, f"import floors per folder: {towers} (at most {MAX_FLOORS})"


def _bound_modules(name: str, is_package: bool, tree: ast.AST) -> dict[str, str]:
    """The local names under which module ``name`` binds a graphscale module
    (``from . import route as _route``, ``import graphscale._routes.native as r``)."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    if name == "__init__":
        package = []
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "graphscale" or alias.name.startswith("graphscale."):
                    target = alias.name if alias.asname else "graphscale"
                    bound[alias.asname or "graphscale"] = target.removeprefix("graphscale").lstrip(".") or "__init__"
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module == "graphscale" or (node.module or "").startswith("graphscale.")):
                    continue
                base = (node.module or "").split(".")[1:]
            else:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else list(package)
                base = base + (node.module.split(".") if node.module else [])
            for alias in node.names:
                candidate = ".".join([*base, alias.name])
                if candidate in MODULES:
                    bound[alias.asname or alias.name] = candidate
    return bound


def writes_into_other_modules(name: str, source: str, is_package: bool = False) -> list[str]:
    """Every write of module ``name`` into an attribute of another graphscale
    module: ``other.attr = ...`` (augmented, annotated, ``del`` too) and
    ``setattr``/``delattr(other, ...)``, as ``"line: what"``."""
    tree = ast.parse(source)
    bound = _bound_modules(name, is_package, tree)

    def module_of(expr: ast.expr) -> str | None:
        dotted = []
        while isinstance(expr, ast.Attribute):
            dotted.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name) or expr.id not in bound:
            return None
        module = bound[expr.id]
        for part in reversed(dotted):  # graphscale._routes.native: the deepest module named
            deeper = part if module == "__init__" else f"{module}.{part}"
            if deeper not in MODULES:
                return None
            module = deeper
        return module if module != name else None

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args and module_of(node.args[0]) is not None):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        for target in targets:
            for t in ast.walk(target):  # (a, other.x) = ...: each stored name; other.obj.x = ... stores into obj
                if (isinstance(t, ast.Attribute) and isinstance(t.ctx, (ast.Store, ast.Del))
                        and module_of(t.value) is not None):
                    found.append(f"{node.lineno}: {ast.unparse(t)} (in graphscale.{module_of(t.value)})")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_writes_into_another_graphscale_module(name: str) -> None:
    """No hidden links: a module that needs another one to hold something
    calls a function of it (``route.register_self_test``), so that a reader of
    the module holding the value finds every way it is set.  Writes into
    torch's and DeepSpeed's modules and classes (the patch of
    ``torch.autograd.backward``, the hook-manager descriptors) are what those
    modules are for, and are not into graphscale: outside this rule."""
    path = MODULES[name]
    bad = writes_into_other_modules(name, path.read_text(), path.name == "__init__.py")
    assert not bad, f"graphscale/{name} writes into another graphscale module: {bad}; call a function of it instead"


@pytest.mark.parametrize("source, caught", [
    pytest.param("from . import native as _route\n_route._self_test = f\n", True, id="an assignment"),
    pytest.param("from . import native\nnative.count += 1\n", True, id="an augmented assignment"),
    pytest.param("from . import native as _route\nsetattr(_route, 'enabled', False)\n", True, id="setattr"),
    pytest.param("from .. import _native\ndel _native._module\n", True, id="del"),
    pytest.param("import graphscale._routes.native\ngraphscale._routes.native.enabled = 0\n", True,
                 id="through the package"),
    pytest.param("import torch\ntorch.autograd.backward = governed\n", False, id="torch's module"),
    pytest.param("from .frames import CARRIES_ATTR\nsetattr(tensor, CARRIES_ATTR, 2.0)\n", False, id="an object"),
    pytest.param("from . import native as _route\n_route.state.value = 1\nx = _route.enabled\n", False,
                 id="an object held by the module, and a read"),
])
def test_the_write_check_catches_writes_into_a_module_and_nothing_else(source: str, caught: bool) -> None:
    assert bool(writes_into_other_modules("_routes.python", source)) is caught
