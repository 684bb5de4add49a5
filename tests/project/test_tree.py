"""The tests are a tree (issue 49 item 7): family folders under tests/, each a
package that says what it pins; what the tests share in the ``helpers``
package, never in conftest.py; every file as short as a module of the
package must be (``MAX_MODULE_LINES``).  Each test reports every offender
at once."""
from __future__ import annotations

import ast
import importlib.machinery
import sys
from pathlib import Path

from helpers.package import MAX_MODULE_LINES
from helpers.paths import TESTS

FILES = sorted(TESTS.rglob("*.py"))
FOLDERS = sorted(p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))


def _rel(path: Path) -> str:
    return str(path.relative_to(TESTS.parent))


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_file_under_tests_is_longer_than_a_module_of_the_package_may_be() -> None:
    long = {_rel(p): n for p in FILES if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"over {MAX_MODULE_LINES} lines (split it by the behaviour it pins): {long}"


def test_every_test_file_lives_in_a_family_folder() -> None:
    loose = [_rel(p) for p in TESTS.glob("*.py") if p.name != "conftest.py"]
    assert not loose, f"files loose in tests/ (move each into the family it pins): {loose}"


def test_every_folder_is_a_package_that_says_what_it_holds() -> None:
    """An __init__.py with a docstring, so two families may hold files of the
    same name and a newcomer reads each family's job in one place."""
    bad = []
    for folder in FOLDERS + sorted(p for f in FOLDERS for p in f.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        if not init.exists() or not ast.get_docstring(ast.parse(init.read_text())):
            bad.append(_rel(folder))
    assert not bad, f"folders without an __init__.py that has a docstring: {bad}"


def test_no_folder_shadows_an_importable_module() -> None:
    """tests/ is on sys.path (pyproject's pythonpath): a folder named like a
    package the tests use (a tests/deepspeed/) would be imported in its place."""
    elsewhere = [p for p in sys.path if p and Path(p).resolve() != TESTS]
    shadowing = [f.name for f in FOLDERS
                 if f.name in sys.stdlib_module_names
                 or importlib.machinery.PathFinder.find_spec(f.name, elsewhere) is not None]
    assert not shadowing, f"folders under tests/ named like an importable module: {shadowing}"


def test_no_test_imports_conftest_or_another_test_module() -> None:
    """What tests share lives in the helpers package; conftest.py holds only
    pytest's hooks and fixtures (pytest advises against importing it)."""
    bad = {}
    for path in FILES:
        wrong = sorted(m for m in _imported(path)
                       if m.split(".")[0] == "conftest" or m.split(".")[-1].startswith("test_"))
        if wrong:
            bad[_rel(path)] = wrong
    assert not bad, f"imports of conftest or of test modules (move what is shared to tests/helpers/): {bad}"
