"""The documentation site builds with ``mkdocs build --strict``, and it covers the public API.

Strict mode turns every warning into an error: a page missing from the nav, a broken link or
anchor, a docstring that documents a parameter the signature lacks, an API entry that no longer
resolves.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

import gradfleet
import gradfleet.distributed

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"


@pytest.mark.timeout(600)
def test_site_builds_strictly(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
        + ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "site" / "api" / "distributed" / "index.html").is_file()


def _documented(page: str) -> set[str]:
    """Names rendered by a page's ``::: path`` entries (a module entry: its ``members``)."""
    text = (DOCS / "api" / page).read_text()
    names = {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: ([\w.]+)$", text, re.M)}
    for members in re.findall(r"^ +members: \[(.*)\]$", text, re.M):
        names.update(m.strip() for m in members.split(","))
    return names


def test_api_reference_lists_every_public_name():
    optimizers = set(gradfleet.__all__) - {"ALL"}  # ALL is the list of the classes below
    assert optimizers - _documented("optimizers.md") == set()
    assert set(gradfleet.distributed.__all__) - _documented("distributed.md") == set()


# The pages describe the project as it is, not how or by whom it was made (that is
# CHANGELOG.md's), nor what earlier code did or how a measurement came about
# (benchmarks/results/cluster-history.md and history.md keep that log).
DEVELOPMENT_NOTES = re.compile(
    r"\bsessions?\b|\bwas lent\b|\bissues?\b|\bscratch\b|not committed"
    r"|next thing to try|none was kept|before the change|the old default|\bx before\)"
    r"|(?<!is )(?<!are )(?<!be )\bused to\b|\b(?:was|were) made (?:smaller|larger)\b"
    r"|\bas in this run\b|\bnow installs\b",
    re.IGNORECASE,
)


def _prose(text: str) -> str:
    """``text`` without its code (fenced blocks and inline spans), which may name anything;
    lines stay where they were."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_pages_speak_of_the_project_only():
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in pages
        for number, line in enumerate(_prose(page.read_text()).splitlines(), 1)
        if DEVELOPMENT_NOTES.search(line)
    ]
    assert found == []


# a full date, a year and month (2026-11), or a month's name with its year (November 2026)
MONTHS = "january|february|march|april|may|june|july|august|september|october|november|december"
DATE = re.compile(
    rf"\b(19|20)[0-9]{{2}}-[0-9]{{2}}\b|\b({MONTHS}|(jan|feb|mar|apr|jun|jul|aug|sept?|oct|nov|dec)\.?)"
    rf",? +(19|20)[0-9]{{2}}\b",
    re.IGNORECASE,
)


def test_no_heading_is_dated():
    """A page says what is so; when a figure was taken is the result file's business."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    dated = [
        f"{page.relative_to(ROOT)}: {line}"
        for page in pages
        for line in page.read_text().splitlines()
        if line.startswith("#") and DATE.search(line)
    ]
    assert dated == []


def test_the_measurement_log_is_not_a_page():
    assert "cluster-history" not in (ROOT / "mkdocs.yml").read_text()
    assert not list(DOCS.rglob("cluster-history*"))
    assert (ROOT / "benchmarks" / "results" / "cluster-history.md").is_file()
    # a comment says why itself, rather than pointing at the log
    code = sorted((ROOT / "src").rglob("*.py"))
    assert [p for p in code if "cluster-history" in p.read_text()] == []
