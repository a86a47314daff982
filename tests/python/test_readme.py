"""The README's and the docs' Python examples run as written (the README is the front door, the
docs/ pages its long form: keep them true)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, i, block) for page in PAGES
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]


def test_readme_has_python_examples():
    assert sum(page.name == "README.md" for page, _, _ in BLOCKS) >= 2


def test_readme_links_to_docs_resolve():
    """Every relative link of the README and the docs names a file that exists."""
    for page in PAGES:
        for target in re.findall(r"\]\(((?:docs/|\.\./)[^)#]+)", page.read_text()):
            assert (page.parent / target).exists(), (page.name, target)


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{p.name}-{i}" for p, i, _ in BLOCKS])
def test_readme_example_runs(page, index, block):
    exec(compile(block, f"{page.relative_to(ROOT)}[python block {index}]", "exec"), {})
