"""The native planner core holds no Python: each header in
graphscale/_native/planner/ compiles alone against torch's C++ headers,
without Python's, and names nothing of Python's or pybind11's API
(issue 49 item 2; docs/native-walker.md, "The C++ and its Python twins").

A header that includes Python.h, pybind11 or one of torch's
``torch/csrc/autograd/python_*.h`` fails to compile here: Python's include
directory is not on the path.  A header that leans on one included before it
(as the headers did while walker.cpp included them "once, in order") fails
on its first unknown name.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils import cpp_extension

REPO = Path(__file__).resolve().parents[2]
PLANNER = REPO / "graphscale" / "_native" / "planner"
HEADERS = sorted(PLANNER.glob("*.h")) if PLANNER.is_dir() else []
# The concepts the planner is made of (each its own header).
CONCEPTS = ("nodes.h", "walk.h", "pins.h", "potentials.h", "probe.h", "plan.h")
PYTHON_API = ("py::", "PyObject", "pybind11", "Python.h", "torch/csrc/autograd/python_")
NAMESPACE = "namespace graphscale::planner {"
# As graphscale/_native/build.py builds walker.cpp (its release flags, and what torch's extension
# builder adds), but -fsyntax-only and without Python's include directory.  c++20: torch's own
# standard for extensions (torch 2.15's ATen refuses anything older: "C++20 or later ... is required").
CXXFLAGS = ("-std=c++20", "-fsyntax-only", "-fPIC", "-O3", "-DNDEBUG", "-DTORCH_API_INCLUDE_EXTENSION_H")
GXX = shutil.which("g++")


def test_the_planner_folder_has_one_header_per_concept() -> None:
    present = {p.name for p in HEADERS}
    missing = [name for name in CONCEPTS if name not in present]
    assert not missing, f"graphscale/_native/planner/ lacks {missing} (has {sorted(present)})"


@pytest.mark.parametrize("header", HEADERS, ids=lambda p: p.name)
def test_a_planner_header_names_no_python_api(header: Path) -> None:
    text = header.read_text()
    found = [word for word in PYTHON_API if word in text]
    assert not found, f"planner/{header.name} mentions {found}: the planner core holds no Python"
    assert NAMESPACE in text, f"planner/{header.name}: its code belongs in `{NAMESPACE} ... }}`"


@pytest.mark.parametrize("header", HEADERS, ids=lambda p: p.name)
def test_a_planner_header_names_its_python_twin_first(header: Path) -> None:
    first = re.match(r"(?:\s*//[^\n]*\n)*", header.read_text())  # the leading // comment, as one line
    lead = " ".join(line.strip().lstrip("/").strip() for line in (first.group(0) if first else "").splitlines())
    twins = re.findall(r"graphscale/[\w/]+\.py", lead)
    assert "Python twin" in lead and twins, f"planner/{header.name}: its first comment names no Python twin"
    gone = [t for t in twins if not (REPO / t).is_file()]
    assert not gone, f"planner/{header.name} names Python twins that do not exist: {gone}"


@pytest.mark.skipif(GXX is None, reason="no g++ on PATH")
def test_each_planner_header_compiles_alone_without_python(tmp_path: Path) -> None:
    """One translation unit per header, ``#include "<header>"`` and nothing
    else; they compile side by side (torch's headers take ~10 s each), and
    every failure is reported at once."""
    assert HEADERS, "graphscale/_native/planner/ has no headers"
    includes = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]

    def compile_alone(header: Path) -> str | None:
        unit = tmp_path / f"alone_{header.stem}.cpp"
        unit.write_text(f'#include "{header}"\n')
        run = subprocess.run([GXX, *CXXFLAGS, *includes, str(unit)], capture_output=True, text=True)
        if run.returncode == 0:
            return None
        errors = [line for line in run.stderr.splitlines() if "error" in line][:5] or [run.stderr.strip()]
        return f"planner/{header.name} does not compile alone:\n  " + "\n  ".join(errors)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        failures = [f for f in pool.map(compile_alone, HEADERS) if f is not None]
    assert not failures, "\n".join(failures)
