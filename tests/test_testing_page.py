"""docs/testing.md's account of what runs where: the README's command leaves out exactly the
second stage's markers, `.ci/run` reads that selection from the README and runs its negation,
the page documents every marker, and its stage times are the measured ones
(benchmarks/results/suite-time.md)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SECOND_STAGE

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "testing.md").read_text()


def _readme_test_command() -> str:
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    (line,) = [line for line in block.splitlines() if "pytest" in line]
    return line


def _table(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table after the line ``heading`` of ``text``, header left out."""
    lines = text.split(f"\n{heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[2:]


def test_the_readme_command_leaves_out_exactly_the_second_stage() -> None:
    command = _readme_test_command()
    expression = "not (" + " or ".join(SECOND_STAGE) + ")"
    assert command.endswith(f'python -m pytest -q -n 4 --dist worksteal -m "{expression}"')
    # the page shows the same command first
    shown = PAGE.split("```bash\n", 1)[1].splitlines()[0]
    assert command.endswith(shown), (shown, command)


def test_ci_reads_the_readme_selection_and_runs_its_negation() -> None:
    """.ci/run's own lines that find the README's command and its `-m`, run as they are."""
    script = (ROOT / ".ci" / "run").read_text()
    lines = [line for line in script.splitlines()
             if line.startswith(("cmd=$(", "readme_marks=$(", "second_marks="))]  # fmt: skip
    assert len(lines) == 3, lines
    out = subprocess.run(["bash", "-c", "\n".join([*lines, 'echo "$second_marks"'])], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.strip() == "not (not (" + " or ".join(SECOND_STAGE) + "))"
    assert 'bash -c "set -euo pipefail; $cmd"' in script
    assert '-m "$second_marks"' in script


def test_every_marker_is_declared_and_the_page_describes_each_of_the_second_stage(
    pytestconfig: pytest.Config,
) -> None:
    declared = {m.split(":", 1)[0] for m in pytestconfig.getini("markers")}
    assert {"slow", *SECOND_STAGE} <= declared
    described = [row[0] for row in _table(PAGE, "## What runs where")]
    assert described == [f"`{m}`" for m in SECOND_STAGE]


def test_the_stage_times_are_the_recorded_ones() -> None:
    """The Results table quotes the last measurement in benchmarks/results/suite-time.md (the
    last section with a table: a run that stopped early is recorded in prose alone)."""
    recorded = (ROOT / "benchmarks" / "results" / "suite-time.md").read_text()
    measured = ["## " + s for s in recorded.split("\n## ")[1:] if "\n| stage |" in s]
    assert measured, "suite-time.md records no measurement with a table"
    last = measured[-1]
    page_rows = _table(PAGE, "## Results")
    result_rows = _table("\n" + last, last.splitlines()[0])
    assert page_rows and page_rows == [row[: len(page_rows[0])] for row in result_rows]
    for _, tests, wall, *_ in page_rows:
        assert re.fullmatch(r"[\d,]+", tests) and re.fullmatch(r"\d+:\d\d", wall), (tests, wall)
    # a quoted run that had failures says so
    if any("failed" in row[-1] for row in result_rows):
        assert "failed" in PAGE.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
