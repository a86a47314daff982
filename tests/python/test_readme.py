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


README = ROOT / "README.md"


def _section(text: str, title: str) -> str:
    """The text of the ``## title`` section (up to the next ``## ``)."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_readme_is_a_short_page():
    """The README is the product page (issue 46: at most ~300 lines); details go to docs/."""
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move details into docs/ (the guide, benchmarks)"


def test_every_benchmark_table_names_its_command():
    """Each table of the README's Benchmarks section follows a paragraph that names the command
    reproducing it (a `python -m wide_compiler benchmark ...` target or a tools/ script)."""
    section = _section(README.read_text(), "Benchmarks")
    paragraphs = re.split(r"\n\s*\n", section)
    tables = [i for i, p in enumerate(paragraphs) if p.lstrip().startswith("|")]
    assert len(tables) >= 5, "one headline table per kind of benchmark"
    for i in tables:
        caption = paragraphs[i - 1]
        assert re.search(r"`python -m\s+wide_compiler benchmark \w+|`bash tools/", caption), caption


def test_readme_lists_every_benchmark_target():
    """The command-line section's list of benchmark targets is the registry's (it once left out
    `sweep`)."""
    from wide_compiler import bench

    listed = re.search(r"lists the targets \(([^)]*)\)", README.read_text())
    assert listed, "the README's `benchmark` line lists the targets"
    assert [t.strip() for t in listed.group(1).split(",")] == list(bench.TARGETS)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_and_docs_anchors_resolve():
    """Every `#anchor` link of the README and the docs (to the same page or another .md page) names
    a heading there: sections moved between the README and docs/ keep their links working."""
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md|)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if linked.exists():
                assert anchor in _anchors(linked), (page.name, target, anchor)
