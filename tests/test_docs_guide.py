"""The pages under docs/ are a guide a newcomer can follow: every page reachable from the index,
each fact on one page (the others link to it), every counter an example keeps shown to the
reader, and ``replicas_to_aggregate="auto"`` presented with where it stands. (No history or
development notes on the pages, and no dated headings: tests/test_docs_site.py.)"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from tests.doc_blocks import pages, python_blocks

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _guide_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md"))


def test_every_page_is_in_the_index() -> None:
    """docs/index.md's table of where to read on links every page."""
    index = (DOCS / "index.md").read_text()
    table = index[index.index("| to ... | read |") :]
    linked = {(DOCS / link).resolve() for link in re.findall(r"\]\(([\w/.-]+\.md)[#)]", table)}
    pages = {p.resolve() for p in _guide_pages()} - {(DOCS / "index.md").resolve()}
    assert sorted(p.relative_to(DOCS).as_posix() for p in pages - linked) == []


def _facts(text: str) -> list[str]:
    """What a page states that another page could copy: its code blocks of three lines or more,
    its table rows, and its paragraphs of 200 characters or more, whitespace normalised."""
    blocks = [b.strip() for b in re.findall(r"```\w*\n(.*?)```", text, re.S)]
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    rows = [line.strip() for line in text.splitlines() if line.startswith("| ")]
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return [
        *(b for b in blocks if b.count("\n") >= 2),
        *(r for r in rows if not set(r) <= set("|-: ")),
        *(p for p in paragraphs if len(p) >= 200 and not p.startswith("|")),
    ]


def test_each_fact_lives_on_one_page() -> None:
    where: dict[str, set[str]] = defaultdict(set)
    for page in _guide_pages():
        for fact in _facts(page.read_text()):
            where[fact].add(page.relative_to(DOCS).as_posix())
    repeated = {fact[:80]: sorted(on) for fact, on in where.items() if len(on) > 1}
    assert repeated == {}


def test_examples_show_what_they_count() -> None:
    """A name an example adds to (``dropped += ...``) is read afterwards on its page: printed,
    asserted or used; a count nobody sees is a run that ends in silence."""
    unread = []
    for page in pages():
        trees = [ast.parse(block.code) for block in python_blocks(page)]
        nodes = [node for tree in trees for node in ast.walk(tree)]
        counted = {
            n.target.id
            for n in nodes
            if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)
        }
        read = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        unread += [f"{page}: {name}" for name in sorted(counted - read)]
    assert unread == []


STANDING = "cluster.md#backup-workers-that-tune-themselves"


def test_auto_comes_with_its_measured_standing_and_when_to_fix_r() -> None:
    """Where the README's quick start and the distributed page offer
    ``replicas_to_aggregate="auto"``, they say it measured slower than the best fixed R, link
    the measurement, and say when to choose a fixed R."""
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start: the command line")[1].split("\n## ")[0]
    distributed = (DOCS / "distributed.md").read_text()
    choosing = distributed.split("### Choosing R")[1].split("\n#")[0]
    for text in (quick_start, choosing):
        assert "auto" in text and STANDING in text
        flat = " ".join(text.split())
        assert "best fixed R" in flat and "fixed R" in flat.split("best fixed R", 1)[1]
    assert "docs/distributed.md#choosing-r" in quick_start
