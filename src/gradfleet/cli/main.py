"""``gradfleet`` console command: ``train``, ``compare``, ``list`` and ``store``.

Every bad input (unknown optimizer or strategy, invalid hyperparameters, a broken config file,
too few workers) is checked here, before any directory is created or process started, and
reported as one ``error: ...`` line with exit code 2. A failed worker rank is reported as one
line naming the rank and its log, exit code 1.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import strategy_table as strat
from .command_classes import Command, Group, error_line
from .config import ConfigError, parse_straggler
from .convert import app as convert_app
from .launch import WorkerFailed, launch, run_local
from .logs import configure_logging
from .progress import Progress
from .spec import RunSpec, resolve, resume_spec, setting_help
from .summary import COLUMNS, summary_table
from .torchrun import env_rank, under_torchrun
from .workloads import WORKLOADS

log = logging.getLogger(__name__)

out_console = Console(width=None if sys.stdout.isatty() else 160)


def _fail(message: str, code: int = 2) -> typer.Exit:
    error_line(message)
    return typer.Exit(code)


app = typer.Typer(
    cls=Group,
    help="TensorFlow-exact optimizers and TF1 distribution strategies on PyTorch: train and "
    "compare on one machine.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
app.add_typer(convert_app, name="convert")


# ----------------------------------------------------------------------------- running
def _default_out(spec: RunSpec) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    assert spec.optimizer is not None
    return Path("runs") / f"{stamp}-{spec.workload}-{spec.optimizer['class']}-{spec.strategy}"


def execute(spec: RunSpec, label: str, quiet: bool) -> dict[str, Any]:
    """Run ``spec`` (its ``out`` directory exists) with live progress; rank 0's summary."""
    out = Path(spec.out)
    (out / "config.json").write_text(spec.to_json())
    spawn = strat.STRATEGIES[spec.strategy].spawns and spec.workers + spec.servers > 1
    show = not under_torchrun() or env_rank() == 0
    assert spec.steps is not None
    progress = Progress(out / "metrics.jsonl", spec.steps, label, quiet or not show)
    with progress:
        summary = launch(spec) if spawn and not under_torchrun() else run_local(spec)
    return summary or {}


# ----------------------------------------------------------------------------- commands
Opt = Annotated


def _option(*flags: str, metavar: str, meaning: str, default: str) -> Any:
    """An option whose ``--help`` says what it takes, what it is and its default."""
    help_text = escape(f"{meaning} [default: {default}]")  # not a rich markup tag
    return typer.Option(*flags, metavar=metavar, help=help_text, show_default=False)


def _setting(name: str, *flags: str, metavar: str, default: str | None = None) -> Any:
    """The option of run setting ``name``: what it is and its default as the run
    specification (and so docs/cli.md) says, or ``default`` where this command's differs."""
    meaning, spec_default = setting_help(name)
    return _option(*flags, metavar=metavar, meaning=meaning, default=default or spec_default)


def _flag(*flags: str, meaning: str, default: str = "off") -> Any:
    """A flag, shown with its default as every other option is."""
    help_text = escape(f"{meaning} [default: {default}]")  # not a rich markup tag
    return typer.Option(*flags, metavar="", help=help_text, show_default=False)


QUIET = _flag("--quiet", "-q", meaning="no progress display")
TABLE_HELP = "\b\nThe results table (runs numbered; the legend below it names them):\n" + "\n".join(
    escape(f"  {heading}: {meaning}") for heading, meaning in COLUMNS.items()
)


@app.command(cls=Command, epilog=TABLE_HELP)
def train(
    workload: Opt[str | None, _setting("workload", "--workload", "-w", metavar="NAME")] = None,
    optimizer: Opt[
        str | None, _setting("optimizer", "--optimizer", "-o", metavar="NAME[:k=v,...]|FILE")
    ] = None,
    learning_rate: Opt[
        float | None,
        _option("--lr", metavar="RATE", meaning="learning rate", default="the optimizer's"),
    ] = None,
    config: Opt[
        str | None,
        _option(
            "--config",
            "-c",
            metavar="FILE",
            meaning="RETURNN-style config file (.py or .json)",
            default="none",
        ),
    ] = None,
    strategy: Opt[
        str | None, _setting("strategy", "--strategy", "-s", metavar="NAME[:k=v,...]")
    ] = None,
    workers: Opt[int | None, _setting("workers", "--workers", "-n", metavar="N")] = None,
    servers: Opt[int | None, _setting("servers", "--servers", metavar="K")] = None,
    steps: Opt[int | None, _setting("steps", "--steps", metavar="N")] = None,
    seed: Opt[int | None, _setting("seed", "--seed", metavar="N")] = None,
    batch_size: Opt[int | None, _setting("batch_size", "--batch-size", metavar="N")] = None,
    straggler: Opt[str | None, _setting("straggler", "--straggler", metavar="RANK:MS")] = None,
    eval_every: Opt[int | None, _setting("eval_every", "--eval-every", metavar="K")] = None,
    checkpoint_every: Opt[
        int | None, _setting("checkpoint_every", "--checkpoint-every", metavar="K")
    ] = None,
    max_restarts: Opt[int | None, _setting("max_restarts", "--max-restarts", metavar="K")] = None,
    timeout: Opt[float | None, _setting("timeout", "--timeout", metavar="SECONDS")] = None,
    device: Opt[str | None, _setting("device", "--device", metavar="DEVICE")] = None,
    out: Opt[
        Path | None, _setting("out", "--out", metavar="DIR", default="a new one in runs/")
    ] = None,
    resume: Opt[
        Path | None,
        _option(
            "--resume",
            metavar="DIR",
            meaning="continue the run in this directory from its last checkpoint",
            default="none, a new run",
        ),
    ] = None,
    quiet: Opt[bool, QUIET] = False,
    log_level: Opt[str | None, _setting("log_level", "--log-level", metavar="LEVEL")] = None,
) -> None:
    """Train a workload with any optimizer and distribution strategy."""
    flags = dict(
        workload=workload,
        optimizer=optimizer,
        learning_rate=learning_rate,
        config=config,
        strategy=strategy,
        workers=workers,
        servers=servers,
        steps=steps,
        seed=seed,
        batch_size=batch_size,
        straggler=straggler,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        max_restarts=max_restarts,
        timeout=timeout,
        device=device,
        log_level=log_level,
    )
    try:
        if resume and device is not None:
            raise ConfigError("--resume continues on the run's own device: leave out --device")
        spec = resume_spec(resume, steps, log_level, max_restarts) if resume else resolve(flags)
    except (ConfigError, ValueError) as err:
        raise _fail(str(err)) from None
    if not resume:
        spec = dataclasses.replace(spec, out=str(out or _default_out(spec)))
    configure_logging(spec.log_level)
    log.info("run specification: %s", spec)
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    try:
        summary = execute(spec, spec.strategy, quiet)
    except WorkerFailed as err:
        log.info("run failed: %s", err)
        raise _fail(str(err), code=1) from None
    if not summary:  # a non-zero rank under torchrun
        return
    summary["label"] = Path(spec.out).name
    out_console.print(summary_table([summary], f"gradfleet train: {spec.workload}"))
    target = spec.target_accuracy
    verdict = ""
    if target is not None:
        reached = "reached" if summary["test_accuracy"] >= target else "NOT reached"
        verdict = f" (target {target:.2f}: {reached})"
    out_console.print(
        f"test accuracy {summary['test_accuracy']:.3f}{verdict}; model saved to "
        f"{summary['model']}; metrics in {Path(spec.out) / 'metrics.jsonl'}",
        highlight=False,
    )


# All-reduce against backup workers, local SGD and EASGD: the comparison gradfleet exists for.
DEFAULT_COMPARISON = [
    "allreduce",
    "sync-replicas:replicas_to_aggregate=2",  # one backup worker of 3: the slowed one
    "model-average:interval=8",
    "easgd:period=4",
]
COMPARE_WORKERS, COMPARE_DELAY_MS = 3, 20


def compare_straggler(workers: int) -> str | None:
    """``compare``'s ``--straggler`` when none is given: the last worker, slowed."""
    return f"{workers - 1}:{COMPARE_DELAY_MS:g}" if workers > 1 else None


@app.command(cls=Command, epilog=TABLE_HELP)
def compare(
    strategy: Opt[
        list[str],
        _option(
            "--strategy",
            "-s",
            metavar="NAME[:k=v,...]",
            meaning="repeat: each is one run",
            default=", ".join(DEFAULT_COMPARISON),
        ),
    ] = DEFAULT_COMPARISON,  # noqa: B006 - typer needs the literal list as the default
    optimizer: Opt[
        list[str] | None,
        _option(
            "--optimizer",
            "-o",
            metavar="NAME[:k=v,...]",
            meaning="repeat to also compare optimizers",
            default="the workload's",
        ),
    ] = None,
    workload: Opt[str, _setting("workload", "--workload", "-w", metavar="NAME")] = "digits",
    workers: Opt[
        int, _setting("workers", "--workers", "-n", metavar="N", default=str(COMPARE_WORKERS))
    ] = COMPARE_WORKERS,
    servers: Opt[
        int | None,
        _option(
            "--servers",
            metavar="K",
            meaning="K dedicated server processes for every run (each strategy must have servers)",
            default="0",
        ),
    ] = None,
    steps: Opt[int | None, _setting("steps", "--steps", metavar="N")] = None,
    seed: Opt[int, _setting("seed", "--seed", metavar="N")] = 0,
    straggler: Opt[
        str | None,
        _setting(
            "straggler",
            "--straggler",
            metavar="RANK:MS",
            default=f"the last worker, +{COMPARE_DELAY_MS} ms",
        ),
    ] = None,
    device: Opt[str | None, _setting("device", "--device", metavar="DEVICE")] = None,
    out: Opt[
        Path,
        _option(
            "--out",
            metavar="DIR",
            meaning="directory for the runs, the plot and the table",
            default="runs/compare",
        ),
    ] = Path("runs/compare"),
    quiet: Opt[bool, QUIET] = False,
    log_level: Opt[str | None, _setting("log_level", "--log-level", metavar="LEVEL")] = None,
) -> None:
    """Run one workload under several strategies (and optimizers); plot and tabulate."""
    from .plot import plot_runs

    straggler = straggler or compare_straggler(workers)

    specs: list[tuple[str, RunSpec]] = []
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
                    servers=servers,
                    steps=steps,
                    seed=seed,
                    batch_size=None,
                    straggler=None if s.split(":")[0] == "none" else straggler,
                    eval_every=None,
                    checkpoint_every=None,
                    device=device,
                    log_level=log_level,
                )
                spec = resolve(flags)
                assert spec.optimizer is not None
                label = s if not optimizer else f"{spec.optimizer['class']} / {s}"
                specs.append((label, spec))
    except (ConfigError, ValueError) as err:
        raise _fail(str(err)) from None
    out.mkdir(parents=True, exist_ok=True)
    configure_logging(specs[0][1].log_level)
    rows, runs = [], {}
    for i, (label, spec) in enumerate(specs):
        run_dir = out / f"run{i}-{label.replace('/', '_').replace(' ', '')}"
        spec = dataclasses.replace(spec, out=str(run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            summary = execute(spec, label, quiet)
        except WorkerFailed as err:
            log.info("run %s failed: %s", label, err)
            raise _fail(f"{label}: {err}", code=1) from None
        rows.append({**summary, "label": label})
        runs[label] = run_dir / "metrics.jsonl"
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


@app.command("list", cls=Command)
def list_(
    args: Opt[
        bool,
        _flag("--args/--no-args", meaning="show each optimizer's arguments", default="on"),
    ] = True,
) -> None:
    """The optimizers, strategies and workloads available, with their arguments."""
    from gradfleet.registry import constructor_arguments

    from .optimizer_choice import offered, takes_sparse

    table = Table(title="optimizers (--optimizer NAME[:key=value,...])")
    table.add_column("name")
    table.add_column("class")
    table.add_column("sparse", justify="center")
    if args:
        table.add_column("arguments")
    for name, cls in offered().items():
        sparse = "yes" if takes_sparse(cls) else "no"
        table.add_row(name, cls.__name__, sparse, *[", ".join(constructor_arguments(cls))] * args)
    out_console.print(table)
    out_console.print(
        "sparse: it also takes the sparse gradients of a sparse embedding (workload ctr)",
        highlight=False,
    )
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


@app.command("store", cls=Command)
def store(
    port: Opt[
        int,
        _option("--port", "-p", metavar="PORT", meaning="the port to serve on", default="29500"),
    ] = 29500,
    timeout: Opt[
        float,
        _option("--timeout", metavar="SECONDS", meaning="the store's own timeout", default="300"),
    ] = 300.0,
) -> None:
    """Host a job's store in a process of its own, for the torchrun recipe with
    GRADFLEET_STORE=own: no worker rank then hosts it, so rank 0 may be lost too.
    Serves until it is ended (Ctrl-C or SIGTERM)."""
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    if not 1 <= port <= 65535:
        raise _fail(f"--port must be in 1..65535, got {port}")
    if not timeout > 0:
        raise _fail(f"--timeout must be > 0 seconds, got {timeout}")
    served = dist.TCPStore(
        "0.0.0.0", port, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )  # fmt: skip
    # torch's TCPStore listens on every interface, as torchrun's rendezvous store does
    out_console.print(f"job store serving on port {served.port} (every interface)", highlight=False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass


def _workload_doc(name: str) -> str:
    return {
        "digits": "MLP on generated noisy 8x8 digits (dense)",
        "ctr": "hashed-feature logistic regression, sparse EmbeddingBag",
    }[name]


def main() -> None:
    """Entry point of the ``gradfleet`` console script and ``python -m gradfleet``."""
    try:
        app(prog_name="gradfleet")
    finally:
        # The work is done (output written, ranks ended): the interpreter's teardown would
        # still garbage-collect every object torch, typer and rich made, which took 3-5 s of
        # a failing run's exit on a loaded 2-core machine (and made the CLI fail slower than
        # torchrun). Frozen objects are left to the process's exit; atexit handlers still run.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
