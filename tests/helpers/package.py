"""graphscale's modules as the project tests read them (tests/project/):
each module's dotted name and path, and the most lines a module may have
(the tests are held to it too)."""
from __future__ import annotations

from pathlib import Path

from helpers.paths import REPO

PKG = REPO / "graphscale"
MAX_MODULE_LINES = 350


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
        out[".".join(parts)] = path
    return out


MODULES = modules()
