"""Every error of ``train``, ``compare`` and ``convert``, click's own parsing errors included,
is one ``error:`` line with exit code 2, found in the cheapest order: paths and names before
anything is imported for the work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gradfleet.cli.main import app


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    return lambda args: CliRunner().invoke(app, args)


def _error(res) -> str:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["train", "--steps", "abc"], "'--steps'"),
        (["train", "--bogus"], "--bogus"),
        (["trian"], "Did you mean 'train'"),
        (["compare", "-n"], "'-n' requires an argument"),
        (["compare", "--workers", "two"], "'--workers'"),
        (["convert", "tf-checkpoint"], "prefix"),
    ],
)
def test_parsing_errors_are_one_line(cli, args: list[str], says: str) -> None:
    assert says in _error(cli(args))


@pytest.fixture
def without_tensorflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing TensorFlow fails: a check that needs it reports that it is missing."""
    monkeypatch.setitem(sys.modules, "tensorflow", None)


def test_convert_reports_a_missing_checkpoint_first(cli, without_tensorflow) -> None:
    """Before --optimizer, --map and --out, and before importing TensorFlow."""
    line = _error(cli(["convert", "tf-checkpoint", "/nonexistent/model.ckpt"]))
    assert line.startswith("error: no TensorFlow checkpoint at '/nonexistent/model.ckpt'")


def test_convert_reports_a_directory_without_checkpoints(cli, tmp_path, without_tensorflow):
    line = _error(cli(["convert", "tf-checkpoint", str(tmp_path), "--optimizer", "adam"]))
    assert line == f"error: no TensorFlow checkpoint in directory {str(tmp_path)!r}"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "missing option --optimizer"),
        (["--optimizer", "adamm"], "unknown optimizer 'adamm'; did you mean adam?"),
        (["--optimizer", "sgd"], "SGD has no TensorFlow checkpoint layout"),
        (["--optimizer", "adam"], "missing option --map"),
        (["--optimizer", "adam", "--map", "absent.py"], "missing option --out"),
        (["--optimizer", "adam", "--map", "absent.py", "-o", "out"], "--map absent.py: no such"),
    ],
)
def test_convert_checks_names_and_paths_in_order(cli, tmp_path, without_tensorflow, args, says):
    """A checkpoint is there (as far as its files go): then the optimizer, the map, the
    output, each before TensorFlow is imported."""
    (tmp_path / "model.ckpt.index").write_bytes(b"")
    line = _error(cli(["convert", "tf-checkpoint", "model.ckpt", *args]))
    assert says in line
    assert not (tmp_path / "out").exists()


def test_torch_checkpoint_reports_a_missing_file_first(cli, without_tensorflow) -> None:
    line = _error(cli(["convert", "torch-checkpoint", "absent.pt"]))
    assert line == "error: absent.pt: no such file"


@pytest.mark.parametrize(
    "bad",
    [
        ["--steps", "0"],
        ["--batch-size", "0"],
        ["--timeout", "0"],
        ["--straggler", "3:10"],
        ["--eval-every", "-1"],
        ["--log-level", "loud"],
        ["-o", "adamm"],
        ["-s", "gossip"],
        ["--device", "tpu"],
        ["-w", "digitz"],
        ["-w", "absent.py"],
    ],
)
def test_train_checks_values_and_names_before_building_anything(cli, monkeypatch, bad) -> None:
    """A wrong value or name is reported before the workload's data or any optimizer is
    built (the optimizer's first build imports most of torch's compiler stack)."""
    import gradfleet.registry
    from gradfleet.cli import spec

    def built(*args, **kwargs):
        raise AssertionError("built before the bad input was reported")

    monkeypatch.setattr(spec, "load_workload", built)
    monkeypatch.setattr(gradfleet.registry, "create_optimizer", built)
    _error(cli(["train", "-n", "2", *bad]))


def test_a_misspelt_workload_gets_did_you_mean(cli) -> None:
    line = _error(cli(["train", "-w", "digitz"]))
    assert "unknown workload 'digitz'; did you mean digits?" in line
