"""The package's shape: who imports whom, how big things are, where NOTEs live.

graphscale's modules stand in layers (``LAYERS``, bottom first): a module
imports only modules on lower layers, counting imports inside functions, so
there is no import circle; the core and the tools never import an adapter
(they ask the registry, ``_core/registry.py``); no module writes into
another graphscale module (it calls a function of it); no module outgrows one
concern; every ``NOTE [ ... ]`` a comment or docstring cites exists, in the
file it names; and every file path the package cites exists.  Read from the
source with ``ast``: nothing is imported.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "graphscale"

# The folders, bottom first: the core, the native backend, the governed
# backward, then the adapters and the tools side by side (neither imports the
# other), then the face (graphscale/__init__.py, __main__.py, observe.py).
FOLDERS: list[tuple[str, ...]] = [("_core",), ("_native",), ("_backward",), ("_adapters", "_tools"), ("face",)]

# Modules, bottom first, folder by folder.  A module may import only modules on lower layers.
LAYERS: list[tuple[str, ...]] = [
    # _core/: groups, the snapshot, the walk and the plan, the adapter registry, errors, observation points
    ("_core", "_core.errors", "_core.registry", "_core.observation", "_core.table", "_core.releases"),
    ("_core.walk", "_core.group"),
    ("_core.plan", "_core.snapshot"),
    ("_core.request",),
    # _native/: the native backend
    ("_native.build",),
    ("_native",),
    # _backward/: the governed backward
    ("_backward.overrides", "_backward.gate"),
    ("_backward", "_backward.dynamo", "_backward.frames", "_backward.hooks", "_backward.sharing",
     "_backward.backend"),
    ("_backward.pyplan", "_backward.hints", "_backward.native_backend"),
    ("_backward.running",),
    ("_backward.call", "_backward.unreached"),
    ("_backward.decide",),
    ("_backward.route",),
    ("_backward.python_route",),
    ("_backward.entry",),
    ("_backward.selftest",),
    ("_backward.install",),
    # _tools/: explain, audit, diagnose, demo, env
    ("_tools", "_tools.explained", "_tools.leaf_rows"),
    ("_tools.audit_windows", "_tools.replay"),
    ("_tools.explain", "_tools.audit", "_tools.diagnose", "_tools.env"),
    ("_tools.demo",),
    # _adapters/: above everything they plug into
    ("_adapters", "_adapters.deepspeed.reads", "_adapters.fsdp"),
    ("_adapters.deepspeed.checks", "_adapters.deepspeed.hooks", "_adapters.deepspeed.failed",
     "_adapters.deepspeed.compiled"),
    ("_adapters.deepspeed.engine", "_adapters.deepspeed.watch"),
    ("_adapters.deepspeed",),
    # the face
    ("observe",),
    ("__init__",),
    ("__main__",),
]
# The functions that take torch.autograd.backward's own six parameters.
TORCH_SIGNATURE = {("_backward/entry.py", "governed_backward"), ("_backward/call.py", "of"),
                   ("_tools/diagnose.py", "_backward")}
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60  # code lines: the docstring not counted


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
        out[".".join(parts)] = path
    return out


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


MODULES = _modules()
LAYER = {m: k for k, layer in enumerate(LAYERS) for m in layer}


def folder(module: str) -> str:
    """The folder a module lives in ("face" for the package's own files)."""
    top = module.split(".")[0]
    return top if top.startswith("_") and top != "__init__" and top != "__main__" else "face"


FOLDER = {f: k for k, tier in enumerate(FOLDERS) for f in tier}
ADAPTERS = {m for m in MODULES if folder(m) == "_adapters"}
TOOLS = {m for m in MODULES if folder(m) == "_tools"}
CORE_AND_TOOLS = {m for m in MODULES if folder(m) in ("_core", "_native", "_backward", "_tools")}


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


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, code lines without the docstring, parameters) of every function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
            a = node.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            out.append((node.name, lines, params))
    return out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_functions_stay_small(name: str) -> None:
    path = MODULES[name]
    rel = path.relative_to(PKG).as_posix()
    size = len(path.read_text().splitlines())
    assert size <= MAX_MODULE_LINES, f"graphscale/{name}: {size} lines (> {MAX_MODULE_LINES}): split a concern out"
    long = [(f, n) for f, n, _ in _functions(path) if n > MAX_FUNCTION_LINES]
    assert not long, f"graphscale/{name}: functions over {MAX_FUNCTION_LINES} code lines: {long}"
    wide = [(f, p) for f, _, p in _functions(path) if p > 5 and (rel, f) not in TORCH_SIGNATURE]
    assert not wide, f"graphscale/{name}: functions with more than 5 parameters: {wide}"


NATIVE = sorted(p for p in (PKG / "_native").iterdir() if p.suffix in (".cpp", ".h"))
_CPP_NOISE = re.compile(r'//.*|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_CPP_SCOPE = re.compile(r"^\s*(?:namespace\b|(?:template\s*<[^>]*>\s*)?(?:struct|class|union|enum)\b)")
_CPP_CONTROL = re.compile(r"^\s*(?:if|for|while|switch|catch|else|do)\b")


def _cpp_functions(path: Path) -> list[tuple[str, int]]:
    """(first line, code lines) of every C++ function body defined at
    namespace or class scope (lambdas and blocks count with their function)."""
    stack: list[str] = []  # "scope" (namespace, class) or "body" per open brace
    out: list[tuple[str, int]] = []
    start, code, head = -1, 0, ""
    for raw in path.read_text().splitlines():
        line = _CPP_NOISE.sub("", raw)
        text = line.strip()
        if start >= 0 and text:
            code += 1
        at_scope = all(k == "scope" for k in stack)
        if at_scope and text and not text.startswith("#"):
            head = (head + " " + text) if not head.endswith(";") and not head.endswith("}") else text
        for ch in line:
            if ch == "{":
                body = at_scope and not _CPP_SCOPE.match(head) and "(" in head and not _CPP_CONTROL.match(head)
                stack.append("body" if body or not at_scope else "scope")
                if body and start < 0:
                    start, code = len(out), 1
                    out.append((raw.strip()[:80], 0))
                at_scope = False
            elif ch == "}" and stack:
                stack.pop()
                if start >= 0 and all(k == "scope" for k in stack):
                    out[start] = (out[start][0], code)
                    start = -1
                at_scope = all(k == "scope" for k in stack)
        if at_scope and (text.endswith(";") or text.endswith("}") or text.endswith("{")):
            head = ""
    return out


@pytest.mark.parametrize("path", NATIVE, ids=lambda p: p.name)
def test_native_files_and_functions_stay_small(path: Path) -> None:
    """The size rules of the Python modules, for the native walker's C++."""
    size = len(path.read_text().splitlines())
    assert size <= MAX_MODULE_LINES, f"{path.name}: {size} lines (> {MAX_MODULE_LINES}): split a concern out"
    long = [(f, n) for f, n in _cpp_functions(path) if n > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} code lines: {long}"


_NOTE = re.compile(r"NOTE \[ (.+?) \](?: in (?:graphscale/)?([\w/]+\.(?:py|cpp|h)))?")


def _flat(text: str) -> str:
    """Comments and docstrings as one line of words (references wrap lines)."""
    return " ".join(line.strip().lstrip("#/").strip() for line in text.splitlines())


def test_every_note_cited_exists_in_the_file_it_names() -> None:
    files = {p.relative_to(PKG).as_posix(): p.read_text() for p in PKG.rglob("*") if p.suffix in (".py", ".cpp", ".h")}
    defined: dict[str, set[str]] = {}
    for rel, text in files.items():
        for m in re.finditer(r"^\s*(?:#|//)?\s*NOTE \[ (.+?) \]\s*$", text, re.M):
            defined.setdefault(m.group(1), set()).add(rel)
    broken = []
    for rel, text in files.items():
        for m in _NOTE.finditer(_flat(text)):
            title, where = m.group(1), m.group(2)
            homes = defined.get(title, set())
            if not homes:
                broken.append(f"{rel}: NOTE [ {title} ] is defined nowhere")
            elif where is not None and not any(h == where or h.endswith("/" + where) for h in homes):
                broken.append(f"{rel}: NOTE [ {title} ] is in {sorted(homes)}, not {where}")
    assert not broken, "\n".join(broken)


def _bound_modules(name: str, is_package: bool, tree: ast.AST) -> dict[str, str]:
    """The local names under which module ``name`` binds a graphscale module
    (``from . import route as _route``, ``import graphscale._backward.route as r``)."""
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
        for part in reversed(dotted):  # graphscale._backward.route: the deepest module named
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
    pytest.param("from . import route as _route\n_route._self_test = f\n", True, id="an assignment"),
    pytest.param("from . import route\nroute.count += 1\n", True, id="an augmented assignment"),
    pytest.param("from . import route as _route\nsetattr(_route, 'enabled', False)\n", True, id="setattr"),
    pytest.param("from .. import _native\ndel _native._module\n", True, id="del"),
    pytest.param("import graphscale._backward.route\ngraphscale._backward.route.enabled = 0\n", True,
                 id="through the package"),
    pytest.param("import torch\ntorch.autograd.backward = governed\n", False, id="torch's module"),
    pytest.param("from .frames import CARRIES_ATTR\nsetattr(tensor, CARRIES_ATTR, 2.0)\n", False, id="an object"),
    pytest.param("from . import route as _route\n_route.state.value = 1\nx = _route.enabled\n", False,
                 id="an object held by the module, and a read"),
])
def test_the_write_check_catches_writes_into_a_module_and_nothing_else(source: str, caught: bool) -> None:
    assert bool(writes_into_other_modules("_backward.entry", source)) is caught


# A cited file: a path ending in .py, .cpp or .h, relative to the repository
# (graphscale/..., tests/...), to the package (_backward/x.py) or a bare name
# (x.py: a file of that name somewhere in the package or the repository).
_CITED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|cpp|h))\b")
# their paths are theirs
THIRD_PARTY = {"torch", "ATen", "c10", "deepspeed", "transformers", "accelerate", "pybind11", "Python.h"}


def test_every_file_path_the_package_cites_exists() -> None:
    repo = PKG.parent
    present = {p.relative_to(repo).as_posix() for top in ("graphscale", "tests", "benchmarks", "examples", "scripts")
               for p in (repo / top).rglob("*") if p.suffix in (".py", ".cpp", ".h")}
    broken = []
    for path in sorted(PKG.rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h"):
            continue
        rel = path.relative_to(PKG).as_posix()
        for cited in sorted(set(_CITED.findall(path.read_text()))):
            if cited.split("/")[0] in THIRD_PARTY:
                continue
            if cited in present or f"graphscale/{cited}" in present or any(
                    p.endswith("/" + cited) for p in present):
                continue
            broken.append(f"graphscale/{rel} cites {cited}, which does not exist")
    assert not broken, "\n".join(broken)
