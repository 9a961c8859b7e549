"""The ```python blocks of the documentation (README.md and docs/**/*.md), and who runs them.

Every block is executed by a test.  By default ``tests/test_doc_blocks.py`` runs a page's blocks
in order, in one namespace, in a fresh interpreter (as a reader pasting them into one script
would).  A block that needs more (several ranks, RETURNN's engine, an exact numeric check) is
claimed by the test that runs it: the line right before its opening fence is

    <!-- tested-by: tests/path/to/the_test.py -->

and that file reads the block from the page with ``claimed_blocks(page, __file__)``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLAIM = re.compile(r"^<!-- tested-by: (\S+) -->$")
CLAIM_LIKE = re.compile(r"^\s*<!--.*tested-by", re.IGNORECASE)
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(\S*)")


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository root, e.g. "docs/fsdp.md"
    line: int  # 1-based line of the block's first line of code
    code: str
    tested_by: str | None  # the claiming test file, relative to the root; None: run generically


def pages() -> list[str]:
    """README.md and every Markdown page under docs/, relative to the repository root."""
    docs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
    return ["README.md", *docs]


def python_blocks(page: str) -> list[Block]:
    """The page's ```python blocks in order, each with the test that claims it (if any)."""
    lines = (ROOT / page).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1)), None
        )
        if end is None:
            raise ValueError(f"{page}:{i + 1}: code block never closed")
        if fence.group(2) == "python":
            claim = CLAIM.match(lines[i - 1].strip()) if i else None
            code = textwrap.dedent("\n".join(lines[i + 1 : end]) + "\n")
            blocks.append(Block(page, i + 2, code, claim.group(1) if claim else None))
        i = end + 1
    return blocks


def claimed_blocks(page: str, test_file: str | Path) -> list[str]:
    """The code of the blocks on ``page`` claimed by ``test_file`` (pass ``__file__``)."""
    name = Path(test_file).resolve().relative_to(ROOT).as_posix()
    return [b.code for b in python_blocks(page) if b.tested_by == name]
