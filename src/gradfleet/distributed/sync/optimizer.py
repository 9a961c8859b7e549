"""``SyncReplicasOptimizer``: synchronous SGD with backup workers and stale-gradient dropping.

TF's ``tf.train.SyncReplicasOptimizer`` (reference section 1) on ``torch.distributed``.  Each
worker computes gradients on its copy of the model and calls ``step()`` (or
``apply_gradients``); the server (a thread inside rank ``server_rank``, TF's PS + chief) runs::

    worker:  push (local_step, grads) -> accumulators drop it if local_step < global_step
             dequeue a token (blocks) -> local_step := token; load the current variables
    server:  once R = replicas_to_aggregate fresh gradients are in: average them (dense: by
             the accepted count; sparse rows: by the number of gradients holding the row),
             apply them with the wrapped optimizer, global_step += 1, enqueue max(N, R)
             tokens carrying the new step, update ``variable_averages``

N = ``total_num_replicas`` > R gives N - R backup workers: the first R fresh gradients make the
update, late ones are dropped.  By default (``tokens="distinct"``) every update takes its R
gradients from R different workers, each computed on the current variables: a worker whose
gradient joined the pending update gets its next token once that update is made
(:mod:`.token_line`).  ``tokens="shared"`` is TF's queue: tokens go to whoever asks first, so a
fast worker may contribute several gradients to one update (the default where R > N, or where
``num_tokens`` is given); its initial fill is TF's ``get_init_tokens_op(num_tokens)`` (``-1`` ->
R; fewer than R - N is an error) and leads to TF's "one wasted round" after the first update.
When the live workers can never make the pending update (one left after its last step, one was
reported dead), every waiting worker gets a ``RuntimeError`` naming who left when.

Beyond TF: ``last_gradient_accepted`` and per-worker ``counters`` (accepted / dropped /
nonfinite); ``nonfinite`` policy; ``last_step`` releases every worker at the end; a worker that
waits ``timeout`` seconds gets an error naming the silent ranks, a dead server an error naming
the server rank.

The exchange is chosen once, at construction (:func:`.arguments.choose_transport`).  Where no
server is named (``server_rank``, ``server_ranks``, ``server_address``), every worker sends one
gradient per update (``tokens="distinct"``) and runs in its own process of the group, the
default is ``transport="allreduce"``, which has no server and keeps the state on every rank, so
no host holds it alone: with R == N, all-reduces in buckets overlapped with backward, as DDP's
(:mod:`.allreduce`), the same numbers up to the order of summation; with backup workers (R < N,
or ``"auto"``: every rank choosing each R alike) and CPU parameters on gloo, the first R workers
ready all-reduce and the others receive the update (:mod:`.worker.first_arrivals`), and the job
goes on without up to ``max_losses`` lost workers, by default as many as leave an update
possible (N - R; N - 1 with ``"auto"``).  Otherwise -- a server named, TF's shared token queue,
CUDA parameters with backups, or with backups an option only a server has (``overlap=True``, a
``shard_assignment``) -- ``transport="server"``.

Sharding (TF's variables over several ps tasks): ``server_ranks=[r0, r1, ...]`` gives shard
``k`` to rank ``server_ranks[k]`` (whole parameters, balancing bytes or round-robin); the chief
(``r0``) also keeps ``global_step`` and the tokens; an update is complete -- ``global_step += 1``,
tokens -- once every shard applied it (protocol, per-shard staleness and optimizer state:
:mod:`.shards`).  Checkpoints are per server rank (see the class docstring).

Overlap (``overlap=True``, beyond TF): each shard's push starts from backward's gradient hooks
once its gradients are all in (shard 0's with the token request), as DDP overlaps a bucket's
all-reduce; ``step()`` pushes the rest and waits (:mod:`.overlap`).  Streamed reads
(:meth:`~SyncReplicasOptimizer.stream_reads`, sharded, beyond TF): ``step()`` returns with its
token, and each module's next forward waits for the shards of its own parameters
(:mod:`.streaming`).

TF argument mapping: ``opt``, ``replicas_to_aggregate``, ``total_num_replicas``,
``variable_averages`` (an :class:`ExponentialMovingAverage`), ``variables_to_average``
(parameters of this optimizer), ``use_locking`` (ignored), ``name``; the hook's ``num_tokens``
is a constructor argument; ``is_chief`` is ``rank == server_rank``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..common.moving_average import ExponentialMovingAverage
from ..hosting.closing import close_at_exit, closed
from ..transport.elastic_group import ElasticGroup
from ..wrappers.wrapper import WrapperOptimizer, check_grads_and_vars, check_int
from .arguments import (
    average_indices,
    check_arguments,
    check_overlap,
    check_standby,
    choose_transport,
    default_losses,
    replicas_label,
    replicas_policy,
    resolve_worker,
)
from .common.job import Job
from .common.outcome import Outcome
from .common.replicas_policy import ReplicasPolicy
from .exchange import Exchange
from .layout.assignment import SPLITTING, check_server_ranks
from .layout.shard_layout import choose_layout
from .server.chief import SyncChief
from .server_exchange import ServerExchange, as_addresses
from .worker.allreduce import AllReduceExchange
from .worker.first_arrivals import FirstArrivalsExchange

__all__ = ["SyncReplicasOptimizer", "ExponentialMovingAverage"]

log = logging.getLogger(__name__)

_OWNER = "SyncReplicasOptimizer"


def elastic_group(
    params: list[torch.Tensor],
    N: int,
    rank: int,
    timeout: float,
    store: dist.Store | None,
    joining: bool,
) -> ElasticGroup:
    """The all-reduce's members where losses are allowed (gloo), on the process group's
    store, or for a restarted worker ``store`` / ``MASTER_ADDR``'s."""
    if store is None:
        if joining:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=timedelta(seconds=timeout),
            )  # fmt: skip
        else:
            store = dist.distributed_c10d._get_default_store()
    if any(p.is_cuda for p in params):
        # NCCL does not fail fast when a peer dies (its collectives wait for the watchdog),
        # and that path has not been measured on a GPU yet: refused rather than left to hang
        raise ValueError(
            f"{_OWNER}: max_losses takes CPU parameters only for now (gloo); with CUDA "
            "tensors a lost worker ends the job (max_losses=0)"
        )
    return ElasticGroup(store, rank, N, timeout=timeout, joining=joining)


def _cpu_gloo(opt: torch.optim.Optimizer) -> bool:
    """CPU parameters, on gloo where there is a process group: what the exchange of backups
    without a server runs on."""
    if any(p.is_cuda for g in opt.param_groups for p in g["params"]):
        return False
    return not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "gloo"


class SyncReplicasOptimizer(WrapperOptimizer):
    """Aggregate ``replicas_to_aggregate`` gradients per update, without a server (every rank
    keeping the state) or on servers, as chosen at construction (see module doc).

    Args:
        opt: the wrapped optimizer over this worker's model parameters; the server (every
            shard) applies the averaged gradients with a copy of it (hyperparameters are re-read
            from the hosting rank's ``opt`` before every update, so LR schedules apply).
        replicas_to_aggregate: R, gradients per update (>= 1).
        total_num_replicas: N, worker processes (default R): ranks ``0 .. N-1``; a job of
            more processes has dedicated server ranks ``N ..`` (they call
            :func:`gradfleet.distributed.serve`), each listed in ``server_ranks``.
        variable_averages: an ``ExponentialMovingAverage`` of the server variables, applied
            after every update (read them with :meth:`averaged_variables` on the chief).
        variables_to_average: the parameters of this optimizer that ``variable_averages``
            tracks (default: none).
        num_tokens: initial tokens of TF's shared queue (TF hook's ``num_tokens``; -1 means
            R); giving it selects ``tokens="shared"``.
        tokens: ``"distinct"`` (default for R <= N): one gradient per worker per update;
            ``"shared"``: TF's token queue, first come first served (module docstring).
        transport: ``"server"`` or ``"allreduce"`` (no server: every rank keeps the state;
            with R < N or ``"auto"`` the first R workers ready make each update, CPU
            parameters); default: ``"allreduce"`` wherever it runs the job, else
            ``"server"`` (module docstring).
        timeout: seconds a worker waits for a token / the server before failing.
        last_step: once ``global_step`` reaches it, every worker is released at once.
        nonfinite: ``"raise"`` (the worker gets ``FloatingPointError``, nothing accumulated),
            ``"drop"`` (treated like a stale gradient) or ``"apply"`` (TF: NaN flows in).
        server_rank: the rank that hosts the server (default 0 where there is one; naming
            it asks for a server).
        host: the interface the server listens on.  Default: loopback while every rank is on
            this host, else this host's address on the route to ``MASTER_ADDR``
            (``GRADFLEET_SERVER_HOST`` overrides it); ranks on several hosts without such an
            address raise ``ValueError`` naming ``host=`` on every rank.
        server_ranks: shard the variables over these ranks (default ``[server_rank]``: one
            server); the first rank is the chief (``global_step``, tokens).  A rank may appear
            twice (two shards).  Ranks ``>= total_num_replicas`` are dedicated servers
            (docs/servers.md).  A dead shard rank makes every worker raise
            ``ServerUnreachable`` naming it.
        shard_assignment: default: laid out for the job -- given ``model`` and several server
            ranks each named once, ``"backward_order"`` with up to 4 shards per rank (not
            where the cut would be refused: then, and without ``model``, ``"bytes"``;
            :func:`.layout.choose_layout`).  ``"bytes"``: whole parameters, largest first to the
            lightest shard), ``"round_robin"`` (TF: parameter ``i`` to shard ``i % S``) or
            ``"split"`` (parameters above ``P / (2 S)`` bytes cut into contiguous row blocks,
            then the pieces balanced by bytes, so every shard carries about ``P / S``;
            results are bit-identical to ``"bytes"``.  Needs an optimizer known to update
            elementwise -- gradfleet's but ``NormalizedSGD``, torch.optim's Adam, AdamW,
            SGD, RMSprop, Adagrad, Adadelta, Adamax, ... -- else ``ValueError``; no
            ``variable_averages``, no sparse gradients on a cut parameter: :mod:`.pieces`),
            or ``"backward_order"``: the same pieces, cut into runs in the order backward
            completes them, so that with ``overlap=True`` the shards are pushed one run
            after another during backward; list every server rank several times
            (``[4, 5, 6, 7] * 2``) so the runs that complete together sit on every rank
            (:func:`.pieces.in_backward_order`).
        overlap: send gradients from backward's gradient hooks while backward goes on.
            Default None: on for the all-reduce exchange, where it never changes the numbers
            (a gradient changed after it left is sent again, :mod:`.allreduce`); off with
            servers.  With servers it pushes each shard's gradients as soon as the shard's
            are all in (DDP's overlap, per shard; see :mod:`.overlap`); what is pushed is
            ``.grad`` as backward left it, so clipping, ``GradScaler`` unscaling or any
            other change between ``backward()`` and ``step()`` is not seen, and one backward
            per step only (a second raises).  Leave ``.grad`` untouched until ``step()``
            returns.  Sharded, it needs ``nonfinite="apply"`` (a shard pushed during
            backward cannot be withdrawn when a later shard's gradient turns out
            non-finite).
        global_step: the step the job starts from (TF: the ``global_step`` a restarted chief
            restored, e.g. ``load_tf_checkpoint(...).global_step`` of the model and optimizer
            loaded before wrapping): the chief's ``global_step``, its initial tokens and every
            shard's accumulators start there, and the workers' ``local_step`` with them (TF's
            ``chief_init_op``, ``get_init_tokens_op``, ``local_step_init_op``).  Not with
            dedicated server ranks.
        server_address: for a process outside the process group (a restarted worker): the
            server's ``"host:port"`` (``server_address`` property of a running optimizer;
            sharded: the list ``server_addresses``).
        worker: that process's worker id (with ``server_address``).
        model: the model whose parameters ``opt`` holds: with several shards, each module's
            next forward waits for its own shards' values (:meth:`stream_reads`); nothing
            to stream otherwise.
        max_losses: workers the exchange without a server (``transport="allreduce"``) may
            lose and go on without.  Default: with backups (R < N, or ``"auto"``) as many as
            leave an update possible (N - R; N - 1 with ``"auto"``, whose R follows the live
            workers), so that no host is one the job cannot lose; with R == N 0 (a lost
            worker ends the job, as DDP).  ``max_losses=0`` turns it off.  With K > 0 the
            survivors of a loss form a new group within about a second, heal from the member
            holding the newest step, and go on (R == N: as N - 1, the dense mean over the
            members left); a restarted worker (``worker=`` its rank, outside the process
            group) takes its state from a live member and the job is back at N.  More than K
            gone at once ends the job naming them.  CPU parameters (gloo; CUDA ones are
            refused until NCCL's loss is measured): :mod:`.worker.allreduce`,
            :mod:`.worker.first_arrivals`.
        store: for a restarted worker of a job without a server: the job's store (default:
            a client of ``MASTER_ADDR:MASTER_PORT``).  ``worker=`` with ``store=`` or
            ``max_losses=`` (and no ``server_address``) is such a worker; ``worker=`` alone,
            outside a process group, is one that hosts a server.  The others use their
            process group's store.
        hear_every_worker: with backups and no server (``transport="allreduce"``, R < N):
            a worker whose gradients went into many more of the recent updates than another
            worker's, about as fast as itself, waits briefly for that one to count in
            first, so that no worker's data stays unheard because it once came late
            (:mod:`.worker.deference`, docs/distributed.md).  ``False``: the first R to
            count in always make the update, the fastest choice.
        standby: a live copy of the chief on another worker rank, which takes over when
            the chief's host is lost: every request that changes the chief is handled there
            too before it is answered (a step's copy carries the chief's verdict on its
            gradients and each update's averages, not the gradients), and a worker whose
            chief is lost moves to the copy and sends its step again, applied once
            (:mod:`...hosting.standby`); several shards: one per server (``True``).
            ``True``: on the first worker rank after the chief's on another host; a rank:
            there; ``False``: none.  Default: on with one server where the job already
            does without a host (backups: R < N or a chosen R; or a server on a rank that
            only serves); else off.  A replicated chief holds its variables in one shard (the
            layout for the job does not cut them into runs on its rank).  With
            ``server_address`` (a restarted process), ``True``
            makes it the standby of a chief that has none (its own took over), from the
            chief's live state.  The costs: docs/failures.md.

    ``state_dict`` is per rank: the chief's holds ``global_step``, the tokens and shard 0,
    another server rank's the shards it hosts (``"shards"``), a plain worker's only its own
    steps and counters.  ``worker_counters(shard)`` reads one shard's accumulator counts.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        replicas_to_aggregate: int | str | ReplicasPolicy,
        total_num_replicas: int | None = None,
        variable_averages: ExponentialMovingAverage | None = None,
        variables_to_average: Iterable[torch.Tensor] | None = None,
        use_locking: bool = False,
        name: str = "sync_replicas",
        *,
        num_tokens: int = -1,
        tokens: str | None = None,
        transport: str | None = None,
        timeout: float = 60.0,
        last_step: int | None = None,
        nonfinite: str = "raise",
        server_rank: int | None = None,
        host: str | None = None,
        server_address: str | Sequence[str] | None = None,
        worker: int | None = None,
        server_ranks: Sequence[int] | None = None,
        shard_assignment: str | None = None,
        overlap: bool | None = None,
        global_step: int = 0,
        model: torch.nn.Module | None = None,
        max_losses: int | None = None,
        store: dist.Store | None = None,
        hear_every_worker: bool = True,
        standby: int | bool | None = None,
    ) -> None:
        R, N, initial, rule = check_arguments(
            replicas_to_aggregate, total_num_replicas, num_tokens, transport, nonfinite,
            timeout, last_step, tokens,
        )  # fmt: skip
        policy = replicas_policy(replicas_to_aggregate)
        named = server_rank is not None or server_ranks is not None or server_address is not None
        given = None if max_losses is None else check_int(_OWNER, "max_losses", max_losses, 0)
        backups = R < N or policy is not None  # members known only at step()
        # a restarted worker of a job without a server names itself (and, where its losses
        # are allowed by default, the job's store): it is outside the group.  Without them, a
        # worker named outside a process group is one hosting a server
        rejoining = (
            worker is not None
            and server_address is None
            and bool(given or (given is None and backups and store is not None))
        )
        transport = choose_transport(
            transport, R, N, rule, named, policy is not None, rejoining,
            cpu_gloo=_cpu_gloo(opt),
            server_only=backups and (overlap is True or shard_assignment is not None),
        )  # fmt: skip
        rejoining = rejoining and transport == "allreduce"
        max_losses = default_losses(given, transport, backups, R, N, policy is not None)
        if max_losses and (transport != "allreduce" or max_losses >= N):
            raise ValueError(
                f"{_OWNER}: max_losses={max_losses} needs transport='allreduce' (no server: "
                "every rank keeps the state; tokens='distinct') and fewer losses than "
                f"the N={N} workers; with a server, backup workers (replicas_to_aggregate < "
                "total_num_replicas) tolerate the loss of a worker"
            )
        if not isinstance(hear_every_worker, bool):
            raise TypeError(
                f"{_OWNER}: hear_every_worker must be True or False, got {hear_every_worker!r}"
            )
        if not hear_every_worker and not (transport == "allreduce" and (R < N or policy)):
            raise ValueError(
                f"{_OWNER}: hear_every_worker=False applies to backup workers without a server "
                f"(transport='allreduce', replicas_to_aggregate < total_num_replicas); got "
                f"transport={transport!r}, replicas_to_aggregate={R} of {N}"
            )
        server_rank = 0 if server_rank is None else server_rank
        super().__init__(opt, name)
        # the books: this worker's steps and verdicts
        # an int, or "auto" / a policy object: each update's R is chosen (replicas_history())
        self.replicas_to_aggregate: int | str | ReplicasPolicy = (
            R if policy is None else replicas_to_aggregate
        )
        self.total_num_replicas = N
        self.timeout, self.transport, self.tokens = float(timeout), transport, rule
        start = check_int(_OWNER, "global_step", global_step, 0)
        self.local_step = self.global_step = start
        self.last_gradient_accepted: bool | None = None
        self.counters = {"accepted": 0, "dropped": 0}
        self._index = {id(p): i for i, p in enumerate(self.params())}
        averaged = average_indices(self._index, variables_to_average)
        self.worker = resolve_worker(worker, server_address, N)
        inside = (
            server_address is None
            and not rejoining
            and dist.is_available()
            and dist.is_initialized()
        )
        grouped = inside and dist.get_world_size() > 1
        named = [server_rank] if server_ranks is None else list(server_ranks)
        # before the layout: a replicated chief keeps one shard
        standby = check_standby(
            standby, transport, named, R, N, policy is not None, server_address is not None,
            grouped,
        )  # fmt: skip
        if shard_assignment is None and transport == "server":  # laid out for the job
            shard_assignment, server_ranks = (
                # one running server's address: whole, as it serves; a replicated chief
                # keeps its variables whole (one shard, not cut into runs on its rank)
                ("bytes", named)
                if isinstance(server_address, str) or standby
                else choose_layout(self.optimizer, named, model, variable_averages)
            )
        # split: a shard per piece at most, and pieces may outnumber the parameters
        units = len(self._index)
        if shard_assignment in SPLITTING:
            units = sum(p.numel() for p in self.params())
        ranks = check_server_ranks(
            [server_rank] if server_ranks is None else server_ranks,
            N, units, transport, server_address,
            dist.get_world_size() if inside else None,
        )  # fmt: skip
        self.server_ranks, self.server_rank = ranks, ranks[0]
        self.overlap = check_overlap(overlap, transport, len(ranks), nonfinite, backups)
        # the job, described once, and the exchange, chosen once: complete in itself
        job = Job(
            R=R, N=N, tokens=rule, initial_tokens=initial, timeout=float(timeout),
            nonfinite=nonfinite, last_step=last_step, ema=variable_averages,
            averaged=tuple(averaged), global_step=start, policy=policy, max_losses=max_losses,
            hear_every_worker=hear_every_worker, standby=standby,
        )  # fmt: skip
        self.exchange: Exchange
        if transport == "allreduce":
            if backups:  # refused before any group is made
                FirstArrivalsExchange.check(job, self.optimizer)
            group = (
                elastic_group(list(self.params()), N, self.worker, timeout, store, rejoining)
                if max_losses
                else None
            )
            self.exchange = (
                FirstArrivalsExchange(self.optimizer, job, store, group)
                if R < N or policy is not None
                else AllReduceExchange(self.optimizer, job, self.overlap, group)
            )
        else:
            servers = ServerExchange(
                self.optimizer, job, worker=self.worker, ranks=ranks,
                shard_assignment=shard_assignment, overlap=self.overlap, host=host,
                given=as_addresses(server_address), settle=self._settle,
            )  # fmt: skip
            self.exchange = servers
            if model is not None and servers.reads_ahead:
                self.stream_reads(model)
        self.local_step = self.global_step = self.exchange.start_step
        self.server_addresses = self.exchange.server_addresses
        self.server_address = self.exchange.server_address
        self.is_chief = self.exchange.is_chief
        self.dedicated = self.exchange.dedicated
        close_at_exit(self)  # a program that never calls close() still leaves cleanly

    @property
    def live_workers(self) -> list[int]:
        """The workers the next update takes: with ``max_losses``, the all-reduce's members
        now (a lost one gone, a rejoined one back); otherwise all N."""
        group = getattr(self.exchange, "group", None)
        return list(group.members) if group is not None else list(range(self.total_num_replicas))

    @property
    def chief_rank(self) -> int | None:
        """The rank whose chief this worker uses now: ``server_rank``, or its standby's once
        the chief was lost (None without a server)."""
        clients = getattr(self.exchange, "clients", None)
        return None if clients is None else int(clients.ranks[0])

    @property
    def chief_moved_from(self) -> int | None:
        """The lost chief's rank, once this worker moved to its standby (else None)."""
        clients = getattr(self.exchange, "clients", None)
        return None if clients is None else clients.moved_from

    @property
    def standby_chief(self) -> SyncChief | None:
        """The copy of the chief this rank hosts as its standby (promoted once the chief was
        lost), or None."""
        servers = getattr(self.exchange, "servers", None)
        return None if servers is None else servers.standby_chief

    @property
    def membership_changes(self) -> list[dict[str, Any]]:
        """With ``max_losses``: each loss and join this rank saw, in order (``event``,
        ``ranks``, ``members`` after it, ``global_step``, ``seconds`` it took)."""
        return list(getattr(self.exchange, "losses", []))

    # ----------------------------------------------------------------- the step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Push every parameter's ``.grad`` (None stays None), wait for a token, load the
        current variables.  Returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync([p.grad for p in self.params()])
        return loss

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[Any, torch.Tensor]], global_step: Any = None
    ) -> None:
        """TF's worker train op: push, dequeue a token, ``local_step := token``; then
        ``global_step`` (a 0-dim int tensor, required as in TF) holds the server's step."""
        pairs = check_grads_and_vars(_OWNER, grads_and_vars)
        self.exchange.check_own_gradients()
        if global_step is None:
            raise ValueError(f"{_OWNER}: Global step is required to check staleness")
        grads: list[torch.Tensor | None] = [None] * len(self._index)
        for g, v in pairs:
            if id(v) not in self._index:
                raise ValueError(
                    f"{_OWNER}.apply_gradients: a variable of shape "
                    f"{tuple(v.shape)} is not managed by the wrapped optimizer"
                )
            grads[self._index[id(v)]] = g
        self._sync(grads, stream=False)  # TF's train op ends with the variables read
        with torch.no_grad():
            global_step.fill_(self.global_step)

    def _sync(self, grads: list[torch.Tensor | None], stream: bool = True) -> None:
        """One step through the exchange (which first waits for the last step's reads)."""
        outcome: Outcome = self.exchange.step(
            self.local_step, [None if g is None else g.detach() for g in grads], stream
        )
        self.local_step = outcome.local_step
        if outcome.accepted is None:  # streamed reads: decided once every shard's values are in
            self.global_step = max(self.global_step, outcome.global_step)
            return
        self.global_step = outcome.global_step
        self._record(outcome.accepted)

    def _settle(self, accepted: bool, global_step: int) -> None:
        """A streamed step's verdict, once every shard's values are in."""
        self._record(accepted)
        self.global_step = max(self.global_step, global_step)

    def _record(self, accepted: bool) -> None:
        self.last_gradient_accepted = accepted
        self.counters["accepted" if accepted else "dropped"] += 1

    # ----------------------------------------------------------------- streamed reads
    def stream_reads(self, model: torch.nn.Module) -> None:
        """From now on ``step()`` returns once the token is in; each module of ``model`` waits
        in its forward for the shards holding its own parameters (:mod:`.streaming`).

        Needs several shards (``server_ranks``; one server rank may host several, e.g.
        ``[0, 0, 0, 0]``): a single shard's values come as one answer.  Call again with
        another model to move the hooks; :meth:`close` removes them."""
        self.exchange.stream_reads(model)

    @property
    def streaming(self) -> bool:
        """Does ``step()`` leave the reads to the next forward (:meth:`stream_reads`)?"""
        return self.exchange.streaming

    @property
    def reads_pending(self) -> bool:
        """Are values of the last step still coming in (streamed reads)?"""
        return self.exchange.reads_pending

    def wait_reads(self) -> None:
        """Until every value of the last step is loaded, and its verdict recorded
        (``last_gradient_accepted``, ``counters``, ``global_step``).  Nothing to do without
        streamed reads."""
        self.exchange.wait_reads()

    # ----------------------------------------------------------------- questions
    def worker_counters(self, shard: int = 0) -> dict[int, dict[str, int]]:
        """Per-worker accepted / dropped / nonfinite counts as the server (``shard``'s
        accumulators when sharded) saw them."""
        return self.exchange.worker_counters(shard)

    def replicas_history(self) -> list[int]:
        """The R of every update made so far, in order (from the chief; with a fixed
        ``replicas_to_aggregate`` every entry is it).  ``"auto"``: what the policy chose."""
        return self.exchange.replicas_history()

    def averaged_variables(self) -> list[torch.Tensor | None]:
        """Moving averages of the variables, in parameter order (None if not averaged);
        sharded: gathered from every shard."""
        return self.exchange.averaged_variables()

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this worker sent to the servers (all-reduce: bytes reduced)."""
        return self.exchange.bytes_sent

    @property
    def withheld_pushes(self) -> int:
        """Pushes this worker sent without their gradients because it had seen their shard
        past their step already (TF's accumulators drop such stale gradients; the shard
        counts each as dropped): the bytes a backup worker or a surplus token saves."""
        return self.exchange.withheld_pushes

    def worker_silence(self) -> dict[int, float]:
        """Seconds since the chief last heard from each worker that has not left (a worker
        that never said hello: since the chief started).  Job control can declare a worker
        lost (:meth:`forget_workers`) once its silence is far above a step's time."""
        return self.exchange.worker_silence()

    def forget_workers(self, ranks: Iterable[int]) -> None:
        """Count the workers ``ranks`` as having left (they died and will not come back), on
        every server: a server rank's :meth:`close` then stops waiting for them at once
        instead of after ``timeout`` seconds of their silence.  Any rank may call it; a
        forgotten worker that does come back (``hello``) is counted again.  Without a server
        (``transport="allreduce"``) there is nobody to tell: the ranks are only checked."""
        ranks = [int(r) for r in ranks]
        bad = [r for r in ranks if not 0 <= r < self.total_num_replicas]
        if bad:
            raise ValueError(
                f"{_OWNER}.forget_workers: ranks must be in [0, {self.total_num_replicas}), "
                f"got {bad}"
            )
        self.exchange.forget_workers(ranks)

    # ----------------------------------------------------------------- checkpoints
    def _wrapper_state(self) -> dict[str, Any]:
        """Per rank: this worker's books, and the exchange's part (the chief's state, the
        shards this rank hosts, or the all-reduce replica's)."""
        self.wait_reads()  # streamed reads: the counters and steps are final once all are in
        return {
            "local_step": self.local_step,
            "global_step": self.global_step,
            "counters": dict(self.counters),
            "replicas_to_aggregate": replicas_label(self.replicas_to_aggregate),
            "total_num_replicas": self.total_num_replicas,
            "tokens": self.tokens,
            "server": None,
            "allreduce": None,
            **self.exchange.state(),
        }

    def _check_wrapper_state(self, counters: dict[str, Any]) -> None:
        super()._check_wrapper_state(counters)
        mine = {
            "replicas_to_aggregate": replicas_label(self.replicas_to_aggregate),
            "total_num_replicas": self.total_num_replicas,
        }
        for key in ("replicas_to_aggregate", "total_num_replicas"):
            if counters[key] != mine[key]:
                raise ValueError(
                    f"{_OWNER}.load_state_dict: checkpoint has {key}="
                    f"{counters[key]}, this optimizer {mine[key]}"
                )
        # the token rule changes which gradients make an update: no silent switch (a
        # checkpoint from before the rule was recorded has none to compare)
        if counters.get("tokens", self.tokens) != self.tokens:
            raise ValueError(
                f"{_OWNER}.load_state_dict: checkpoint has tokens={counters['tokens']!r}, this "
                f"optimizer tokens={self.tokens!r} (pass tokens={counters['tokens']!r} to resume "
                "it as it ran)"
            )
        self.exchange.check_state(counters)

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        self.wait_reads()
        self.exchange.load_state(state)
        self.local_step, self.global_step = int(state["local_step"]), int(state["global_step"])
        self.counters = dict(state["counters"])

    def applied_state(self) -> tuple[Any, dict[int, Any], int] | None:
        """What the updates are applied with on this rank: ``(optimizer, {parameter index:
        variable}, global_step)`` -- the chief's optimizer copy and variables with one server,
        this rank's own optimizer with ``transport="allreduce"`` (its parameters are the
        variables: an empty map); None on a rank that holds no such state (a plain worker,
        or any rank of a sharded job, whose variables are spread over the shards)."""
        return self.exchange.applied_state()

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Leave: tell every server; a server rank keeps serving until every worker (also one
        that has not said hello yet) left or has been silent for ``timeout`` seconds, then
        stops its servers (shards, then chief).  Called at the interpreter's exit if the
        program did not (:mod:`..closing`)."""
        closed(self)
        self.exchange.close()

    def __enter__(self) -> SyncReplicasOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
