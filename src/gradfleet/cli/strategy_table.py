"""What each distribution strategy is, takes and runs with: the table behind ``--strategy
NAME[:key=value,...]``, the checks of a strategy's arguments before any process starts, and how
many workers a run of it can lose (:func:`tolerated_losses`).  Each entry names the adapter
that runs it (:mod:`.strategies`): ``TABLE[name].adapter(args, rank, world)``.

:data:`TABLE` is every strategy gradfleet builds, the CLI's and the benchmarks' alike;
:data:`STRATEGIES` is what ``--strategy`` offers, all of them but the cluster benchmark's torch
DDP reference (``cli=False``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gradfleet.distributed as gfd
from gradfleet.distributed.sync.arguments import (
    check_standby,
    choose_transport,
    default_losses,
    default_tokens,
)

from .strategies import (
    DDP,
    DEFAULT_RHO,
    AllReduce,
    Easgd,
    ModelAverage,
    Strategy,
    SyncReplicas,
    Towers,
    easgd_modes,
)

__all__ = [
    "STRATEGIES",
    "TABLE",
    "StrategyInfo",
    "available",
    "rank0_replaceable",
    "server_replaceable",
    "centre_standby",
    "chief_standby",
    "serverless_losses",
    "tolerated_losses",
    "validate_strategy",
]


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    help: str
    args: dict[str, str]  # argument -> description (with its default)
    adapter: type[Strategy]  # runs it: adapter(args, rank, world), args as checked here
    min_workers: int = 1
    max_workers: int | None = None
    spawns: bool = True  # False: one process (towers run as threads)
    cli: bool = True  # False: not offered by --strategy (a reference of the cluster benchmark)


TABLE: dict[str, StrategyInfo] = {
    s.name: s
    for s in (
        StrategyInfo(
            "none", "plain single-process training", {}, Strategy, max_workers=1, spawns=False
        ),
        StrategyInfo(
            "allreduce",
            "synchronous data parallel: average gradients every step (sparse ok)",
            {},
            AllReduce,
        ),
        StrategyInfo(
            "model-average",
            "local SGD: local steps, exact model average every `interval` steps",
            {"interval": "local steps between averaging rounds (default 8)"},
            ModelAverage,
        ),
        StrategyInfo(
            "easgd",
            "elastic averaging SGD: workers pulled towards a centre every `period` steps",
            {
                "mode": "sync (all-reduce centre on every rank; default) or async",
                "period": "local steps between elastic exchanges (default 4)",
                "moving_rate": "alpha in (0, 1] (default 0.9 / (period * workers))",
                "rho": "elastic penalty (default 0.1; rho=tf: TF's moving_rate / learning_rate, "
                "which suits plain SGD but stalls Adam)",
                "standby": "async: true (chosen), false or a worker rank: a live copy of the "
                "centre, which takes over if the centre's host is lost (default: on with "
                "--servers 1, off with the centre on rank 0, where it costs rank 0 its "
                "loopback exchanges)",
            },
            Easgd,
        ),
        StrategyInfo(
            "towers",
            "one process, `--workers` model replicas (towers) on slices of each batch",
            {},
            Towers,
            spawns=False,
        ),
        StrategyInfo(
            "sync-replicas",
            "synchronous replicas with backup workers: aggregate the first k of N gradients",
            {
                "replicas_to_aggregate": "gradients aggregated per step (default: workers - 1), "
                "or auto: chosen before every update from the workers' measured rounds and the "
                "gradients' noise",
                "total_num_replicas": "workers taking part (default: workers)",
                "num_tokens": "initial tokens of TF's shared queue (TF's num_tokens; "
                "giving it selects tokens=shared)",
                "tokens": "distinct (default: each update takes one gradient from each of "
                "replicas_to_aggregate workers) or shared (TF's token queue: first come, "
                "first served)",
                "transport": "allreduce (default where no server is asked for: no server, "
                "every rank keeps the state; with replicas_to_aggregate = workers DDP-style "
                "buckets, with fewer or auto, on the CPU, the first R ready all-reduce and the "
                "others receive the update) or server (rank 0, or the shards and --servers)",
                "overlap": "true/false: send gradients during backward (default: on for "
                "allreduce, where it never changes the numbers; off for servers)",
                "shards": "parameter shards over the worker ranks, shard k on worker "
                "k mod workers (default 1: one server on rank 0; asks for a server)",
                "shard_assignment": "bytes, round_robin, split or backward_order (default: "
                "backward_order, 4 per rank, with several shards where the optimizer allows)",
                "max_losses": "workers the exchange without a server may lose and go on "
                "without, rank 0 included (default: workers - replicas_to_aggregate with "
                "backups, workers - 1 with auto, 0 with replicas_to_aggregate = workers; 0 "
                "turns it off); the survivors heal from each other's state, and a restarted "
                "worker rejoins from a live one",
                "standby": "true (chosen), false or a worker rank: a live copy of the "
                "chief (with shards, true: of every server) on another rank, which takes over "
                "if the server's host is lost (default: on with one server and backups "
                "(auto included), or --servers 1)",
                "hear_every_worker": "true/false: with transport=allreduce and "
                "replicas_to_aggregate < workers, a worker left out of many updates is "
                "waited for briefly (default true; false: the first R always make the update)",
            },
            SyncReplicas,
            min_workers=2,
        ),
        StrategyInfo(
            "ddp",
            "torch DistributedDataParallel: bucketed gradient all-reduce overlapped with "
            "backward (the cluster benchmark's reference)",
            {},
            DDP,
            cli=False,
        ),
    )
}
STRATEGIES: dict[str, StrategyInfo] = {n: s for n, s in TABLE.items() if s.cli}


def _has(name: str) -> bool:
    return hasattr(gfd, name)


def available(name: str) -> bool:
    """Whether gradfleet.distributed provides what strategy ``name`` needs."""
    if name == "sync-replicas":
        return _has("SyncReplicasOptimizer")
    return True


def _int(spec: str, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"strategy {spec}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def validate_strategy(
    name: str,
    args: dict[str, Any],
    workers: int,
    table: Mapping[str, StrategyInfo] = STRATEGIES,
    servers: int = 0,
) -> None:
    """Reject unknown strategies/arguments and impossible worker counts (before any launch).

    ``table``: the strategies to accept, by default ``--strategy``'s (the cluster benchmark
    passes :data:`TABLE`)."""
    if name not in table:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(table)}")
    info = table[name]
    if not available(name):
        raise ValueError(f"strategy {name!r} is not available in this gradfleet build yet")
    unknown = sorted(set(args) - set(info.args))
    if unknown:
        allowed = ", ".join(info.args) or "none"
        raise ValueError(f"strategy {name} does not take {unknown}; its arguments: {allowed}")
    if workers < info.min_workers:
        raise ValueError(f"strategy {name} needs --workers >= {info.min_workers}, got {workers}")
    if info.max_workers is not None and workers > info.max_workers:
        raise ValueError(f"strategy {name} runs {info.max_workers} worker, got --workers {workers}")
    if name == "model-average":
        _int(name, "interval", args.get("interval", 8), 1)
    if name == "easgd":
        _int(name, "period", args.get("period", 4), 1)
        mode = args.get("mode", "sync")
        if mode not in easgd_modes():
            have = list(easgd_modes())
            raise ValueError(f"strategy easgd: mode {mode!r} not available; have {have}")
        rate = args.get("moving_rate")
        if rate is not None and not (isinstance(rate, (int, float)) and 0 < rate <= 1):
            raise ValueError(f"strategy easgd: moving_rate must be in (0, 1], got {rate!r}")
        rho = args.get("rho", DEFAULT_RHO)
        if rho != "tf" and not (isinstance(rho, (int, float)) and rho >= 0):
            raise ValueError(f"strategy easgd: rho must be >= 0 or 'tf', got {rho!r}")
        standby = args.get("standby")
        if standby is not None and standby is not False:
            if mode != "async" or not isinstance(standby, (bool, int)):
                raise ValueError(
                    "strategy easgd: standby must be true, false or a worker rank, with "
                    f"mode=async; got standby={standby!r}, mode={mode}"
                )
            lowest = 0 if servers else 1  # without --servers rank 0 hosts the centre
            if standby is not True and not lowest <= standby < workers:
                raise ValueError(
                    f"strategy easgd: standby must be a worker rank in [{lowest}, {workers})"
                    f"{'' if servers else ' (rank 0 hosts the centre)'}, got {standby}"
                )
    if name == "sync-replicas":
        total = _int(name, "total_num_replicas", args.get("total_num_replicas", workers), 1)
        k = args.get("replicas_to_aggregate", workers - 1)
        auto = k == "auto"
        if auto:
            k = total  # it starts from every worker
        k = _int(name, "replicas_to_aggregate or 'auto'", k, 1)
        if total > workers:
            raise ValueError(
                f"strategy sync-replicas: total_num_replicas={total} needs --workers >= {total}, "
                f"got {workers}"
            )
        if k > total:
            raise ValueError(
                f"strategy sync-replicas: replicas_to_aggregate={k} > total_num_replicas={total}"
            )
        tokens = args.get("num_tokens", -1)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < -1:
            raise ValueError(
                f"strategy sync-replicas: num_tokens must be an integer >= -1, got {tokens!r}"
            )
        _int(name, "shards", args.get("shards", 1), 1)
        losses = _int(name, "max_losses", args.get("max_losses", 0), 0)
        serverless = args.get("transport") != "server" and not servers_asked(args)
        fewest = 1 if auto else k  # a chosen R follows the live workers
        if losses and (not serverless or losses > total - fewest if fewest < total
                       else losses >= total):  # fmt: skip
            raise ValueError(
                f"strategy sync-replicas: max_losses={losses} needs no server (no shards, "
                f"transport=server, tokens=shared or num_tokens) and fewer losses than the "
                f"workers, at most total_num_replicas - replicas_to_aggregate with backups (got "
                f"{k} of {total}); with a server, backups tolerate the loss of a worker already"
            )
        choices = {
            "tokens": ("distinct", "shared"),
            "transport": ("allreduce", "server"),
            "overlap": (True, False),
            "hear_every_worker": (True, False),
            "shard_assignment": ("bytes", "round_robin", "split", "backward_order"),
        }
        for key, allowed in choices.items():
            if key in args and args[key] not in allowed:
                shown = ", ".join(str(a).lower() for a in allowed)
                raise ValueError(
                    f"strategy sync-replicas: {key} must be one of {shown}, got {args[key]!r}"
                )
        chief_standby(args, workers, servers)  # the library's own check of standby=
        if args.get("hear_every_worker") is False and not (
            (k < total or auto) and args.get("transport") == "allreduce"
        ):
            raise ValueError(
                "strategy sync-replicas: hear_every_worker=false applies to backups without a "
                f"server (transport=allreduce, replicas_to_aggregate < workers); got "
                f"replicas_to_aggregate={k} of {total}, "
                f"transport={args.get('transport', 'default')}"
            )


def servers_asked(args: dict[str, Any]) -> bool:
    """Does a sync-replicas run name its servers (``shards``, ``--servers``' ranks) or an
    option only a server has (TF's shared token queue)?"""
    named = "shards" in args or "server_ranks" in args or "server_address" in args
    return named or args.get("tokens") == "shared" or int(args.get("num_tokens", -1)) != -1


@dataclass(frozen=True)
class SyncExchange:
    """A sync-replicas run's exchange as the library chooses it for one process per worker
    (:func:`gradfleet.distributed.sync.arguments.choose_transport`): ``transport``, R of
    ``total`` workers, whether R is ``chosen`` per update, and whether there are ``backups``."""

    transport: str
    R: int
    total: int
    chosen: bool
    backups: bool


def sync_exchange(
    args: dict[str, Any], workers: int, servers: int = 0, device: str = "cpu"
) -> SyncExchange:
    """The exchange of a sync-replicas run (``servers``: ``--servers``, which asks for one)."""
    total = int(args.get("total_num_replicas", workers))
    k = args.get("replicas_to_aggregate", workers - 1)
    chosen = k == "auto"
    R = total if chosen else int(k)
    backups = chosen or R < total
    tokens = default_tokens(args.get("tokens"), R, total, args.get("num_tokens", -1))
    server_only = backups and (args.get("overlap") is True or "shard_assignment" in args)
    transport = choose_transport(
        args.get("transport"), R, total, tokens, servers_asked(args) or servers > 0, chosen,
        cpu_gloo=device == "cpu", server_only=server_only, world=workers,
    )  # fmt: skip
    return SyncExchange(transport, R, total, chosen, backups)


def chief_standby(
    args: dict[str, Any], workers: int, servers: int = 0, device: str = "cpu"
) -> bool:
    """Does a sync-replicas run's chief keep a live standby?  The library's own rule
    (:func:`gradfleet.distributed.sync.arguments.check_standby`) for the exchange it chooses
    and the servers the run names (``servers``: ``--servers``; else ``shards`` over the
    workers, or rank 0's one); its ``ValueError`` for a standby it refuses."""
    x = sync_exchange(args, workers, servers, device)
    shards = int(args.get("shards", 1))
    ranks = (
        [workers + i for i in range(servers)] if servers else [i % x.total for i in range(shards)]
    )
    standby = check_standby(args.get("standby"), x.transport, ranks, x.R, x.total, x.chosen,
                            False, True)  # fmt: skip
    return standby is not False


def serverless_losses(name: str, args: dict[str, Any], workers: int, device: str = "cpu") -> int:
    """The losses a sync-replicas run goes on without where every rank holds the whole state:
    the library's own choice of exchange and default losses
    (:func:`gradfleet.distributed.sync.arguments.choose_transport`, ``default_losses``) for one
    process per worker -- 0 elsewhere, and for a run with a server, whose rank 0 holds the
    state alone."""
    if name != "sync-replicas":
        return 0
    x = sync_exchange(args, workers, 0, device)
    if x.transport != "allreduce":
        return 0
    return default_losses(args.get("max_losses"), x.transport, x.backups, x.R, x.total, x.chosen)


def centre_standby(args: dict[str, Any], workers: int, servers: int = 0) -> bool:
    """Does an asynchronous EASGD run's centre keep a live standby?  On a dedicated server
    rank (``--servers``), by default (``standby=false`` turns it off); on a worker rank, when
    asked (``standby=true`` or a rank) with two or more workers."""
    if args.get("mode", "sync") != "async":
        return False
    standby = args.get("standby")
    if servers:
        return workers >= 1 and standby is not False
    return workers >= 2 and standby is not None and standby is not False


def rank0_replaceable(name: str, args: dict[str, Any], workers: int, device: str = "cpu") -> bool:
    """Can the job lose rank 0 (under a launcher that hosts the job's store)?  Where every
    rank holds the whole state -- sync-replicas without a server, losses allowed -- the lowest
    live rank takes over rank 0's files; where asynchronous EASGD's centre on rank 0 has a
    standby (``standby=true`` or a rank, with two or more workers), the standby's rank does;
    elsewhere rank 0 hosts the servers."""
    if name == "easgd" and args.get("mode", "sync") == "async":
        return int(args.get("server_rank", 0)) == 0 and centre_standby(args, workers)
    if name == "sync-replicas" and chief_standby(args, workers, 0, device):
        return True  # the chief on rank 0 has a standby: its rank takes over
    return serverless_losses(name, args, workers, device) > 0


def server_replaceable(name: str, args: dict[str, Any], workers: int, servers: int = 1) -> bool:
    """Can the job lose a dedicated server rank (``--servers K``)?  Where asynchronous EASGD's
    centre, or each sync-replicas server, has a standby on a worker rank (the default with
    one server; ``standby=true`` with several; ``standby=false`` turns it off): the workers
    move to it and go on."""
    if name == "easgd" and args.get("mode", "sync") == "async":
        return centre_standby(args, workers, max(servers, 1))
    if name == "sync-replicas" and servers >= 1:
        return chief_standby(args, workers, servers)
    return False


def tolerated_losses(name: str, args: dict[str, Any], workers: int) -> int:
    """How many workers other than rank 0 the job can lose and still finish its steps.

    Rank 0 hosts the wrappers' servers and writes the results, so its loss is always fatal.
    Sync-replicas keeps training while a backup is left (N - R of them; with
    ``replicas_to_aggregate=auto`` R follows the live workers, so all but one; with
    ``max_losses=K``, the all-reduce exchange, K); asynchronous EASGD
    workers never wait for each other; every other strategy runs collectives in lockstep,
    where one missing member stops all.
    """
    if workers < 2:
        return 0
    if name == "sync-replicas":
        if "max_losses" in args:  # without a server: what it allows (0: a loss ends it)
            return int(args["max_losses"])
        total = int(args.get("total_num_replicas", workers))
        if args.get("replicas_to_aggregate") == "auto":  # R follows the live workers
            return total - 1
        return max(total - int(args.get("replicas_to_aggregate", workers - 1)), 0)
    if name == "easgd" and args.get("mode", "sync") == "async":
        return workers - 1
    return 0
