"""``--help`` says what each option takes and its default, in one meaning shared with the run
specification (and so docs/cli.md), and defines every column of the results table."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from gradfleet.cli.main import app
from gradfleet.cli.spec import setting_help
from gradfleet.cli.summary import COLUMNS

COMMANDS = [
    ["train"],
    ["compare"],
    ["list"],
    ["convert", "tf-checkpoint"],
    ["convert", "torch-checkpoint"],
]


def _command(path: list[str]):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _help(path: list[str]) -> str:
    """``--help``'s text, its panels' borders and line breaks taken out."""
    res = CliRunner().invoke(app, [*path, "--help"])
    assert res.exit_code == 0, res.output
    return " ".join(res.stdout.replace("│", " ").split())


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_option_shows_its_default_and_flags_no_type(path: list[str]) -> None:
    text = _help(path)
    assert "<bool>" not in text
    options = [p for p in _command(path).params if p.param_type_name == "option"]
    if path in (["train"], ["compare"]):
        assert any(getattr(p, "is_flag", False) for p in options)  # --quiet is checked too
    for param in options:
        shown = " ".join((param.help or "").split()).replace("\\[", "[")
        assert "[default: " in shown or shown.startswith("required: "), (path, param.name)
        assert shown in text, (path, param.name)


@pytest.mark.parametrize("name", ["steps", "workers", "straggler", "device", "log_level"])
def test_train_and_compare_say_what_the_run_specification_says(name: str) -> None:
    meaning, _ = setting_help(name)
    for path in (["train"], ["compare"]):
        flag = "--" + name.replace("_", "-")
        (param,) = [p for p in _command(path).params if flag in p.opts]
        assert param.help.replace("\\", "").startswith(meaning + " [default: "), (path, name)


def test_steps_mean_model_updates_everywhere() -> None:
    meaning, default = setting_help("steps")
    assert meaning.startswith("model updates") and default == "the workload's"
    assert COLUMNS["steps"].startswith("model updates")


@pytest.mark.parametrize("path", [["train"], ["compare"]], ids=" ".join)
def test_help_defines_every_column_of_the_results_table(path: list[str]) -> None:
    text = _help(path)
    for heading, meaning in COLUMNS.items():
        assert f"{heading}: {' '.join(meaning.split())}" in text, heading
