"""The ``gradfleet`` command, in a scratch directory.

Commands that stay in one process (``list``, bad input, single-process ``train``) run in this
process through typer's test runner: the same parsing, checks, output and exit codes without a
second interpreter and torch import per test.  Commands that launch worker processes run as a
user runs them, in a subprocess (``slow``): there the launcher, its process tree and its exit
codes are the point.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradfleet.cli.main import app, main

GRADFLEET = [sys.executable, "-m", "gradfleet"]


def run(args: list[str], cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        GRADFLEET + args, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``cli(args)``: run ``gradfleet args`` in this process with ``tmp_path`` as the working
    directory; returns typer's result (``exit_code``, ``stdout``, ``stderr``)."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()  # a training run sets its own thread count
    runner = CliRunner()
    yield lambda args: runner.invoke(app, args)
    torch.set_num_threads(threads)


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def losses(out: Path) -> list[float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


def test_exit_leaves_objects_to_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The console script freezes the GC before the interpreter's teardown, which otherwise
    collected every object torch, typer and rich made: 3-5 s of a failing run's exit on a
    loaded 2-core machine, slower than torchrun fails."""
    monkeypatch.setattr(sys, "argv", ["gradfleet", "train", "--steps", "-3"])
    gc.collect()  # what is left tracked now, and the objects main() makes, are frozen by it
    before = gc.get_freeze_count()
    try:
        with pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code == 2  # bad input, after the same path as any other exit
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


@pytest.mark.timeout(120)
def test_default_train_reaches_stated_accuracy(tmp_path: Path, cli) -> None:
    res = cli(["train", "-q"])
    assert res.exit_code == 0, res.stderr
    (out,) = (tmp_path / "runs").iterdir()
    s = summary(out)
    assert s["workload"] == "digits" and s["steps"] == 300
    assert s["test_accuracy"] >= 0.90, s
    assert "target 0.90: reached" in res.stdout
    state = torch.load(out / "model.pt", weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}


STRATEGY_RUNS = [
    ("allreduce", "ctr"),  # sparse EmbeddingBag gradients: rows averaged over their senders
    ("model-average:interval=4", "digits"),
    ("easgd:period=2", "digits"),
    ("easgd:mode=async,period=2", "digits"),
    ("sync-replicas:replicas_to_aggregate=1", "digits"),
    ("sync-replicas:replicas_to_aggregate=2", "digits"),  # R = N: the all-reduce exchange
    ("sync-replicas:replicas_to_aggregate=2,shards=2,tokens=shared", "digits"),
    ("towers", "digits"),
]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("strategy", "workload"), STRATEGY_RUNS)
def test_two_workers_every_strategy(tmp_path: Path, strategy: str, workload: str) -> None:
    out = tmp_path / "run"
    res = run(
        [
            "train",
            "-w",
            workload,
            "-s",
            strategy,
            "-n",
            "2",
            "--steps",
            "40",
            "--straggler",
            "1:5",
            "--out",
            str(out),
            "-q",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    s = summary(out)
    assert s["workers"] == 2 and s["strategy"] == strategy.split(":")[0]
    ls = losses(out)
    assert sum(ls[-10:]) / 10 < sum(ls[:10]) / 10  # it learns
    assert s["test_accuracy"] > (0.6 if workload == "ctr" else 0.7)
    assert s["bytes_sent"] > 0
    torch.load(out / "model.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    common = ["-s", "model-average:interval=3", "-n", "2", "--seed", "3", "-q"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(["train", *common, "--steps", "24", "--out", str(full)], tmp_path).returncode == 0
    res = run(
        ["train", *common, "--steps", "13", "--checkpoint-every", "10", "--out", str(part)],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    res = run(["train", "--resume", str(part), "--steps", "24", "-q"], tmp_path)
    assert res.returncode == 0, res.stderr
    a = torch.load(full / "model.pt", weights_only=True)
    b = torch.load(part / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [
        json.loads(x)["step"]
        for x in (part / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(x)
    ]
    assert steps == list(range(1, 25))  # steps 11-13 of the first run were replaced


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_compare_writes_plot_and_table(tmp_path: Path) -> None:
    res = run(
        [
            "compare",
            "-s",
            "allreduce",
            "-s",
            "easgd:period=2",
            "-n",
            "2",
            "--steps",
            "40",
            "--out",
            "cmp",
            "-q",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    png = tmp_path / "cmp" / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["label"] for r in rows] == ["allreduce", "easgd:period=2"]
    assert all(r["steps_per_s"] > 0 and "test_accuracy" in r for r in rows)
    assert "steps/s" in res.stdout


def test_config_file_sets_optimizer_and_settings(tmp_path: Path, cli) -> None:
    (tmp_path / "cfg.py").write_text(
        "learning_rate = 0.05\noptimizer = {'class': 'momentum', 'momentum': 0.9}\n"
        "steps = 30\nworkload = 'digits'\n"
    )
    res = cli(["train", "--optimizer", "cfg.py", "--out", "r", "-q"])
    assert res.exit_code == 0, res.stderr
    s = summary(tmp_path / "r")
    assert s["optimizer"] == {"class": "momentum", "momentum": 0.9, "learning_rate": 0.05}
    assert s["steps"] == 30


def test_list_shows_optimizers_and_strategies(cli) -> None:
    res = cli(["list"])
    assert res.exit_code == 0
    for word in (
        "FtrlOptimizer",
        "l1_regularization_strength",
        "easgd",
        "moving_rate",
        "sync-replicas",
        "replicas_to_aggregate",
        "ctr",
    ):
        assert word in res.stdout


BAD = [
    (["-o", "nosuchopt"], "unknown optimizer 'nosuchopt'"),
    (["-s", "gossip"], "unknown strategy 'gossip'"),
    (["-o", "adam:learning_rate=-1"], "learning_rate must be >= 0"),
    (["-o", "adam:betaa=0.5"], "does not take ['betaa']"),
    (["-c", "broken.py"], "broken.py:1: syntax error"),
    (["-s", "sync-replicas", "-n", "1"], "sync-replicas needs --workers >= 2"),
    (["-s", "sync-replicas:total_num_replicas=3", "-n", "2"], "needs --workers >= 3"),
    (["-s", "model-average:interval=0", "-n", "2"], "interval must be an integer >= 1"),
    (["-s", "sync-replicas:tokens=fifo", "-n", "2"], "tokens must be one of distinct, shared"),
    (["-s", "sync-replicas:overlap=maybe", "-n", "2"], "overlap must be one of true, false"),
    (["-s", "sync-replicas:shards=0", "-n", "2"], "shards must be an integer >= 1"),
    (["-s", "sync-replicas:shards=2", "-n", "2", "--servers", "1"], "sync-replicas:shards=2"),
    (["--straggler", "fast"], "RANK:DELAY_MS"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
    (["--log-level", "loud"], "--log-level must be one of debug, info, warning, error"),
    (["--checkpoint-every", "-2"], "--checkpoint-every must be an integer >= 0, got -2"),
    (["--max-restarts", "-1"], "--max-restarts must be an integer >= 0, got -1"),
    # a restart needs a job that goes on without the rank
    (
        ["-s", "allreduce", "-n", "2", "--max-restarts", "1"],
        "--max-restarts 1: strategy allreduce cannot lose a worker",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path: Path, cli, args, message) -> None:
    (tmp_path / "broken.py").write_text("optimizer = {'class': 'adam'\nsteps = 3\n")
    res = cli(["train", *args, "--out", "r"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert message in lines[0]
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()


@pytest.mark.faults
def test_worker_failure_names_rank_and_log(tmp_path: Path) -> None:
    # a workload whose loss fails: every rank fails inside the loop, after every check passed
    (tmp_path / "failing.py").write_text(
        "from gradfleet.cli.workloads import digits\n\n"
        "def workload(seed):\n"
        "    w = digits(seed)\n"
        "    def loss_fn(out, y):\n"
        "        raise RuntimeError('the loss fails')\n"
        "    w.loss_fn = loss_fn\n"
        "    return w\n"
    )
    res = run(
        [
            "train",
            "-w",
            "failing.py",
            "-s",
            "allreduce",
            "-n",
            "2",
            "--steps",
            "5",
            "--out",
            "r",
            "-q",
        ],
        tmp_path,
    )
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "worker rank" in lines[0] and "stderr.log" in lines[0], res.stderr


def test_log_level_info_logs_the_decisions(tmp_path: Path, cli) -> None:
    res = cli(["train", "--steps", "6", "--checkpoint-every", "3", "--out", "r", "-q"])
    assert res.exit_code == 0, res.stderr
    assert "INFO" not in res.stderr  # the default level is warning
    res = cli(["train", "--resume", "r", "--steps", "9", "-q", "--log-level", "info"])
    assert res.exit_code == 0, res.stderr
    assert "INFO [launcher] gradfleet.cli.main: run specification: RunSpec(" in res.stderr
    assert "INFO [rank 0] gradfleet.cli.worker: resumed from the checkpoint of step 6" in (
        res.stderr
    )
    assert "resume at step 6: kept" in res.stderr
    assert json.loads((tmp_path / "r" / "config.json").read_text())["log_level"] == "info"


def test_cli_imports_no_private_module() -> None:
    """The CLI uses gradfleet's public API only: no ``_module`` in any import of its files."""
    import ast

    import gradfleet.cli

    for path in Path(gradfleet.cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                parts = (node.module or "").split(".") + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                parts = [p for a in node.names for p in a.name.split(".")]
            else:
                continue
            private = [p for p in parts if p.startswith("_")]
            assert not private, (path.name, ast.unparse(node))


def test_the_rank_forkserver_preloads_nothing_that_touches_cuda() -> None:
    """The launcher's forkserver imports ``RANK_PRELOAD`` once and forks every rank from it: a
    CUDA driver initialised there would be unusable in the forked ranks. Importing each module
    with CUDA's queries and initialisation made to raise (the driver's device count too, on a
    CUDA build) shows none of them reaches CUDA."""
    code = (
        "import torch, torch.cuda\n"
        "def refuse(*a, **k):\n"
        "    raise RuntimeError('CUDA touched while preloading')\n"
        "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'current_device'):\n"
        "    setattr(torch.cuda, name, refuse)\n"
        "if hasattr(torch._C, '_cuda_getDeviceCount'):\n"
        "    torch._C._cuda_getDeviceCount = refuse\n"
        "import importlib\n"
        "from gradfleet.cli.launch import RANK_PRELOAD\n"
        "for name in RANK_PRELOAD:\n"
        "    importlib.import_module(name)  # raises where the module reaches CUDA\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
