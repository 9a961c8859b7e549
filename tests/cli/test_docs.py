"""docs/cli.md: its settings table is the run specification's, its columns table the results
table's, and its code runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradfleet.cli.spec import RunSpec, resolve, settings_markdown
from gradfleet.cli.summary import columns_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_settings_table_is_the_run_specification() -> None:
    text = DOC.read_text()
    table = re.search(r"<!-- settings: .*? -->\n\n(.*?)\n<!-- end of settings -->", text, re.S)
    assert table is not None, "the settings markers are missing"
    assert table.group(1) == settings_markdown(), "regenerate with settings_markdown()"
    assert f"| `timeout` | yes | `--timeout` | `{RunSpec.timeout!r}` |" in table.group(1)


def test_columns_table_is_the_results_tables() -> None:
    text = DOC.read_text()
    table = re.search(r"<!-- columns: .*? -->\n\n(.*?)<!-- end of columns -->", text, re.S)
    assert table is not None, "the columns markers are missing"
    assert table.group(1) == columns_markdown(), "regenerate with columns_markdown()"
    assert "| `step ms` | median time of one of rank 0's steps" in table.group(1)


def test_command_table_lists_every_command() -> None:
    from gradfleet.cli.main import app

    commands = [c.name or c.callback.__name__ for c in app.registered_commands]
    commands += [g.name for g in app.registered_groups]
    assert sorted(commands) == ["compare", "convert", "list", "store", "train"]
    text = DOC.read_text()
    table = text[text.index("| command | what it does |") :].split("\n\n")[0]
    listed = re.findall(r"^\| `gradfleet (\w+)` \|", table, re.M)
    assert sorted(listed) == sorted(commands)


def test_every_python_block_runs() -> None:
    blocks = _python_blocks()
    assert len(blocks) == 1
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})


def test_config_example_resolves_as_the_prose_says(tmp_path: Path, monkeypatch) -> None:
    (config,) = [b for b in _python_blocks() if b.startswith("# my_config.py")]
    (tmp_path / "my_config.py").write_text(config)
    monkeypatch.chdir(tmp_path)
    flags = dict.fromkeys(["workload", "optimizer", "learning_rate", "strategy", "workers"])
    flags.update(config="my_config.py", steps=None, seed=None, batch_size=None, device=None)
    spec = resolve(flags)
    assert spec.optimizer == {"class": "momentum", "momentum": 0.9, "learning_rate": 0.05}
    assert (spec.strategy, spec.strategy_args) == ("model-average", {"interval": 4})
    assert (spec.workers, spec.steps, spec.timeout) == (2, 200, 60.0)
    assert spec.log_level == RunSpec.log_level  # not in the file: the default
    spec = resolve({**flags, "steps": 50, "timeout": 5})  # a flag overrides the file
    assert (spec.steps, spec.timeout) == (50, 5.0)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("workers", "'two'", "--workers must be an integer >= 1, got 'two'"),
        ("timeout", "'soon'", "--timeout must be a positive number of seconds, got 'soon'"),
        ("log_level", "'loud'", "--log-level must be one of debug, info, warning, error"),
        ("checkpoint_every", "-1", "--checkpoint-every must be an integer >= 0, got -1"),
        ("learning_rate", "'0.1'", "--lr must be a number, got '0.1'"),
    ],
)
def test_bad_config_value_names_the_flag(tmp_path: Path, monkeypatch, key, value, message):
    from gradfleet.cli.config import ConfigError

    (tmp_path / "cfg.py").write_text(f"{key} = {value}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve({"config": "cfg.py", "optimizer": None})


def test_start_figures_are_the_stored_medians() -> None:
    """The start-up figures docs/cli.md quotes are the medians of the runs in
    benchmarks/results/cli-start.md, each launcher's."""
    results = (DOC.parents[1] / "benchmarks" / "results" / "cli-start.md").read_text()
    medians = {}
    for launcher, runs, median in re.findall(
        r"^\| `(\w+)`[^|]*\| ([\d., ]+) \| ([\d.]+) \|$", results, re.M
    ):
        times = sorted(float(t) for t in runs.split(","))
        assert f"{times[len(times) // 2]:.2f}" == median, (launcher, runs, median)
        medians[launcher] = float(median)
    assert set(medians) == {"spawn", "forkserver"}
    text = " ".join(DOC.read_text().split())
    assert (
        f"takes {medians['forkserver']:.1f} s from the command to its end, "
        f"against {medians['spawn']:.1f} s with a fresh interpreter per rank"
    ) in text
