"""The package stays readable: modules, functions and native files stay
small (``MAX_MODULE_LINES``, the same rule tests/project/test_tree.py holds
the tests to), every NOTE cited exists in the file it names, and every file
path the package cites exists.  Layers and imports: tests/project/test_layering.py.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers.package import MAX_MODULE_LINES, MODULES, PKG

# The functions that take torch.autograd.backward's own six parameters.
TORCH_SIGNATURE = {("_entry/entry.py", "governed_backward"), ("_backward/call.py", "of"),
                   ("_tools/diagnose.py", "_backward")}


MAX_FUNCTION_LINES = 60  # code lines: the docstring not counted


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


NATIVE = sorted(p for p in (PKG / "_native").rglob("*") if p.suffix in (".cpp", ".h"))  # planner/ too
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


@pytest.mark.parametrize("path", NATIVE, ids=lambda p: p.relative_to(PKG / "_native").as_posix())
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
