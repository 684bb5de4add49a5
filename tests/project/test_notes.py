"""Notes that read (issue 49, item 5): no NOTE is defined inside a docstring,
every citation of a NOTE fits on its line, a module docstring says what the
module is for in a few lines, each NOTE title is defined once, and every
"Full record" a NOTE points to exists in docs/.  That every cited NOTE exists
where it is said to be: tests/project/test_sizes_and_citations.py."""
from __future__ import annotations

import ast
import re

import pytest

from helpers.package import PKG


def _flat(text: str) -> str:
    """Comments and docstrings as one line of words (references wrap lines)."""
    return " ".join(line.strip().lstrip("#/").strip() for line in text.splitlines())

# Notes that read (issue 49, item 5), for every Python module of the package:
# no NOTE is defined inside a docstring, every citation has its "]" on its line,
# and a module docstring says what the module is for in a few lines.
NOTES_REVISED = {p.relative_to(PKG).as_posix() for p in sorted(PKG.rglob("*.py"))}
# The C++ (comments only): every citation has its "]" on its line too.
NATIVE_FILES = sorted(p.relative_to(PKG).as_posix() for p in (*(PKG / "_native").rglob("*.h"),
                                                             *(PKG / "_native").rglob("*.cpp")))
MAX_MODULE_DOCSTRING_LINES = 8  # its doctest example not counted
_NOTE_DEFINED = re.compile(r"^\s*(?:#|//)?\s*NOTE \[ (.+?) \]\s*$", re.M)


def _docstrings(tree: ast.AST) -> list[tuple[str, str]]:
    """(where, text) of the module's docstring and of every class and function in it."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((getattr(node, "name", "the module"), doc))
    return found


def test_the_rules_cover_the_whole_package() -> None:
    """Every module and every C++ file is read by the rules (a glob that
    found nothing would pass every test above)."""
    assert "_entry/entry.py" in NOTES_REVISED and "_routes/native.py" in NOTES_REVISED
    assert "_native/walker.cpp" in NATIVE_FILES and "_native/planner/walk.h" in NATIVE_FILES


@pytest.mark.parametrize("rel", sorted(NOTES_REVISED))
def test_no_note_is_defined_inside_a_docstring(rel: str) -> None:
    """A NOTE is a comment block beside the code it explains (after the
    imports for a module-wide one); a docstring says what its object is for."""
    inside = [f"{where}: NOTE [ {m.group(1)} ]" for where, doc in _docstrings(ast.parse((PKG / rel).read_text()))
              for m in _NOTE_DEFINED.finditer(doc)]
    assert not inside, f"graphscale/{rel} defines NOTEs inside docstrings: {inside}; move each to a # comment block"


@pytest.mark.parametrize("rel", sorted(NOTES_REVISED) + NATIVE_FILES)
def test_every_note_citation_fits_on_one_line(rel: str) -> None:
    """'See NOTE [ X ] in file.py.' is read at a glance; a title wrapped over
    two lines is not (nor found by grep)."""
    wrapped = [f"{i}: {line.strip()}" for i, line in enumerate((PKG / rel).read_text().splitlines(), 1)
               if any("]" not in line[m.end():] for m in re.finditer(r"NOTE \[", line))]
    assert not wrapped, f"graphscale/{rel}: NOTE citations wrapped across lines: {wrapped}"


@pytest.mark.parametrize("rel", sorted(NOTES_REVISED))
def test_module_docstrings_say_what_the_module_is_for_in_a_few_lines(rel: str) -> None:
    doc = ast.get_docstring(ast.parse((PKG / rel).read_text())) or ""
    prose = []
    for line in doc.splitlines():
        if line.lstrip().startswith(">>>") or line.strip() in ("Example::", "Example:"):
            break
        prose.append(line)
    assert len(prose) <= MAX_MODULE_DOCSTRING_LINES, (
        f"graphscale/{rel}: a {len(prose)}-line module docstring (> {MAX_MODULE_DOCSTRING_LINES}): say what the "
        "module is for; details go to a NOTE, a function's docstring or docs/")


def test_each_note_title_is_defined_once_in_the_package() -> None:
    homes: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h"):
            for m in _NOTE_DEFINED.finditer(path.read_text()):
                homes.setdefault(m.group(1), []).append(path.relative_to(PKG).as_posix())
    twice = {title: where for title, where in homes.items() if len(where) > 1}
    assert not twice, f"NOTE titles defined more than once: {twice}"


def test_every_full_record_a_note_points_to_exists() -> None:
    """A NOTE shortened to its decision ends 'Full record: docs/<page>.md,
    '<heading>'': that page has that heading."""
    docs = PKG.parent / "docs"
    broken = []
    for path in sorted(PKG.rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h"):
            continue
        for page, heading in re.findall(r"Full record: docs/([\w.-]+\.md), '([^']+)'", _flat(path.read_text())):
            text = (docs / page).read_text() if (docs / page).is_file() else ""
            if not re.search(rf"^#+ {re.escape(heading)}\s*$", text, re.M):
                broken.append(f"{path.relative_to(PKG).as_posix()}: docs/{page} has no heading '{heading}'")
    assert not broken, "\n".join(broken)

