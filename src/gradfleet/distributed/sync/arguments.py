"""Checks of ``SyncReplicasOptimizer``'s arguments: one clear error naming the argument and
what is allowed, before anything is built."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..wrappers.wrapper import check_int
from .common.finite import NONFINITE_POLICIES
from .common.replicas_policy import AutoReplicas, ReplicasPolicy
from .common.tokens import init_tokens
from .server.token_line import TOKEN_RULES

__all__ = [
    "average_indices",
    "check_arguments",
    "check_overlap",
    "check_standby",
    "choose_transport",
    "default_losses",
    "replicas_label",
    "replicas_policy",
    "resolve_worker",
]

_OWNER = "SyncReplicasOptimizer"


def default_tokens(tokens: Any, R: int, N: int, num_tokens: Any = -1) -> Any:
    """The token rule: ``tokens`` when given, else ``"distinct"`` unless an update needs
    several gradients of one worker (R > N) or ``num_tokens`` sets TF's initial tokens (both
    are the shared queue's)."""
    if tokens is not None:
        return tokens
    return "shared" if R > N or num_tokens != -1 else "distinct"


def check_arguments(
    replicas_to_aggregate: Any,
    total_num_replicas: Any,
    num_tokens: Any,
    transport: Any,
    nonfinite: Any,
    timeout: Any,
    last_step: Any,
    tokens: Any = None,
) -> tuple[int, int, int, str]:
    """``(R, N, initial tokens, token rule)`` after checking every scalar argument.

    ``tokens`` None: ``"distinct"`` unless an update needs several gradients of one worker
    (R > N) or ``num_tokens`` sets TF's initial tokens: both are the shared queue's.  A chosen
    R (:func:`replicas_policy`) starts at N."""
    if replicas_policy(replicas_to_aggregate) is not None:
        if total_num_replicas is None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            total_num_replicas = world
        replicas_to_aggregate = total_num_replicas
    R = check_int(_OWNER, "replicas_to_aggregate", replicas_to_aggregate, 1)
    N = R if total_num_replicas is None else total_num_replicas
    N = check_int(_OWNER, "total_num_replicas", N, 1)
    initial = init_tokens(num_tokens, R, N)
    tokens = default_tokens(tokens, R, N, num_tokens)
    if tokens not in TOKEN_RULES:
        raise ValueError(f"{_OWNER}: tokens must be one of {TOKEN_RULES}, got {tokens!r}")
    if tokens == "distinct" and R > N:
        raise ValueError(
            f"{_OWNER}: tokens='distinct' takes one gradient per worker per update, so it needs "
            f"replicas_to_aggregate <= total_num_replicas, got {R} > {N} (tokens='shared' lets "
            "a worker give several)"
        )
    if tokens == "distinct" and num_tokens != -1:
        raise ValueError(
            f"{_OWNER}: num_tokens={num_tokens} sets TF's shared token queue; with "
            "tokens='distinct' every worker gets its next step after the update it joined "
            "(leave num_tokens out, or pass tokens='shared')"
        )
    if transport not in (None, "server", "allreduce"):
        raise ValueError(f"{_OWNER}: transport must be 'server' or 'allreduce', got {transport!r}")
    if transport == "allreduce" and R > N:
        raise ValueError(
            f"{_OWNER}: transport='allreduce' needs replicas_to_aggregate <= "
            f"total_num_replicas, got {R} > {N} (several gradients of one worker per update "
            "need TF's shared token queue on a server: transport='server')"
        )
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"{_OWNER}: nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}"
        )
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"{_OWNER}: timeout must be a positive number of seconds, got {timeout!r}")
    if last_step is not None:
        check_int(_OWNER, "last_step", last_step, 0)
    return R, N, initial, tokens


def replicas_policy(replicas_to_aggregate: Any) -> ReplicasPolicy | None:
    """The policy that chooses each update's R: ``"auto"`` is :class:`AutoReplicas`, an
    object with ``choose``/``state_dict``/``load_state_dict`` is its own; None for an int."""
    if isinstance(replicas_to_aggregate, str):
        if replicas_to_aggregate != "auto":
            raise ValueError(
                f"{_OWNER}: replicas_to_aggregate must be a positive int, 'auto' or a replicas "
                f"policy, got {replicas_to_aggregate!r}"
            )
        return AutoReplicas()
    if isinstance(replicas_to_aggregate, ReplicasPolicy):
        return replicas_to_aggregate
    return None


def replicas_label(replicas_to_aggregate: Any) -> int | str:
    """What a checkpoint records of ``replicas_to_aggregate``: the int, ``"auto"``, or the
    policy's class (checked on load: a fixed-R run does not resume as a chosen-R one)."""
    if isinstance(replicas_to_aggregate, (int, str)):
        return replicas_to_aggregate
    kind = type(replicas_to_aggregate)
    return f"policy {kind.__module__}.{kind.__qualname__}"


def choose_transport(
    transport: str | None,
    replicas_to_aggregate: int,
    total_num_replicas: int,
    tokens: str,
    servers_named: bool,
    chosen: bool = False,
    rejoining: bool = False,
    cpu_gloo: bool = True,
    server_only: bool = False,
    world: int | None = None,
) -> str:
    """The exchange when ``transport`` is not given: without a server (every rank keeps the
    state, so no host holds it alone) wherever that exchange runs the job -- one gradient per
    worker per update (``tokens="distinct"``, R <= N), no server named and no option only a
    server has (``server_only``: overlap or a shard assignment asked for with backups), one
    process per worker (or a worker ``rejoining`` such a job outside its process group), and
    for backups (R < N, or R ``chosen`` per update) CPU parameters on gloo (``cpu_gloo``) --
    else the server.  ``world``: the processes of the job (None: the process group's; a
    launcher deciding before any group exists passes its own)."""
    if transport is not None:
        return transport
    if world is None:
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
    world = total_num_replicas if rejoining else world
    one_each = replicas_to_aggregate <= total_num_replicas == world and tokens == "distinct"
    if not one_each or servers_named or server_only:
        return "server"
    backups = replicas_to_aggregate < total_num_replicas or chosen
    return "allreduce" if cpu_gloo or not backups else "server"


def default_losses(max_losses: int | None, transport: str, backups: bool, R: int, N: int,
                   chosen: bool) -> int:  # fmt: skip
    """``max_losses`` when not given: where the job already does without a worker -- backups
    (R < N, or R chosen per update) on the exchange without a server, where every rank keeps
    the state -- as many losses as leave an update possible (N - R; N - 1 where R follows the
    live workers), so that no host is one the job cannot lose; else 0 (a loss ends the job)."""
    if max_losses is not None:
        return max_losses
    if transport != "allreduce" or not backups:
        return 0
    return N - 1 if chosen else N - R


def check_standby(
    standby: Any,
    transport: str,
    ranks: list[int],
    R: int,
    N: int,
    chosen: bool,
    joining: bool,
    grouped: bool,
) -> int | bool:
    """``standby`` checked (ValueError naming it): a live copy of each server (the chief,
    and every other shard) on another rank, which takes over when the server's host is lost
    (:mod:`..hosting.standby`).  ``True``: chosen for the job (one server: on the first
    worker rank after the chief's on another host; several: spread over the worker ranks,
    each on another host than its server's); a rank: there (one server only); ``False``:
    none.  None: on wherever the job has one server and already does without a host -- backup
    workers (R < N, or an R chosen per update), or a server on a rank that only serves; else
    off: several shards (their pushes then take TF's protocol, not read-ahead, so they are
    replicated only when asked for; under a chosen R each shard's copy follows the R its
    pushes and the chief's resizes carry, as its server does).  A process that joins by
    address (``joining``) with ``True`` becomes the standby of a chief that has none (its own
    took over).  The others place it with the process group's collectives (``grouped``: there
    is one)."""
    one = len(ranks) == 1
    dedicated = one and ranks[0] >= N  # (no ranks: check_server_ranks names the error)
    if standby is None:
        usable = transport == "server" and one and not joining and grouped
        return usable and (R < N or chosen or dedicated) and (N >= 2 or dedicated)
    if not isinstance(standby, (bool, int)):
        raise ValueError(
            f"{_OWNER}: standby must be True (chosen), False (none) or a worker rank, got "
            f"{standby!r}"
        )
    if not isinstance(standby, bool) and (not 0 <= standby < N or standby in ranks[:1]):
        raise ValueError(
            f"{_OWNER}: standby must be a worker rank in [0, {N}) other than the chief's "
            f"(server_ranks={ranks}), True (chosen) or False (none), got {standby}"
        )
    if standby is False:
        return False
    if transport != "server":
        raise ValueError(
            f"{_OWNER}: standby={standby!r} keeps a copy of a server, and "
            f"transport={transport!r} has none: every rank keeps the state already "
            "(max_losses= lets it go on without a lost one)"
        )
    if not one and standby is not True:
        raise ValueError(
            f"{_OWNER}: standby={standby!r} names one rank, and server_ranks={ranks} shards "
            "the variables over several servers: pass standby=True (a standby per shard, "
            "placed for the job)"
        )
    if not grouped and not joining:
        raise ValueError(
            f"{_OWNER}: standby={standby!r} is placed and started with the process group's "
            "collectives: initialise torch.distributed first"
        )
    if standby is True and N < 2 and not dedicated:
        raise ValueError(
            f"{_OWNER}: standby=True needs a worker rank other than the chief's: "
            f"total_num_replicas={N}"
        )
    return standby


def average_indices(index: dict[int, int], variables: Iterable[torch.Tensor] | None) -> list[int]:
    """Parameter indices of ``variables_to_average`` (``index``: ``id(param) -> index``)."""
    if variables is None:
        return []
    out = []
    for v in variables:
        if id(v) not in index:
            raise ValueError(
                f"{_OWNER}: variables_to_average holds a tensor of shape "
                f"{tuple(v.shape)} that is not a parameter of the optimizer"
            )
        out.append(index[id(v)])
    return out


def resolve_worker(worker: int | None, address: Any, N: int) -> int:
    """This process's worker id: ``worker`` if given, else its rank (checked against N; ranks
    from N on are dedicated servers, checked by ``check_server_ranks``)."""
    if worker is None:
        if not (dist.is_available() and dist.is_initialized()):
            if N == 1:
                return 0
            raise RuntimeError(
                f"{_OWNER}: N={N} workers need torch.distributed (or pass "
                "server_address= and worker= explicitly)"
            )
        worker = dist.get_rank()
        if address is None and dist.get_world_size() < N:
            raise ValueError(
                f"{_OWNER}: total_num_replicas={N} exceeds the world size "
                f"({dist.get_world_size()}): one process per worker replica"
            )
        if address is None and worker >= N:  # the ranks after the workers only serve
            raise ValueError(
                f"{_OWNER}: rank {worker} is not a worker (total_num_replicas={N}: ranks "
                f"0..{N - 1}); a dedicated server rank calls gradfleet.distributed.serve()"
            )
    return check_int(_OWNER, "worker", worker, 0)


def check_overlap(
    overlap: Any, transport: str, num_shards: int, nonfinite: str, backups: bool = False
) -> bool:
    """``overlap`` checked against the other arguments (ValueError naming it); None: on for
    the all-reduce exchange, whose overlap never changes the numbers (:mod:`.allreduce`),
    off for servers, where it does (what is pushed is ``.grad`` as backward left it), and off
    for the all-reduce of the first R of N (``backups``): who sends is known only at
    ``step()``."""
    if overlap is None:
        return transport == "allreduce" and not backups
    if not isinstance(overlap, bool):
        raise ValueError(f"{_OWNER}: overlap must be True, False or None, got {overlap!r}")
    if transport == "allreduce" and backups and overlap:
        raise ValueError(
            f"{_OWNER}: overlap=True needs every worker in every update with "
            "transport='allreduce': with replicas_to_aggregate < total_num_replicas the "
            "update's members are known only when step() is called"
        )
    if transport == "allreduce":
        return overlap
    # Sharded with nonfinite "raise"/"drop", a non-finite gradient anywhere makes the worker
    # tag every shard's push stale, so that no shard applies part of a rejected gradient set.
    # That needs every gradient before the first push; a shard pushed during backward has
    # been accumulated before a later shard's NaN is computed, and cannot be taken back.
    # One shard judges all its gradients itself, and "apply" rejects none: those overlap.
    if overlap and num_shards > 1 and nonfinite != "apply":
        raise ValueError(
            f"{_OWNER}: overlap=True with {num_shards} shards needs nonfinite='apply' (got "
            f"{nonfinite!r}): a shard pushed during backward cannot be withdrawn when a later "
            "shard's gradient turns out non-finite, so the all-or-nothing rejection of "
            "nonfinite='raise'/'drop' needs overlap=False"
        )
    return overlap
