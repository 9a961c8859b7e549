"""``gradfleet compare`` with no options -- the README's first command -- shows backup workers
at work: an update takes the first R of N > R workers' gradients, R >= 2, while one worker is
slowed; and the README and the docs' home page say so with the command's own numbers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from gradfleet.cli.config import parse_spec, parse_straggler
from gradfleet.cli.main import app, compare_straggler

ROOT = Path(__file__).resolve().parents[2]


def _defaults() -> dict:
    compare = typer.main.get_command(app).commands["compare"]
    return {p.name: p.default for p in compare.params}


def _backup_run() -> tuple[str, int]:
    (run,) = [s for s in _defaults()["strategy"] if s.startswith("sync-replicas")]
    return run, parse_spec(run, "strategy")[1]["replicas_to_aggregate"]


def _straggler() -> tuple[int, float]:
    defaults = _defaults()
    return parse_straggler(defaults["straggler"] or compare_straggler(defaults["workers"]))


def test_the_backup_run_averages_several_workers_and_drops_the_slow_one() -> None:
    workers = _defaults()["workers"]
    slow, delay = _straggler()
    _, replicas = _backup_run()
    # R = 1 would be single-worker training with extra processes: nothing to see of backups
    assert 2 <= replicas < workers
    assert delay > 0 and 0 < slow < workers


def test_readme_and_home_page_describe_the_default_comparison() -> None:
    defaults = _defaults()
    _, delay = _straggler()
    _, replicas = _backup_run()
    for page in ("README.md", "docs/index.md"):
        text = " ".join((ROOT / page).read_text().split())
        said = re.search(r"on (\d+) local workers?, one slowed by (\d+) ms per step", text)
        assert said is not None, page
        assert (int(said[1]), float(said[2])) == (defaults["workers"], delay), page
        assert f"the first {replicas} of the {defaults['workers']} workers' gradients" in text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_backup_run_takes_r_gradients_per_update(tmp_path: Path) -> None:
    """The default comparison's backup run, shortened: every update took R gradients."""
    run, replicas = _backup_run()
    res = subprocess.run(
        [sys.executable, "-m", "gradfleet", "compare", "-s", run, "--steps", "30", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert res.returncode == 0, res.stderr
    (row,) = json.loads((tmp_path / "runs" / "compare" / "compare.json").read_text())
    assert row["workers"] == _defaults()["workers"]
    assert row["replicas"] == [replicas] * 30
