"""The repository's folders, for the tests that read or run its files."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: the helpers package's parent
REPO = TESTS.parent
WORKERS = TESTS / "helpers" / "workers"  # the scripts tests spawn
