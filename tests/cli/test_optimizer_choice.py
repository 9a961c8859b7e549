"""The command line offers the optimizers ``train`` can drive, once each, and refuses any other
in one line before a rank starts; a misspelt name gets "did you mean"."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradfleet.cli.main import app
from gradfleet.cli.workloads import load_workload
from gradfleet.registry import GRADFLEET_OPTIMIZERS, TORCH_OPTIMIZERS, create_optimizer


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()  # a training run sets its own thread count
    yield lambda args: CliRunner().invoke(app, args)
    torch.set_num_threads(threads)


def _one_error_line(res, tmp_path: Path) -> str:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()
    return lines[0]


def _listed(cli) -> list[tuple[str, str, str]]:
    """(name, class, sparse) of each row of ``gradfleet list``'s optimizer table."""
    res = cli(["list", "--no-args"])
    assert res.exit_code == 0, res.output
    table = res.stdout.split("strategies (--strategy")[0]
    return re.findall(r"^│ (\w+) +│ (\w+) +│ +(yes|no) +│", table, re.M)


def _trains(workload_name: str, cls: type) -> bool:
    """One step of ``train``'s loop on the workload's model: a batch's forward and backward,
    then ``step()`` without a closure."""
    workload = load_workload(workload_name, 0)
    required = [
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in ("self", "params")
    ]
    x, y = (t[:16] for t in workload.train)
    try:
        opt = create_optimizer(
            workload.model.parameters(), {"class": cls, **dict.fromkeys(required, 0.05)}
        )
        workload.loss_fn(workload.model(x), y).backward()
        opt.step()
    except Exception:
        return False
    return True


@pytest.mark.filterwarnings("ignore:AMSGradOptimizer. epsilon is 0")  # its default: NaN, no error
def test_list_offers_exactly_what_train_can_drive_once_each(cli) -> None:
    listed = _listed(cli)
    names = [name for name, _, _ in listed]
    classes = [cls for _, cls, _ in listed]
    assert len(set(names)) == len(names) and len(set(classes)) == len(classes)
    registry = {**TORCH_OPTIMIZERS, **GRADFLEET_OPTIMIZERS}
    assert all(registry[name].__name__ == cls for name, cls, _ in listed)  # names that resolve
    reachable = set(registry.values())
    assert set(classes) == {cls.__name__ for cls in reachable if _trains("digits", cls)}
    assert {"LBFGS", "SparseAdam", "BaseCustomOptimizer"}.isdisjoint(classes)
    # "sparse": it also trains the sparse workload
    for name, _, sparse in listed:
        assert _trains("ctr", registry[name]) == (sparse == "yes"), name


def test_closure_optimizer_is_refused_before_any_rank(tmp_path: Path, cli) -> None:
    line = _one_error_line(cli(["train", "-o", "lbfgs", "--steps", "20", "--out", "r"]), tmp_path)
    assert "LBFGS" in line and "closure" in line
    res = cli(["compare", "-s", "allreduce", "-o", "adam", "-o", "lbfgs", "--out", "r"])
    assert "closure" in _one_error_line(res, tmp_path)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-o", "sparseadam"], "SparseAdam does not support dense gradients"),
        (["-o", "adamw", "-w", "ctr"], "sparse parameter's gradient"),
        (["-o", "basecustom:learning_rate=0.1"], "BaseCustomOptimizer is a base class"),
    ],
)
def test_optimizer_the_workload_cannot_use_is_refused(tmp_path, cli, args, says) -> None:
    line = _one_error_line(cli(["train", *args, "--steps", "2", "--out", "r"]), tmp_path)
    assert "cannot train workload" in line and says in line


def test_a_misspelling_gets_did_you_mean_and_the_names_once(tmp_path: Path, cli) -> None:
    line = _one_error_line(cli(["train", "-o", "adamm", "--out", "r"]), tmp_path)
    assert "unknown optimizer 'adamm'; did you mean adam" in line
    offered = line.split("the optimizers: ")[1].split(", ")
    assert offered == [name for name, _, _ in _listed(cli)]


def test_every_alias_still_works(cli, tmp_path: Path) -> None:
    res = cli(["train", "-o", "AdamOptimizer:learning_rate=0.01", "--steps", "2", "-q"])
    assert res.exit_code == 0, res.output


def test_an_optimizer_that_takes_sparse_gradients_trains_ctr(cli, tmp_path: Path) -> None:
    assert ("sgd", "SGD", "yes") in _listed(cli)
    res = cli(["train", "-o", "sgd:learning_rate=0.1", "-w", "ctr", "--steps", "2", "-q"])
    assert res.exit_code == 0, res.output
