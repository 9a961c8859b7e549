"""``gradfleet`` console command: ``train``, ``compare`` and ``list``.

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
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from . import strategy_table as strat
from .config import ConfigError, parse_straggler
from .convert import app as convert_app
from .launch import WorkerFailed, launch, run_local, under_torchrun
from .logs import configure_logging
from .progress import Progress
from .spec import LOG_LEVELS, RunSpec, resolve, resume_spec
from .summary import summary_table
from .workloads import WORKLOADS

log = logging.getLogger(__name__)

out_console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def _error_line(message: str) -> None:
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    _error_line(message)
    return typer.Exit(code)


def _click_error(name: str) -> type[Exception]:
    """Click's exception class ``name``, of the click typer uses (its own copy since 0.2x)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


_USAGE_ERROR, _CLICK_ERROR = _click_error("UsageError"), _click_error("ClickException")


class _OneLineErrors(TyperGroup):
    """The command group whose parsing errors (a missing option, a value of the wrong type,
    an unknown command or flag) are one ``error:`` line with exit code 2, as every other bad
    input is, instead of click's usage box."""

    def main(  # type: ignore[override]
        self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
        standalone_mode: bool = True, **extra: Any,
    ) -> Any:  # fmt: skip
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _CLICK_ERROR as err:
            ctx = getattr(err, "ctx", None) if isinstance(err, _USAGE_ERROR) else None
            where = f" (see {ctx.command_path} --help)" if ctx else ""
            _error_line(err.format_message().rstrip(".") + where)  # type: ignore[attr-defined]
            code = err.exit_code  # type: ignore[attr-defined]
        except typer.Abort:
            _error_line("aborted")
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    help="TensorFlow-exact optimizers and TF1 distribution strategies on PyTorch: train and "
    "compare on one machine.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
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
    show = not under_torchrun() or _env_rank() == 0
    assert spec.steps is not None
    progress = Progress(out / "metrics.jsonl", spec.steps, label, quiet or not show)
    with progress:
        summary = launch(spec) if spawn and not under_torchrun() else run_local(spec)
    return summary or {}


def _env_rank() -> int:
    return int(os.environ.get("GRADFLEET_RANK", os.environ.get("RANK", 0)))


# ----------------------------------------------------------------------------- commands
Opt = Annotated
LOG_LEVEL_HELP = f"{', '.join(LOG_LEVELS)}: of the launcher and every worker (warning)"
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
    servers: Opt[
        int | None,
        typer.Option(
            "--servers",
            help="K extra processes that only serve (ranks N..N+K-1): sync-replicas (K=1: one "
            "server, K>1: shards) or easgd:mode=async (K=1: its centre); 0: inside the workers",
        ),
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
        typer.Option(
            help="seconds to wait for a silent worker or server before failing "
            f"({RunSpec.timeout:g})"
        ),
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
    log_level: Opt[str | None, typer.Option(help=LOG_LEVEL_HELP)] = None,
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
        timeout=timeout,
        device=device,
        log_level=log_level,
    )
    try:
        if resume and device is not None:
            raise ConfigError("--resume continues on the run's own device: leave out --device")
        spec = resume_spec(resume, steps, log_level) if resume else resolve(flags)
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
    servers: Opt[
        int | None,
        typer.Option(
            "--servers",
            help="K dedicated server processes for every run (each strategy must have servers)",
        ),
    ] = None,
    steps: Opt[int | None, typer.Option()] = None,
    seed: Opt[int, typer.Option()] = 0,
    straggler: Opt[str | None, typer.Option(help="RANK:DELAY_MS applied to every run")] = "1:20",
    device: Opt[str | None, typer.Option(help=DEVICE_HELP)] = None,
    out: Opt[Path, typer.Option(help="directory for the runs, the plot and the table")] = Path(
        "runs/compare"
    ),
    quiet: Opt[bool, typer.Option("--quiet", "-q")] = False,
    log_level: Opt[str | None, typer.Option(help=LOG_LEVEL_HELP)] = None,
) -> None:
    """Run one workload under several strategies (and optimizers); plot and tabulate."""
    from .plot import plot_runs

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


@app.command("list")
def list_(
    args: Opt[
        bool, typer.Option("--args/--no-args", help="show each optimizer's arguments")
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
