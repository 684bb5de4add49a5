"""The README and the pages under docs/ say only what runs: every ```python
block in them is executed here, and the README stays a front page.

Each file's Python blocks run in order as one script (a later block may use
what an earlier one made, as a reader would run them), in a fresh
interpreter in an empty directory, with the environment the suite runs in
(a free MASTER_PORT for the blocks that start a one-rank gloo group).  A
block that needs DeepSpeed or Accelerate skips cleanly where they are not
installed, as their tests do.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import REPO
from helpers.ranks import free_port

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
README_MAX_LINES = 150


def _script(page: Path) -> str:
    return "\n".join(BLOCK.findall(page.read_text()))


@pytest.mark.parametrize("page", [p for p in PAGES if _script(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs(page: Path, tmp_path: Path) -> None:
    script = _script(page)
    for module in ("deepspeed", "accelerate"):
        if re.search(rf"^\s*(import|from) {module}\b|import .*\b{module}\b", script, re.M) \
                and importlib.util.find_spec(module) is None:
            pytest.skip(f"{page.name} needs {module}, which is not installed")
    (tmp_path / "blocks.py").write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(free_port())}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a block starts its own one-rank group, as a reader's would
        env.pop(key, None)
    run = subprocess.run([sys.executable, "blocks.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{page.name}'s Python blocks failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"


def test_the_readme_is_a_front_page_that_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "the reference belongs under docs/"
    assert readme.count("```python") >= 1, "the README's example is gone"
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", readme))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
    assert linked <= pages, f"README links to missing docs pages: {sorted(linked - pages)}"


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = re.findall(r"^\s*- [^:]+: ([\w.-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages, (nav, pages)


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    command = 'pip install torch==2.13.0 && pip install -e ".[test]" && pytest'
    assert f"```bash\n{command}\n```" in readme
    assert command in (ROOT / ".ci" / "run").read_text()
