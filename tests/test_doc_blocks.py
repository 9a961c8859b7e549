"""Every ```python block of README.md and docs/ runs (see tests/doc_blocks.py for the rules).

A page's unclaimed blocks run here, in order, in one namespace, in a fresh interpreter started
in an empty directory (a block may write files) without a launcher's environment (so
``gradfleet.distributed.init()`` makes a world of one process).  The prose's claims are
``assert`` statements inside the blocks.  A claimed block must name a test file that exists and
reads that page.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.doc_blocks import CLAIM, CLAIM_LIKE, FENCE, ROOT, pages, python_blocks

# Runs the blocks with their page's line numbers, so a traceback points into the page.
DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    code = "\\n" * (block["line"] - 1) + block["code"]
    exec(compile(code, block["page"], "exec"), namespace)
"""
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _unclaimed(page: str) -> list:
    return [b for b in python_blocks(page) if b.tested_by is None]


@pytest.mark.parametrize("page", [p for p in pages() if _unclaimed(p)])
@pytest.mark.timeout(400)
def test_unclaimed_blocks_run(page, tmp_path):
    blocks = [{"page": b.page, "line": b.line, "code": b.code} for b in _unclaimed(page)]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "blocks.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert run.returncode == 0, (
        f"the python blocks of {page} (lines {[b['line'] for b in blocks]}) failed when run in "
        "order in one script. If a specific test runs a block, put "
        "'<!-- tested-by: tests/<that test>.py -->' on the line right before it.\n"
        + run.stdout[-3000:]
        + run.stderr[-6000:]
    )


def test_claims_name_a_test_that_reads_the_page():
    claims = [b for page in pages() for b in python_blocks(page) if b.tested_by]
    assert claims, "no block is claimed: the claim comments were lost"
    for block in claims:
        test = ROOT / block.tested_by
        where = f"{block.page}:{block.line - 1}"
        assert block.tested_by.startswith("tests/") and test.is_file(), (
            f"{where}: tested-by names {block.tested_by}, which is not a file under tests/"
        )
        assert os.path.basename(block.page) in test.read_text(), (
            f"{where}: {block.tested_by} does not read {block.page}"
        )


def test_every_claim_stands_right_before_a_python_block():
    for page in pages():
        lines = (ROOT / page).read_text().splitlines()
        for number, line in enumerate(lines[:-1], 1):
            if CLAIM_LIKE.search(line):
                assert CLAIM.match(line.strip()), f"{page}:{number}: malformed claim {line!r}"
                fence = FENCE.match(lines[number])
                assert fence and fence.group(2) == "python", (
                    f"{page}:{number}: a claim must stand on the line right before ```python"
                )


def test_blocks_are_found():
    """Guards the parser: every fenced block opens at a fence the parser recognises, and
    a fence tagged as Python is tagged exactly ``python``."""
    for page in pages():
        text = (ROOT / page).read_text()
        for line in text.splitlines():
            fence = FENCE.match(line)
            if fence and fence.group(2).lower() in ("py", "python3", "pycon", "ipython"):
                pytest.fail(f"{page}: tag Python code blocks as ```python, not {line.strip()!r}")
    assert python_blocks("docs/optimizers.md"), "the optimizers page has Python examples"
