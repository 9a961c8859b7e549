"""``gradfleet`` console command: ``train``, ``compare`` and ``list``.

Every bad input (unknown optimizer or strategy, invalid hyperparameters, a broken config file,
too few workers) is checked here, before any directory is created or process started, and
reported as one ``error: ...`` line with exit code 2. A failed worker rank is reported as one
line naming the rank and its log, exit code 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from . import strategies as strat
from .config import (
    ConfigError,
    load_config,
    optimizer_config,
    parse_spec,
    parse_straggler,
)
from .convert import app as convert_app
from .devices import check_device, parse_device
from .launch import WorkerFailed, launch, run_local, under_torchrun
from .progress import Progress
from .workloads import WORKLOADS, load_workload

app = typer.Typer(
    help="TensorFlow-exact optimizers and TF1 distribution strategies on PyTorch: train and "
    "compare on one machine.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out_console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)
app.add_typer(convert_app, name="convert")


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


# ----------------------------------------------------------------------------- resolving a run
def _settings(config: str | None, optimizer: str | None) -> dict[str, Any]:
    """Settings from ``--config``, or from ``--optimizer FILE`` (RETURNN style)."""
    path = config
    if optimizer and optimizer.endswith((".py", ".json")):
        if config:
            raise ConfigError("give the config file either as --config or as --optimizer")
        path = optimizer
    return load_config(path) if path else {}


def _check_optimizer(opts: dict[str, Any]) -> None:
    """Build the optimizer on a dummy parameter: unknown names and bad values fail here."""
    import torch

    from gradfleet.registry import create_optimizer

    try:
        create_optimizer([torch.nn.Parameter(torch.zeros(1))], opts)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"optimizer {opts.get('class')!r}: {err}") from None


def resolve(flags: dict[str, Any]) -> dict[str, Any]:
    """Merge config file and flags into a checked run spec (nothing is written)."""
    file = _settings(flags.pop("config"), flags["optimizer"])
    if flags["optimizer"] and flags["optimizer"].endswith((".py", ".json")):
        flags["optimizer"] = None
    merged = {**file, **{k: v for k, v in flags.items() if v is not None}}
    if merged.get("optimizer"):  # a bad optimizer fails before the workload's data is built
        _check_optimizer(optimizer_config(merged["optimizer"], merged.get("learning_rate")))
    strategy = merged.get("strategy", "none")
    name, args = strategy if isinstance(strategy, tuple) else parse_spec(strategy, "strategy")
    workers = int(merged.get("workers", 1))
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    strat.validate_strategy(name, args, workers)
    device = parse_device(merged.get("device", "cpu"))  # before any data is built
    _check_run_device(device, name, workers)
    workload_name = merged.get("workload", "digits")
    try:
        workload = load_workload(workload_name, int(merged.get("seed", 0)))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    opt_spec = merged.get("optimizer") or workload.optimizer
    opts = optimizer_config(opt_spec, merged.get("learning_rate"))
    _check_optimizer(opts)
    if name == "sync-replicas" and merged.get("checkpoint_every"):
        raise ConfigError(
            "--checkpoint-every is not supported with sync-replicas: its ranks run different "
            "numbers of local steps, so there is no common point to checkpoint"
        )
    steps = int(merged.get("steps", workload.steps))
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    timeout = merged.get("timeout", 120)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {timeout!r}")
    straggler = merged.get("straggler")
    if straggler is not None:
        straggler = parse_straggler(straggler)
        if straggler[0] >= workers:
            raise ConfigError(f"--straggler rank {straggler[0]} but only {workers} worker(s)")
    return {
        "workload": workload_name,
        "optimizer": opts,
        "strategy": name,
        "strategy_args": args,
        "workers": workers,
        "device": device,
        "steps": steps,
        "seed": int(merged.get("seed", 0)),
        "batch_size": merged.get("batch_size"),
        "straggler": straggler,
        "eval_every": merged.get("eval_every", max(steps // 5, 1)),
        "checkpoint_every": merged.get("checkpoint_every", 0),
        "timeout": timeout,
        "target_accuracy": workload.target,
    }


def _check_run_device(device: str, strategy: str, workers: int) -> None:
    """A GPU for each process of the run on this machine, and for each tower."""
    if under_torchrun():
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    else:
        processes = workers if strat.STRATEGIES[strategy].spawns else 1
    check_device(device, processes, workers if strategy == "towers" else 1)


def _default_out(spec: dict[str, Any]) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return (
        Path("runs") / f"{stamp}-{spec['workload']}-{spec['optimizer']['class']}-{spec['strategy']}"
    )


def execute(spec: dict[str, Any], label: str, quiet: bool) -> dict[str, Any]:
    """Run ``spec`` (its ``out`` directory exists) with live progress; rank 0's summary."""
    out = Path(spec["out"])
    (out / "config.json").write_text(json.dumps(spec, indent=2) + "\n")
    spawn = strat.STRATEGIES[spec["strategy"]].spawns and spec["workers"] > 1
    show = not under_torchrun() or _env_rank() == 0
    progress = Progress(out / "metrics.jsonl", spec["steps"], label, quiet or not show)
    with progress:
        summary = (
            launch(spec, spec["workers"]) if spawn and not under_torchrun() else run_local(spec)
        )
    return summary or {}


def _env_rank() -> int:
    return int(os.environ.get("GRADFLEET_RANK", os.environ.get("RANK", 0)))


# ----------------------------------------------------------------------------- output
def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def summary_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in (
        "run",
        "optimizer",
        "strategy",
        "device",
        "workers",
        "steps",
        "final loss",
        "test acc",
        "steps/s",
        "step ms",
        "samples/s",
        "comm",
        "wall",
    ):
        table.add_column(
            col, justify="left" if col in ("run", "optimizer", "strategy") else "right"
        )
    for r in rows:
        args = ",".join(f"{k}={v}" for k, v in r["strategy_args"].items())
        table.add_row(
            r["label"],
            r["optimizer"]["class"],
            r["strategy"] + (f":{args}" if args else ""),
            r["device"],
            str(r["workers"]),
            str(r["steps"]),
            f"{r['final_loss']:.4f}",
            f"{r['test_accuracy']:.3f}",
            f"{r['steps_per_s']:.1f}",
            f"{r['median_step_ms']:.2f}",
            f"{r['samples_per_s']:.0f}",
            _mb(r["bytes_sent"]),
            f"{r['wall_s']:.1f}s",
        )
    return table


# ----------------------------------------------------------------------------- commands
Opt = Annotated
DEVICE_HELP = (
    "cpu (default), cuda (rank r, or tower t, on cuda:r / cuda:t) or cuda:N (one rank, or "
    "every tower, on GPU N)"
)


@app.command()
def train(
    workload: Opt[
        str | None,
        typer.Option(
            "--workload", "-w", help="digits, ctr, or FILE.py[:function] returning a Workload"
        ),
    ] = None,
    optimizer: Opt[
        str | None,
        typer.Option(
            "--optimizer",
            "-o",
            help="NAME[:key=value,...] (see `gradfleet list`) or a RETURNN-style config "
            "FILE.py/.json",
        ),
    ] = None,
    learning_rate: Opt[
        float | None, typer.Option("--lr", help="learning rate (overrides the optimizer's)")
    ] = None,
    config: Opt[
        str | None, typer.Option("--config", "-c", help="RETURNN-style config file (.py or .json)")
    ] = None,
    strategy: Opt[
        str | None,
        typer.Option(
            "--strategy",
            "-s",
            help="NAME[:key=value,...]: none, allreduce, model-average, easgd, towers, "
            "sync-replicas",
        ),
    ] = None,
    workers: Opt[
        int | None,
        typer.Option("--workers", "-n", help="local worker processes (towers: replicas)"),
    ] = None,
    steps: Opt[int | None, typer.Option(help="training steps per worker")] = None,
    seed: Opt[int | None, typer.Option(help="data and initialisation seed")] = None,
    batch_size: Opt[int | None, typer.Option(help="per-worker batch size")] = None,
    straggler: Opt[str | None, typer.Option(help="RANK:DELAY_MS, slow one worker down")] = None,
    eval_every: Opt[int | None, typer.Option(help="evaluate on the test set every K steps")] = None,
    checkpoint_every: Opt[
        int | None, typer.Option(help="checkpoint every K steps (0: never)")
    ] = None,
    timeout: Opt[
        float | None,
        typer.Option(help="seconds to wait for a silent worker or server before failing (120)"),
    ] = None,
    device: Opt[str | None, typer.Option(help=DEVICE_HELP)] = None,
    out: Opt[
        Path | None, typer.Option(help="run directory (default runs/<time>-<workload>-...)")
    ] = None,
    resume: Opt[
        Path | None,
        typer.Option(help="continue the run in this directory from its last checkpoint"),
    ] = None,
    quiet: Opt[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
) -> None:
    """Train a workload with any optimizer and distribution strategy."""
    flags = dict(
        workload=workload,
        optimizer=optimizer,
        learning_rate=learning_rate,
        config=config,
        strategy=strategy,
        workers=workers,
        steps=steps,
        seed=seed,
        batch_size=batch_size,
        straggler=straggler,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        timeout=timeout,
        device=device,
    )
    try:
        if resume and device is not None:
            raise ConfigError("--resume continues on the run's own device: leave out --device")
        spec = _resume_spec(resume, steps) if resume else resolve(flags)
    except (ConfigError, ValueError) as err:
        raise _fail(str(err)) from None
    spec["out"] = str(resume or out or _default_out(spec))
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    try:
        summary = execute(spec, spec["strategy"], quiet)
    except WorkerFailed as err:
        raise _fail(str(err), code=1) from None
    if not summary:  # a non-zero rank under torchrun
        return
    summary["label"] = Path(spec["out"]).name
    out_console.print(summary_table([summary], f"gradfleet train: {spec['workload']}"))
    target = spec.get("target_accuracy")
    verdict = ""
    if target is not None:
        reached = "reached" if summary["test_accuracy"] >= target else "NOT reached"
        verdict = f" (target {target:.2f}: {reached})"
    out_console.print(
        f"test accuracy {summary['test_accuracy']:.3f}{verdict}; model saved to "
        f"{summary['model']}; metrics in {Path(spec['out']) / 'metrics.jsonl'}",
        highlight=False,
    )


def _resume_spec(run: Path, steps: int | None) -> dict[str, Any]:
    from .worker import latest_checkpoint

    cfg = run / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"--resume {run}: not a gradfleet run directory (no config.json)")
    if latest_checkpoint(run) is None:
        raise ConfigError(f"--resume {run}: no checkpoint (train with --checkpoint-every K)")
    spec = json.loads(cfg.read_text())
    spec["straggler"] = tuple(spec["straggler"]) if spec.get("straggler") else None
    spec["resume"] = True
    spec.setdefault("device", "cpu")  # a run directory from before --device
    _check_run_device(spec["device"], spec["strategy"], spec["workers"])
    if steps is not None:
        spec["steps"] = steps
    return spec


# All-reduce against backup workers, local SGD and EASGD: the comparison gradfleet exists for.
DEFAULT_COMPARISON = [
    "allreduce",
    "sync-replicas:replicas_to_aggregate=1",
    "model-average:interval=8",
    "easgd:period=4",
]


@app.command()
def compare(
    strategy: Opt[
        list[str],
        typer.Option("--strategy", "-s", help="repeat: each NAME[:key=value,...] is one run"),
    ] = DEFAULT_COMPARISON,  # noqa: B006 - typer needs the literal list as the default
    optimizer: Opt[
        list[str] | None,
        typer.Option("--optimizer", "-o", help="repeat to also compare optimizers"),
    ] = None,
    workload: Opt[str, typer.Option("--workload", "-w")] = "digits",
    workers: Opt[int, typer.Option("--workers", "-n")] = 2,
    steps: Opt[int | None, typer.Option()] = None,
    seed: Opt[int, typer.Option()] = 0,
    straggler: Opt[str | None, typer.Option(help="RANK:DELAY_MS applied to every run")] = "1:20",
    device: Opt[str | None, typer.Option(help=DEVICE_HELP)] = None,
    out: Opt[Path, typer.Option(help="directory for the runs, the plot and the table")] = Path(
        "runs/compare"
    ),
    quiet: Opt[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Run one workload under several strategies (and optimizers); plot and tabulate."""
    from .plot import plot_runs

    specs: list[tuple[str, dict[str, Any]]] = []
    try:
        for opt in optimizer or [None]:
            for s in strategy:
                flags = dict(
                    workload=workload,
                    optimizer=opt,
                    learning_rate=None,
                    config=None,
                    strategy=s,
                    workers=1 if s.split(":")[0] == "none" else workers,
                    steps=steps,
                    seed=seed,
                    batch_size=None,
                    straggler=None if s.split(":")[0] == "none" else straggler,
                    eval_every=None,
                    checkpoint_every=None,
                    device=device,
                )
                spec = resolve(flags)
                label = s if not optimizer else f"{spec['optimizer']['class']} / {s}"
                specs.append((label, spec))
    except (ConfigError, ValueError) as err:
        raise _fail(str(err)) from None
    out.mkdir(parents=True, exist_ok=True)
    rows, runs = [], {}
    for i, (label, spec) in enumerate(specs):
        spec["out"] = str(out / f"run{i}-{label.replace('/', '_').replace(' ', '')}")
        Path(spec["out"]).mkdir(parents=True, exist_ok=True)
        try:
            summary = execute(spec, label, quiet)
        except WorkerFailed as err:
            raise _fail(f"{label}: {err}", code=1) from None
        rows.append({**summary, "label": label})
        runs[label] = Path(spec["out"]) / "metrics.jsonl"
    title = f"{workload}, {workers} workers" + (f" on {device}" if device else "")
    if straggler:
        slow, delay = parse_straggler(straggler)
        title += f", straggler: rank {slow} +{delay:g} ms/step"
    plot_runs(runs, out / "compare.png", title)
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    out_console.print(summary_table(rows, f"gradfleet compare: {title}"))
    out_console.print(
        f"plot: {out / 'compare.png'}; table: {out / 'compare.json'}", highlight=False
    )


@app.command("list")
def list_(
    args: Opt[
        bool, typer.Option("--args/--no-args", help="show each optimizer's arguments")
    ] = True,
) -> None:
    """The optimizers, strategies and workloads available, with their arguments."""
    from gradfleet.registry import GRADFLEET_OPTIMIZERS, TORCH_OPTIMIZERS, constructor_arguments

    table = Table(title="optimizers (--optimizer NAME[:key=value,...])")
    table.add_column("name")
    table.add_column("class")
    table.add_column("arguments")
    seen: set[type] = set()
    for source in (GRADFLEET_OPTIMIZERS, TORCH_OPTIMIZERS):
        # shortest alias first: "adam" rather than "adamoptimizer"
        for name, cls in sorted(source.items(), key=lambda kv: (kv[1].__name__, len(kv[0]))):
            if cls in seen:
                continue
            seen.add(cls)
            table.add_row(name, cls.__name__, ", ".join(constructor_arguments(cls)) if args else "")
    out_console.print(table)
    st = Table(title="strategies (--strategy NAME[:key=value,...])")
    for col in ("name", "what", "arguments", "workers"):
        st.add_column(col)
    for info in strat.STRATEGIES.values():
        note = "" if strat.available(info.name) else " [not in this build yet]"
        bounds = f">= {info.min_workers}" + (f", <= {info.max_workers}" if info.max_workers else "")
        st.add_row(
            info.name,
            info.help + note,
            "\n".join(f"{k}: {v}" for k, v in info.args.items()) or "-",
            bounds,
        )
    out_console.print(st)
    wl = Table(title="workloads (--workload)")
    wl.add_column("name")
    wl.add_column("description")
    for name in WORKLOADS:
        wl.add_row(name, WORKLOADS[name].__doc__ or _workload_doc(name))
    wl.add_row("FILE.py[:fn]", "your own: fn(seed) -> gradfleet.cli.workloads.Workload")
    out_console.print(wl)


def _workload_doc(name: str) -> str:
    return {
        "digits": "MLP on generated noisy 8x8 digits (dense)",
        "ctr": "hashed-feature logistic regression, sparse EmbeddingBag",
    }[name]


def main() -> None:
    """Entry point for ``python -m gradfleet``."""
    app(prog_name="gradfleet")


if __name__ == "__main__":
    sys.exit(main())
