"""The twin map, checked both ways: every Python module that has a C++ twin
names it and every C++ file names its Python twin, and every identifier a
comment, a docstring or ``docs/native-walker.md`` cites — ``module.attribute``,
``file.py function``, ``file.h function`` — exists where it is said to be.  A
rename on one side must break this test, never leave a stale pointer.

Read from the source (``ast`` for Python, words for C++): nothing is imported.
"""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from helpers.paths import REPO

PKG = REPO / "graphscale"
NATIVE = PKG / "_native"
DOC = REPO / "docs" / "native-walker.md"

# Module names that are also everyday variable names in comments ("the call",
# "plan.seeds", "native.front"): a bare ``name.attr`` with one of them is not
# read as a module reference (a path-qualified one still is).
AMBIGUOUS = {"call", "plan", "walk", "native", "python", "hooks", "group", "backend", "nodes", "pins", "probe",
             "request", "potentials", "build", "errors", "table", "env", "audit", "demo", "explain", "diagnose",
             "engine", "state", "self", "torch", "deepspeed", "failed", "reads", "checks", "watch", "compiled"}


def _python_files() -> dict[str, Path]:
    return {p.relative_to(PKG).as_posix(): p for p in sorted(PKG.rglob("*.py"))}


def _cpp_files() -> dict[str, Path]:
    return {p.relative_to(NATIVE).as_posix(): p for p in sorted(NATIVE.rglob("*")) if p.suffix in (".h", ".cpp")}


@cache
def _defined(path: Path) -> frozenset[str]:
    """Every name a Python module defines: functions, classes (and their
    methods and class attributes, also as ``Class.name``), module-level
    assignments and imports."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    member = None
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        member = item.name
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        member = item.target.id
                    elif isinstance(item, ast.Assign):
                        for t in item.targets:
                            if isinstance(t, ast.Name):
                                names.update({t.id, f"{node.name}.{t.id}"})
                            elif isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                                names.update({t.attr, f"{node.name}.{t.attr}"})
                    if member:
                        names.update({member, f"{node.name}.{member}"})
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


@cache
def _cpp_words(path: Path) -> frozenset[str]:
    """The identifiers a C++ file's code (not its comments) holds, also as
    ``A::b`` where it defines ``b`` inside ``A``."""
    code = re.sub(r"//.*", "", path.read_text())
    words = set(re.findall(r"[A-Za-z_]\w*(?:::[A-Za-z_]\w*)*", code))
    return frozenset(words | {w.split("::")[-1] for w in words} | {p for w in words for p in w.split("::")})


def _python_twin(cited: str) -> Path | None:
    """A cited Python file (``graphscale/_x/y.py``, ``_x/y.py``) as a path, or None."""
    rel = cited.removeprefix("graphscale/")
    path = PKG / rel
    return path if path.is_file() else None


def _cpp_twin(cited: str) -> Path | None:
    rel = cited.removeprefix("graphscale/").removeprefix("_native/")
    path = NATIVE / rel
    if path.is_file():
        return path
    found = [p for p in _cpp_files().values() if p.name == Path(rel).name]
    return found[0] if len(found) == 1 else None


def _aliases() -> dict[str, set[str]]:
    """Every name under which the package binds one of its own modules
    (``running``, ``_route`` -> ``route``), leading underscores dropped:
    what comments call the module by."""
    out: dict[str, set[str]] = {}
    for rel in _python_files():
        stem = Path(rel).stem if Path(rel).stem != "__init__" else Path(rel).parent.name
        out.setdefault(stem.lstrip("_"), set()).add(rel)
    for rel, path in _python_files().items():
        pkg = Path(rel).parent
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = pkg
                for _ in range(node.level - 1):
                    base = base.parent
                for a in node.names:
                    target = base / (node.module or "").replace(".", "/") / f"{a.name}.py"
                    if (PKG / target).is_file() and a.asname:
                        out.setdefault(a.asname.lstrip("_"), set()).add(target.as_posix())
    return out


ALIASES = _aliases()
_MODULE_ATTR = re.compile(r"(?<![\w./])([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)\b(?!\.(?:py|h|cpp)\b)")
# "file.py name": a name is read as code when quoted in backticks or shaped
# like code (an underscore, a capital, "::" or a dot); "walker.cpp is" is prose.
_DOTTED = re.compile(r"\bgraphscale((?:\.[A-Za-z_]\w*)+)")
_FILE_NAME = re.compile(r"(?<![\w/.])((?:graphscale/)?(?:_[a-z]+/)*[a-z_]+\.(py|h|cpp))(?:'s)?[ \t]+"
                        r"(``|`)?([A-Za-z_][\w.:]*)")


def _comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a file."""
    text = path.read_text()
    if path.suffix == ".py":
        out = [(n, line.split("#", 1)[1]) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and node.body:
                    first = node.body[0].lineno
                    out += [(first + k, line) for k, line in enumerate(doc.splitlines())]
        return out
    return [(n, line.split("//", 1)[1]) for n, line in enumerate(text.splitlines(), 1) if "//" in line]


def _exists(where: Path, name: str) -> bool:
    if where.suffix == ".py":
        return name.split(".")[0] in _defined(where) or name in _defined(where)
    return name in _cpp_words(where) or name.split("::")[-1] in _cpp_words(where)


def stale_references(path: Path, lines: list[tuple[int, str]]) -> list[str]:
    """Every cited identifier in ``lines`` (of ``path``) that does not exist where it is said to be."""
    bad = []
    for n, line in lines:
        for cited, _, quoted, name in _FILE_NAME.findall(line):
            name = name.rstrip(".:")
            if not quoted and not re.search(r"[_A-Z.]|::", name):
                continue
            where = _python_twin(cited) if cited.endswith(".py") else _cpp_twin(cited)
            if where is not None and not _exists(where, name.strip(".")):
                bad.append(f"{path.relative_to(REPO)}:{n}: {cited} has no {name}")
        for dotted in _DOTTED.findall(line):  # graphscale._backward.running.bindings
            parts = dotted.strip(".").split(".")
            for k in range(len(parts), -1, -1):
                base = PKG.joinpath(*parts[:k]) if k else PKG
                module = base.with_suffix(".py") if k and base.with_suffix(".py").is_file() else base / "__init__.py"
                if module.is_file():
                    if k < len(parts) and not _exists(module, parts[k]):
                        bad.append(f"{path.relative_to(REPO)}:{n}: graphscale{dotted} names nothing")
                    break
            else:
                bad.append(f"{path.relative_to(REPO)}:{n}: graphscale{dotted}: no such module")
        for module, attr in _MODULE_ATTR.findall(line):
            if module in AMBIGUOUS or module not in ALIASES or attr in ("py", "h", "cpp"):
                continue
            homes = [PKG / rel for rel in ALIASES[module]]
            if not any(_exists(h, attr) for h in homes):
                bad.append(f"{path.relative_to(REPO)}:{n}: {module}.{attr} names nothing in "
                           f"{sorted(ALIASES[module])}")
    return bad


def test_every_identifier_a_comment_cites_exists() -> None:
    bad: list[str] = []
    for path in [*_python_files().values(), *_cpp_files().values()]:
        bad += stale_references(path, _comments(path))
    assert not bad, "stale references (rename the citation or the thing):\n" + "\n".join(bad)


def _map_rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.match(r"`[\w/]+\.(h|cpp)`", cells[0]):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def test_the_map_in_the_docs_names_only_what_exists() -> None:
    """docs/native-walker.md's table: each C++ file exists and holds the
    identifiers its row names; each Python twin exists and defines the
    identifiers named after it."""
    rows = _map_rows()
    assert rows, "docs/native-walker.md has no map of C++ files to Python twins"
    bad = []
    for cpp, what, twin in rows:
        cpp_path = _cpp_twin(cpp.strip("`"))
        if cpp_path is None:
            bad.append(f"{cpp}: no such C++ file")
            continue
        for name in re.findall(r"`([A-Za-z_][\w:]*)`", what):
            if not _exists(cpp_path, name):
                bad.append(f"{cpp}: no {name}")
        current: Path | None = None
        for token in re.findall(r"`([^`]+)`", twin):
            if re.fullmatch(r"[\w/]+\.py", token):
                current = _python_twin(token)
                if current is None:
                    bad.append(f"{cpp}'s twin {token}: no such file")
            elif current is not None and re.fullmatch(r"[A-Za-z_][\w.]*", token) and not _exists(current, token):
                bad.append(f"{cpp}'s twin {current.relative_to(PKG)}: no {token}")
    assert not bad, "\n".join(bad)


def test_twins_name_each_other() -> None:
    """Each C++ file's first comment names its Python twin(s), every one of
    which exists, and at least one of them names the C++ file back."""
    bad = []
    for rel, path in _cpp_files().items():
        head = " ".join(line for _, line in _comments(path)[:12])
        twins = re.findall(r"(?:graphscale/)?((?:_[a-z]+/)+[a-z_]+\.py)", head)
        if not twins:
            bad.append(f"_native/{rel}: its first comment names no Python twin")
            continue
        found = [(twin, _python_twin(twin)) for twin in twins]
        bad += [f"_native/{rel}: names {twin}, which does not exist" for twin, py in found if py is None]
        if not any(py is not None and path.name in py.read_text() for _, py in found):
            bad.append(f"_native/{rel}: none of its twins {sorted(set(twins))} names {path.name} back")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("line, stale", [
    pytest.param("// the map (running._by_task) of running tasks", True, id="a renamed module attribute"),
    pytest.param("// the map (running.bindings) of running tasks", False, id="the attribute as it is"),
    pytest.param("// in graphscale._backward.running._by_task", True, id="a dotted path to a renamed attribute"),
    pytest.param("// in graphscale._backward.gone.enabled", True, id="a dotted path to a module that is gone"),
    pytest.param("// in graphscale._backward.running.bindings", False, id="a dotted path as it is"),
    pytest.param("// see graphscale/_backward/running.py binding_for", False, id="a file and its function"),
    pytest.param("// see graphscale/_backward/running.py binding_for_task", True, id="a file and a missing function"),
])
def test_the_check_catches_a_stale_reference(line: str, stale: bool) -> None:
    assert bool(stale_references(NATIVE / "walker.cpp", [(1, line.split("//", 1)[1])])) is stale
