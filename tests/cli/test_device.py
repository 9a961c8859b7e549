"""``--device`` and the step time in the metrics.

On any machine: argument checks (a CUDA device that is not there, more ranks or towers than
GPUs, malformed names, the config-file key) with CUDA's availability and GPU count faked, so
that the checks run the same with or without a GPU; the step clock's synchronisation; the
median step time in ``summary.json``, ``compare.json`` and the table.

With CUDA (skipped with the reason otherwise): training on the GPU for a few steps against the
same run on the CPU, towers on one or two GPUs, and the collective strategies over NCCL with
one rank per GPU against the same strategies over gloo on the CPU.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import gradfleet.cli.spec as cli_spec
from gradfleet.cli.devices import StepClock, process_backend, rank_device, tower_devices
from gradfleet.cli.main import app

GRADFLEET = [sys.executable, "-m", "gradfleet"]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device (none visible)")
needs_two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"needs 2 CUDA devices (one rank per GPU), {GPUS} visible"
)
#: float32 unit roundoff: tolerances below are (reduction length) x EPS32
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    runner = CliRunner()
    yield lambda args: runner.invoke(app, args)
    torch.set_num_threads(threads)


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Make the checks see ``count`` GPUs (0: CUDA unavailable). Nothing reaches a GPU: every
    case below fails in the checks, before a workload is built."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- bad input
DEVICE_ERRORS = [
    (0, ["--device", "cuda"], "--device cuda: CUDA is not available here"),
    (0, ["--device", "cuda:0"], "available: cpu"),
    (2, ["--device", "gpu"], "--device must be cpu, cuda or cuda:N (N >= 0), got 'gpu'"),
    (2, ["--device", "cuda:x"], "--device must be cpu, cuda or cuda:N"),
    (2, ["--device", "cpu:0"], "--device must be cpu, cuda or cuda:N"),
    (2, ["--device", "cuda:2"], "has 2 CUDA device(s); available: cpu, cuda:0, cuda:1"),
    (2, ["--device", "cuda", "-s", "allreduce", "-n", "3"], "-n 3 needs 3 GPUs"),
    (2, ["--device", "cuda:1", "-s", "model-average", "-n", "2"], "use --device cuda"),
    (2, ["--device", "cuda", "-s", "towers", "-n", "3"], "-n 3 towers need 3 GPUs"),
    (1, ["--device", "cuda", "-s", "sync-replicas", "-n", "2"], "-n 2 needs 2 GPUs"),
]


@pytest.mark.parametrize(("gpus", "args", "message"), DEVICE_ERRORS)
def test_bad_device_one_line_exit_2_before_any_data(
    tmp_path: Path, cli, monkeypatch, gpus, args, message
) -> None:
    fake_gpus(monkeypatch, gpus)
    built = []
    monkeypatch.setattr(cli_spec, "load_workload", lambda *a: built.append(a))
    res = cli(["train", *args, "--out", "r"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert message in lines[0]
    assert "--device" in lines[0]
    assert not built  # the check comes before the workload's data is generated
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()


def test_more_ranks_than_gpus_under_torchrun(tmp_path: Path, cli, monkeypatch) -> None:
    # torchrun's ranks on this machine (LOCAL_WORLD_SIZE), not -n, are what need GPUs
    fake_gpus(monkeypatch, 2)
    env = {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    res = cli(["train", "--device", "cuda", "-s", "allreduce", "-n", "6", "--out", "r"])
    assert res.exit_code == 2
    assert "-n 3 needs 3 GPUs, this machine has 2" in res.stderr


def test_config_key_and_flag_precedence(tmp_path: Path, cli, monkeypatch) -> None:
    fake_gpus(monkeypatch, 0)
    (tmp_path / "cfg.py").write_text(
        "device = 'cuda:1'\nsteps = 4\noptimizer = 'gradientdescent:learning_rate=0.1'\n"
    )
    res = cli(["train", "-c", "cfg.py", "--out", "r", "-q"])
    assert res.exit_code == 2 and "--device cuda:1: CUDA is not available" in res.stderr
    res = cli(["train", "-c", "cfg.py", "--device", "cpu", "--out", "r", "-q"])  # flag wins
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["device"] == "cpu"
    assert json.loads((tmp_path / "r" / "config.json").read_text())["device"] == "cpu"


def test_resume_keeps_the_run_device(tmp_path: Path, cli) -> None:
    res = cli(["train", "--steps", "4", "--checkpoint-every", "2", "--out", "r", "-q"])
    assert res.exit_code == 0, res.output
    res = cli(["train", "--resume", "r", "--device", "cpu", "--steps", "6", "-q"])
    assert res.exit_code == 2 and "leave out --device" in res.stderr


def test_each_rank_and_tower_gets_its_gpu(monkeypatch) -> None:
    fake_gpus(monkeypatch, 2)
    assert [rank_device("cuda", r) for r in (0, 1)] == [torch.device("cuda", r) for r in (0, 1)]
    assert rank_device("cuda:1", 0) == torch.device("cuda", 1)  # -n 1 on GPU 1
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU of its own"):
        rank_device("cuda", 2)  # a launcher that skipped the CLI's checks
    assert tower_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert tower_devices("cuda:1", 3) == ["cuda:1"] * 3
    assert tower_devices("cpu", 2) == ["cpu", "cpu"]
    # NCCL for the ranks' CUDA tensors, gloo for the CPU tensors of the control paths
    assert process_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert process_backend(torch.device("cpu")) == "gloo"


# ----------------------------------------------------------------------------- step time
def test_step_clock_synchronises_the_gpu_before_each_reading(monkeypatch) -> None:
    events: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(device))
    times = iter([10.0, 10.25])  # seconds, read at the start and at the end of the step
    monkeypatch.setattr("gradfleet.cli.devices.time.perf_counter", lambda: next(times))
    clock = StepClock(torch.device("cuda", 1))
    with clock.step():
        events.append("work")
    # the queue is drained before the start is read and the step's kernels before the end
    assert events == [torch.device("cuda", 1), "work", torch.device("cuda", 1)]
    assert clock.times_ms == [250.0] and clock.median_ms() == 250.0


def test_step_clock_on_cpu_never_touches_cuda(monkeypatch) -> None:
    def fail(*_a, **_k):
        raise AssertionError("CUDA touched on a CPU run")

    monkeypatch.setattr(torch.cuda, "synchronize", fail)
    clock = StepClock(torch.device("cpu"))
    for _ in range(3):
        with clock.step():
            pass
    assert len(clock.times_ms) == 3 and clock.median_ms() == statistics.median(clock.times_ms)
    assert math.isnan(StepClock(torch.device("cpu")).median_ms())  # no step, no time


def test_train_reports_median_step_time(tmp_path: Path, cli) -> None:
    res = cli(["train", "--steps", "9", "--out", "r", "-q"])
    assert res.exit_code == 0, res.output
    steps = [r["step_ms"] for r in records(tmp_path / "r") if "loss" in r]
    assert len(steps) == 9 and all(ms > 0 for ms in steps)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["median_step_ms"] == statistics.median(steps)
    # a step is part of the run: their sum is within the wall time
    assert sum(steps) / 1000 <= summary["wall_s"]
    assert "step ms" in res.stdout and f"{summary['median_step_ms']:.2f}" in res.stdout


def test_compare_reports_median_step_time(tmp_path: Path, cli) -> None:
    # in-process strategies only; tower 1 sleeps 30 ms in every step (the straggler)
    res = cli(
        ["compare", "-s", "none", "-s", "towers", "-n", "2", "--steps", "6"]
        + ["--straggler", "1:30", "--device", "cpu", "--out", "cmp", "-q"]
    )
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["label"] for r in rows] == ["none", "towers"]
    assert all(r["device"] == "cpu" and r["median_step_ms"] > 0 for r in rows)
    assert rows[1]["median_step_ms"] >= 30.0  # the step waits for its slowest tower
    assert "step ms" in res.stdout


# ----------------------------------------------------------------------------- on CUDA
def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(GRADFLEET + args, cwd=cwd, capture_output=True, text=True, timeout=240)


def _in_process(cli):
    def run(args: list[str]) -> tuple[int, str]:
        res = cli(args)
        return res.exit_code, res.output

    return run


# the digits MLP: reductions over 64 inputs, 128 hidden units and a batch of 64, and the sum of
# two ranks' or towers' gradients
DIGITS_LENGTH = 64 + 128 + 64 + 2
SGD = ["-o", "gradientdescent:learning_rate=0.1"]


def same_run_on_cpu_and(device: str, args: list[str], steps: int, run, where: Path) -> None:
    """``gradfleet train args`` with plain SGD on the CPU and on ``device``: the parameters
    agree to ``steps x L x eps`` (float32 rounding of reductions of ``L`` terms, compounded over
    ``steps`` steps), and ``model.pt`` holds CPU tensors either way."""
    dirs = {}
    for dev in ("cpu", device):
        dirs[dev] = where / dev.replace(":", "")
        out = ["--steps", str(steps), "--device", dev, "--out", str(dirs[dev]), "-q"]
        code, output = run(["train", *SGD, *args, *out])
        assert code == 0, output
    summary = json.loads((dirs[device] / "summary.json").read_text())
    assert summary["device"] == device and summary["median_step_ms"] > 0
    a = torch.load(dirs["cpu"] / "model.pt", weights_only=True)
    b = torch.load(dirs[device] / "model.pt", weights_only=True)
    assert set(a) == set(b)
    tol = steps * DIGITS_LENGTH * EPS32
    for key in a:
        assert b[key].device.type == "cpu"
        scale = float(a[key].abs().max()) + 1.0
        torch.testing.assert_close(b[key], a[key], rtol=tol, atol=tol * scale, msg=key)


@needs_gpu
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("device", "args"),
    [
        ("cuda", []),
        ("cuda:0", ["-s", "towers", "-n", "2"]),  # both towers on one GPU
        # the centre server's data plane: CUDA tensors staged through pinned host buffers
        ("cuda", ["-s", "easgd:mode=async,period=2", "-n", "1"]),
    ],
)
def test_train_on_one_gpu_matches_cpu(tmp_path: Path, cli, device, args) -> None:
    same_run_on_cpu_and(device, args, 5, _in_process(cli), tmp_path)


@needs_gpu
@pytest.mark.timeout(240)
def test_train_on_cuda_learns_with_default_adam_and_sparse_ctr(tmp_path: Path, cli) -> None:
    res = cli(["train", "--steps", "150", "--device", "cuda:0", "--out", "d", "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["test_accuracy"] > 0.8
    res = cli(["train", "-w", "ctr", "--steps", "100", "--device", "cuda", "--out", "c", "-q"])
    assert res.exit_code == 0, res.output  # FTRL on sparse CUDA gradients
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["test_accuracy"] > 0.6


@needs_two_gpus
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "strategy", ["allreduce", "model-average:interval=2", "easgd:period=2", "towers"]
)
def test_strategies_on_two_gpus_match_cpu(tmp_path: Path, strategy: str) -> None:
    """NCCL, one rank (or tower) per GPU, against gloo on the CPU: the same run."""

    def run(args: list[str]) -> tuple[int, str]:
        res = _run(args, tmp_path)
        return res.returncode, res.stderr

    same_run_on_cpu_and("cuda", ["-s", strategy, "-n", "2"], 6, run, tmp_path)


@needs_two_gpus
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "strategy", ["sync-replicas:replicas_to_aggregate=1", "easgd:mode=async,period=2"]
)
def test_server_strategies_on_two_gpus_learn(tmp_path: Path, strategy: str) -> None:
    """The servers' data plane stages CUDA tensors through pinned host memory (gloo)."""
    res = _run(["train", "-s", strategy, "-n", "2", "--steps", "60", "--device", "cuda"]
               + ["--out", "r", "-q"], tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["test_accuracy"] > 0.7
    losses = [r["loss"] for r in records(tmp_path / "r") if "loss" in r]
    assert sum(losses[-10:]) < sum(losses[:10])


def test_help_list_and_cpu_runs_never_query_cuda(tmp_path: Path, cli, monkeypatch) -> None:
    """``--help``, ``list``, bad input and a CPU run never ask CUDA anything (asking may start
    the driver: seconds, and a GPU context held by a process that does not use it)."""

    def failing(name: str):
        def fail(*_a, **_k):
            raise AssertionError(f"torch.cuda.{name} called")

        return fail  # one function per name: the fused path's compiler keys on the object

    for name in ("is_available", "device_count", "set_device", "synchronize", "init"):
        monkeypatch.setattr(torch.cuda, name, failing(name))
    for args in (["--help"], ["list"], ["train", "--device", "tpu", "--out", "r"]):
        assert cli(args).exit_code in (0, 2)
    res = cli(["train", *SGD, "--steps", "3", "--device", "cpu", "--out", "r", "-q"])
    assert res.exit_code == 0, res.output
