"""The run specification: every setting of one training run, its default and its flag.

A :class:`RunSpec` is built once, by :func:`resolve`, from a config file's keys and the
command-line flags (flags win), checked before anything is written or started, then passed
as it is to every rank and saved as the run directory's ``config.json`` (what ``--resume``
reads back). A bad value is a :class:`~gradfleet.cli.config.ConfigError` naming the flag.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import strategy_table as strat
from .config import ConfigError, load_config, optimizer_config, parse_spec, parse_straggler
from .devices import check_device, parse_device
from .optimizer_choice import check_trainable, gradient_kinds, lookup
from .run_files import latest_checkpoint
from .servers import lockstep, validate_servers
from .torchrun import under_torchrun
from .workloads import check_workload, load_workload

__all__ = [
    "LOG_LEVELS",
    "RunSpec",
    "resolve",
    "resume_spec",
    "setting_help",
    "settings_markdown",
    "settings_table",
]

LOG_LEVELS = ("debug", "info", "warning", "error")


def _key(help: str, flag: str | None = None, config: bool = True, default: str = "") -> Any:
    """Field metadata: what the setting is, its flag, whether a config file may set it, and
    how to print a default that is resolved later (e.g. "the workload's")."""
    return {"help": help, "flag": flag, "config": config, "default": default}


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: what every rank trains and what ``config.json`` holds."""

    workload: str = field(
        default="digits",
        metadata=_key("digits, ctr, or FILE.py[:function] returning a Workload", "--workload"),
    )
    optimizer: dict[str, Any] | None = field(
        default=None,
        metadata=_key(
            "NAME[:key=value,...], a dict with a 'class' entry, or (flag only) a RETURNN-style "
            "config FILE.py/.json; --lr / learning_rate overrides its learning rate",
            "--optimizer",
            default="the workload's",
        ),
    )
    strategy: str = field(
        default="none",
        metadata=_key(
            "NAME[:key=value,...] or a dict with a 'class' entry: none, allreduce, "
            "model-average, easgd, towers, sync-replicas",
            "--strategy",
        ),
    )
    strategy_args: dict[str, Any] = field(
        default_factory=dict,
        metadata=_key("the strategy's arguments (from --strategy)", config=False, default="{}"),
    )
    workers: int = field(
        default=1, metadata=_key("local worker processes (towers: replicas)", "--workers")
    )
    servers: int = field(
        default=0,
        metadata=_key(
            "extra processes (ranks N..N+K-1) that only serve: sync-replicas (K=1: one server, "
            "K>1: shards) or easgd:mode=async (K=1: its centre); 0: servers inside the workers",
            "--servers",
        ),
    )
    device: str = field(
        default="cpu",
        metadata=_key(
            "cpu, cuda (rank r, or tower t, on cuda:r / cuda:t) or cuda:N (one rank, or every "
            "tower, on GPU N)",
            "--device",
        ),
    )
    steps: int | None = field(
        default=None,
        metadata=_key(
            "model updates to train: each worker's training steps (sync-replicas: the "
            "updates its servers make from R gradients each)",
            "--steps",
            default="the workload's",
        ),
    )
    seed: int = field(default=0, metadata=_key("data and initialisation seed", "--seed"))
    batch_size: int | None = field(
        default=None,
        metadata=_key("per-worker batch size", "--batch-size", default="the workload's"),
    )
    straggler: tuple[int, float] | None = field(
        default=None, metadata=_key("RANK:DELAY_MS: slow one worker down", "--straggler")
    )
    eval_every: int | None = field(
        default=None,
        metadata=_key(
            "evaluate on the test set every K steps (0: never)", "--eval-every", default="steps/5"
        ),
    )
    checkpoint_every: int = field(
        default=0, metadata=_key("checkpoint every K steps (0: never)", "--checkpoint-every")
    )
    max_restarts: int = field(
        default=0,
        metadata=_key(
            "times the launcher restarts a lost rank (a worker, or the server of --servers 1) "
            "into the running job, from a live peer's state (strategies that go on without it)",
            "--max-restarts",
        ),
    )
    timeout: float = field(
        default=120.0,
        metadata=_key("seconds to wait for a silent worker or server before failing", "--timeout"),
    )
    log_level: str = field(
        default="warning",
        metadata=_key(
            f"{', '.join(LOG_LEVELS)}: logging level of the launcher and every worker",
            "--log-level",
        ),
    )
    threads: int = field(
        default=1, metadata=_key("torch threads per rank", config=False, default="1")
    )
    target_accuracy: float | None = field(
        default=None,
        metadata=_key(
            "the workload's stated test accuracy", config=False, default="the workload's"
        ),
    )
    out: str = field(
        default="",
        metadata=_key(
            "run directory",
            "--out",
            config=False,
            default="runs/<time>-<workload>-<opt>-<strategy>",
        ),
    )
    resume: bool = field(
        default=False, metadata=_key("continue from the last checkpoint", "--resume", config=False)
    )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        """A spec from ``config.json`` (keys it does not know are ignored)."""
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("straggler") is not None:
            values["straggler"] = tuple(values["straggler"])
        return cls(**values)


CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(RunSpec) if f.metadata["config"])
"""The settings a config file may give (besides ``learning_rate``)."""


def settings_table() -> list[tuple[str, bool, str, str, str]]:
    """``(field, config-file key?, flag, default, meaning)`` for every field of
    :class:`RunSpec` (the docs' table)."""
    rows = []
    for f in dataclasses.fields(RunSpec):
        meta = f.metadata
        default = meta["default"] or repr(f.default)
        rows.append((f.name, meta["config"], meta["flag"] or "", default, meta["help"]))
    return rows


def setting_help(name: str) -> tuple[str, str]:
    """What setting ``name`` is and its default, as ``--help`` shows them."""
    f = next(f for f in dataclasses.fields(RunSpec) if f.name == name)
    default = f.metadata["default"] or ("none" if f.default is None else str(f.default))
    return f.metadata["help"], default.removesuffix(".0")  # 120.0 s: 120


def settings_markdown() -> str:
    """:func:`settings_table` as the Markdown table of ``docs/cli.md``."""
    lines = ["| field | config file | flag | default | meaning |", "|---|---|---|---|---|"]
    for name, config, flag, default, meaning in settings_table():
        cells = [f"`{name}`", "yes" if config else "no", f"`{flag}`" if flag else "-"]
        lines.append("| " + " | ".join([*cells, f"`{default}`", meaning]) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- checking values
def _integer(flag: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")
    return value


def _seconds(flag: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value!r}")
    return float(value)


def _choice(flag: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _check_optimizer(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with its class looked up (a name that is none fails here, with "did you
    mean"), built on a stand-in parameter (bad values fail here)."""
    import torch

    from gradfleet.registry import create_optimizer

    config = {**opts, "class": lookup(opts.get("class"))}
    try:
        create_optimizer([torch.nn.Parameter(torch.zeros(1))], config)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"optimizer {opts.get('class')!r}: {err}") from None
    return config


def _settings(config: str | None, optimizer: str | None) -> dict[str, Any]:
    """Settings from ``--config``, or from ``--optimizer FILE`` (RETURNN style)."""
    path = config
    if optimizer and optimizer.endswith((".py", ".json")):
        if config:
            raise ConfigError("give the config file either as --config or as --optimizer")
        path = optimizer
    return load_config(path, (*CONFIG_KEYS, "learning_rate")) if path else {}


def check_run_device(device: str, strategy: str, workers: int) -> None:
    """A GPU for each process of the run on this machine, and for each tower."""
    if under_torchrun():
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    else:
        processes = workers if strat.STRATEGIES[strategy].spawns else 1
    check_device(device, processes, workers if strategy == "towers" else 1)


def _check_restarts(max_restarts: int, name: str, args: dict[str, Any], workers: int) -> None:
    """A rank is restarted into the running job only where the job goes on without it."""
    if max_restarts and not strat.tolerated_losses(name, args, workers):
        raise ConfigError(
            f"--max-restarts {max_restarts}: strategy {name} cannot lose a worker (its ranks run "
            "collectives in lockstep, or no backup is left), so none can be restarted into the "
            "running job; use 0, or a strategy with backups (sync-replicas with "
            "replicas_to_aggregate < workers, easgd:mode=async)"
        )


# ----------------------------------------------------------------------------- resolving
def resolve(flags: dict[str, Any]) -> RunSpec:
    """Merge a config file (``flags["config"]``) and the flags (``None``: not given) into a
    checked spec; nothing is written.

    Checked in the cheapest order: the config file, then plain values, then names (of the
    optimizer, the strategy, the device), then what needs building: the optimizer on a
    stand-in parameter, the workload's model and data, a trial step of the optimizer."""
    flags = dict(flags)
    file = _settings(flags.pop("config", None), flags.get("optimizer"))
    if flags.get("optimizer") and flags["optimizer"].endswith((".py", ".json")):
        flags["optimizer"] = None
    merged = {**file, **{k: v for k, v in flags.items() if v is not None}}
    lr = merged.get("learning_rate")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))):
        raise ConfigError(f"--lr must be a number, got {lr!r}")
    workers = _integer("--workers", merged.get("workers", RunSpec.workers), 1)
    servers = _integer("--servers", merged.get("servers", RunSpec.servers), 0)
    seed = _integer("--seed", merged.get("seed", RunSpec.seed), 0)
    given_steps = merged.get("steps")
    if given_steps is not None:
        _integer("--steps", given_steps, 1)
    batch_size = merged.get("batch_size")
    if batch_size is not None:
        _integer("--batch-size", batch_size, 1)
    checkpoint_every = _integer(
        "--checkpoint-every", merged.get("checkpoint_every", RunSpec.checkpoint_every), 0
    )
    timeout = _seconds("--timeout", merged.get("timeout", RunSpec.timeout))
    max_restarts = _integer("--max-restarts", merged.get("max_restarts", RunSpec.max_restarts), 0)
    straggler = merged.get("straggler")
    if straggler is not None:
        straggler = parse_straggler(straggler)
        if straggler[0] >= workers:
            raise ConfigError(f"--straggler rank {straggler[0]} but only {workers} worker(s)")
    if merged.get("eval_every") is not None:
        _integer("--eval-every", merged["eval_every"], 0)
    log_level = _choice("--log-level", merged.get("log_level", RunSpec.log_level), LOG_LEVELS)
    given = optimizer_config(merged["optimizer"], lr) if merged.get("optimizer") else None
    if given is not None:
        lookup(given.get("class"))  # a name that is none: "did you mean"
    workload_name = merged.get("workload", RunSpec.workload)
    try:
        check_workload(workload_name)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    strategy = merged.get("strategy", RunSpec.strategy)
    name, args = strategy if isinstance(strategy, tuple) else parse_spec(strategy, "strategy")
    strat.validate_strategy(name, args, workers, servers=servers)
    _check_restarts(max_restarts, name, args, workers)
    if name == "sync-replicas" and checkpoint_every and not (servers and lockstep(args, workers)):
        raise ConfigError(
            "--checkpoint-every with sync-replicas needs dedicated servers (--servers K) in "
            "lockstep (replicas_to_aggregate = --workers, without num_tokens or tokens=shared: "
            "one gradient per worker per update): otherwise its ranks run different numbers of "
            "local steps, so there is no common point to checkpoint"
        )
    device = parse_device(merged.get("device", RunSpec.device))
    check_run_device(device, name, workers)
    # a bad value fails before the workload's data is built
    config = None if given is None else _check_optimizer(given)
    try:
        workload = load_workload(workload_name, seed)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    opts = given or optimizer_config(workload.optimizer, lr)
    config = config or _check_optimizer(opts)
    check_trainable(config, gradient_kinds(workload.model), workload_name)
    num_params = sum(1 for _ in workload.model.parameters())
    validate_servers(name, args, workers, servers, num_params)
    steps = given_steps if given_steps is not None else workload.steps
    eval_every = merged.get("eval_every", max(steps // 5, 1))
    return RunSpec(
        workload=workload_name,
        optimizer=opts,
        strategy=name,
        strategy_args=args,
        workers=workers,
        servers=servers,
        device=device,
        steps=steps,
        seed=seed,
        batch_size=batch_size,
        straggler=straggler,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        max_restarts=max_restarts,
        timeout=timeout,
        log_level=log_level,
        target_accuracy=workload.target,
    )


def resume_spec(
    run: Path, steps: int | None, log_level: str | None, max_restarts: int | None = None
) -> RunSpec:
    """The spec saved in run directory ``run``, to continue from its last checkpoint
    (``steps``, ``log_level`` and ``max_restarts`` may be given anew)."""
    cfg = run / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"--resume {run}: not a gradfleet run directory (no config.json)")
    if latest_checkpoint(run) is None:
        raise ConfigError(f"--resume {run}: no checkpoint (train with --checkpoint-every K)")
    spec = RunSpec.from_json(cfg.read_text())
    check_run_device(spec.device, spec.strategy, spec.workers)
    changes: dict[str, Any] = {"resume": True, "out": str(run)}
    if steps is not None:
        changes["steps"] = _integer("--steps", steps, 1)
    if log_level is not None:
        changes["log_level"] = _choice("--log-level", log_level, LOG_LEVELS)
    if max_restarts is not None:
        changes["max_restarts"] = _integer("--max-restarts", max_restarts, 0)
        _check_restarts(max_restarts, spec.strategy, spec.strategy_args, spec.workers)
    return dataclasses.replace(spec, **changes)
