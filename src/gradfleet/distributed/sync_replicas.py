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
update, late ones are dropped.  N < R: workers push several batches per update.  Tokens are
shared, so a fast worker may contribute several gradients to one update.  The initial token fill
is TF's ``get_init_tokens_op(num_tokens)`` (``-1`` -> R; fewer than R - N is an error) and leads
to TF's "one wasted round" right after the first update.

Beyond TF: ``last_gradient_accepted`` and per-worker ``counters`` (accepted / dropped /
nonfinite); ``nonfinite`` policy; ``last_step`` releases every worker at the end; a worker that
waits ``timeout`` seconds gets an error naming the silent ranks, a dead server an error naming
the server rank.  ``transport="allreduce"`` (R == N only) replaces the server by one all-reduce
per round with the same numerics in lockstep, including the wasted round.

Sharding (TF's variables over several ps tasks): ``server_ranks=[r0, r1, ...]`` gives shard
``k`` to rank ``server_ranks[k]``; whole parameters are assigned balancing bytes
(``shard_assignment="bytes"``) or round-robin ``i % S`` as TF's ``replica_device_setter``
(``"round_robin"``); each shard holds its variables, their accumulators and a copy of
the wrapped optimizer, the chief (``r0``) also ``global_step`` and the tokens.  A worker pushes
each shard's gradients to its shard, takes a token from the chief and reads every shard; an
update is complete -- ``global_step += 1``, tokens -- once every shard applied it.  Protocol,
staleness per shard and the per-shard optimizer state (Adam's powers) are described in
``_shards``.  Checkpoints are saved per server rank: the chief's ``state_dict`` holds shard 0,
``global_step`` and the tokens, every other server rank's holds the shards it hosts; each rank
loads its own (before any worker steps again).

TF argument mapping: ``opt``, ``replicas_to_aggregate``, ``total_num_replicas``,
``variable_averages`` (an :class:`ExponentialMovingAverage`), ``variables_to_average``
(parameters of this optimizer), ``use_locking`` (ignored), ``name``; the hook's ``num_tokens``
is a constructor argument; ``is_chief`` is ``rank == server_rank``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._aggregator import NONFINITE_POLICIES, all_finite, init_tokens
from ._allreduce_sync import AllReduceSync
from ._server import ExponentialMovingAverage, SyncServer
from ._shards import Shard, ShardLinks, ShardServer, assign, check_server_ranks, probe
from ._wrapper import GradsAndVars, WrapperOptimizer, check_grads_and_vars, check_int
from .transport import MailboxClient, MailboxServer, copy_received

__all__ = ["SyncReplicasOptimizer", "ExponentialMovingAverage"]

_OWNER = "SyncReplicasOptimizer"


class SyncReplicasOptimizer(WrapperOptimizer):
    """Aggregate ``replicas_to_aggregate`` gradients per update on a server (see module doc).

    Args:
        opt: the wrapped optimizer over this worker's model parameters; the server (every
            shard) applies the averaged gradients with a copy of it (hyperparameters are re-read
            from the hosting rank's ``opt`` before every update, so LR schedules apply).
        replicas_to_aggregate: R, gradients per update (>= 1).
        total_num_replicas: N, worker processes (default R); must equal the world size.
        variable_averages: an ``ExponentialMovingAverage`` of the server variables, applied
            after every update (read them with :meth:`averaged_variables` on the chief).
        variables_to_average: the parameters of this optimizer that ``variable_averages``
            tracks (default: none).
        num_tokens: initial tokens (TF hook's ``num_tokens``; -1 means R).
        transport: ``"server"`` (default) or ``"allreduce"`` (R == N, lockstep, no server).
        timeout: seconds a worker waits for a token / the server before failing.
        last_step: once ``global_step`` reaches it, every worker is released at once.
        nonfinite: ``"raise"`` (the worker gets ``FloatingPointError``, nothing accumulated),
            ``"drop"`` (treated like a stale gradient) or ``"apply"`` (TF: NaN flows in).
        server_rank: the rank that hosts the server.
        host: the interface the server listens on (loopback by default).
        server_ranks: shard the variables over these ranks (default ``[server_rank]``: one
            server); the first rank is the chief (``global_step``, tokens).  A rank may appear
            twice (two shards).  A dead shard rank makes every worker raise
            ``ServerUnreachable`` naming it.
        shard_assignment: ``"bytes"`` (default: whole parameters, largest first to the
            lightest shard) or ``"round_robin"`` (TF: parameter ``i`` to shard ``i % S``).
        server_address: for a process outside the process group (a restarted worker): the
            server's ``"host:port"`` (``server_address`` property of a running optimizer;
            sharded: the list ``server_addresses``).
        worker: that process's worker id (with ``server_address``).

    ``state_dict`` is per rank: the chief's holds ``global_step``, the tokens and shard 0,
    another server rank's the shards it hosts (``"shards"``), a plain worker's only its own
    steps and counters.  ``worker_counters(shard)`` reads one shard's accumulator counts.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        replicas_to_aggregate: int,
        total_num_replicas: int | None = None,
        variable_averages: ExponentialMovingAverage | None = None,
        variables_to_average: Iterable[torch.Tensor] | None = None,
        use_locking: bool = False,
        name: str = "sync_replicas",
        *,
        num_tokens: int = -1,
        transport: str = "server",
        timeout: float = 60.0,
        last_step: int | None = None,
        nonfinite: str = "raise",
        server_rank: int = 0,
        host: str = "127.0.0.1",
        server_address: str | Sequence[str] | None = None,
        worker: int | None = None,
        server_ranks: Sequence[int] | None = None,
        shard_assignment: str = "bytes",
    ) -> None:
        R = check_int(_OWNER, "replicas_to_aggregate", replicas_to_aggregate, 1)
        N = check_int(
            _OWNER, "total_num_replicas", R if total_num_replicas is None else total_num_replicas, 1
        )
        tokens = init_tokens(num_tokens, R, N)
        if transport not in ("server", "allreduce"):
            raise ValueError(
                f"{_OWNER}: transport must be 'server' or 'allreduce', got {transport!r}"
            )
        if transport == "allreduce" and R != N:
            raise ValueError(
                f"{_OWNER}: transport='allreduce' needs replicas_to_aggregate == "
                f"total_num_replicas, got {R} vs {N}"
            )
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"{_OWNER}: nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}"
            )
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(
                f"{_OWNER}: timeout must be a positive number of seconds, got {timeout!r}"
            )
        if last_step is not None:
            check_int(_OWNER, "last_step", last_step, 0)
        super().__init__(opt, name)
        self.replicas_to_aggregate, self.total_num_replicas = R, N
        self.tokens_per_step = max(N, R)
        self.timeout, self.transport = float(timeout), transport
        self._nonfinite = nonfinite
        self.local_step = self.global_step = 0
        self.last_gradient_accepted: bool | None = None
        self.counters = {"accepted": 0, "dropped": 0}
        self._index = {id(p): i for i, p in enumerate(self.params())}
        averaged = self._average_indices(variables_to_average)
        self._server: SyncServer | None = None
        self._mailbox: MailboxServer | None = None
        self._client: MailboxClient | None = None
        self._allreduce: AllReduceSync | None = None
        self._hosted: dict[int, tuple[ShardServer, MailboxServer]] = {}
        self._links: ShardLinks | None = None
        self.worker = self._resolve_worker(worker, server_address, N)
        ranks = check_server_ranks(
            [server_rank] if server_ranks is None else server_ranks,
            N, len(self._index), transport, server_address,
        )  # fmt: skip
        self.server_ranks, self.server_rank = ranks, ranks[0]
        if transport == "allreduce":
            self._allreduce = AllReduceSync(
                self.optimizer, R, N, tokens, nonfinite, variable_averages, averaged
            )
            return
        self._parts = assign(self.params(), len(ranks), shard_assignment)
        given = [server_address] if isinstance(server_address, str) else server_address
        self._connect(opt, tokens, variable_averages, averaged, nonfinite, last_step, host, given)

    # ----------------------------------------------------------------- set-up helpers
    def _connect(self, opt, tokens, ema, averaged, nonfinite, last_step, host, given) -> None:
        """Start the servers this rank hosts (the chief: shard 0, global_step, tokens; shard k
        on rank ``server_ranks[k]``), exchange their addresses, connect to all of them."""
        ranks, R, N = self.server_ranks, self.replicas_to_aggregate, self.total_num_replicas
        self.is_chief = given is None and self.worker == ranks[0]
        mine: dict[int, str] = {}
        if self.is_chief:
            self._server = SyncServer(
                opt, R, N, tokens, self.timeout, ema, averaged, nonfinite, last_step,
                self._parts[0], len(ranks),
            )  # fmt: skip
            self._mailbox = MailboxServer(self._server.handle, host=host, tick=self._server.tick)
            mine[0] = self._mailbox.address
        for k in range(1, len(ranks)) if given is None else ():
            if ranks[k] == self.worker:
                shard = Shard(opt, self._parts[k], R, nonfinite, ema, averaged, last_step)
                server = ShardServer(k, shard, N, self.timeout)
                self._hosted[k] = (server, MailboxServer(server.handle, host=host))
                mine[k] = self._hosted[k][1].address
        addresses = dict(enumerate(given)) if given is not None else mine
        if len(ranks) == 1:  # one server: its rank broadcasts the address
            if not addresses:
                box = [None]
                dist.broadcast_object_list(box, src=ranks[0])
                addresses = {0: box[0]}
            elif dist.is_initialized() and ranks[0] == dist.get_rank() == self.worker:
                dist.broadcast_object_list([addresses[0]], src=ranks[0])
        elif given is None and dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            addresses = {k: a for part in gathered for k, a in part.items()}
        for server, _ in self._hosted.values():
            server.connect_chief(addresses[0], ranks[0])
        if self._server is not None:
            self._server.probes = {
                f"shard server rank {ranks[k]} (shard {k}) at {addresses[k]}": probe(
                    addresses[k], min(self.timeout, 5.0)
                )
                for k in range(1, len(ranks))
            }
        self._hello(addresses)

    def _hello(self, addresses: dict[int, str]) -> None:
        """Connect to every shard; ``local_step := global_step``; load the variables."""
        self.server_addresses = [addresses[k] for k in range(len(self.server_ranks))]
        self.server_address: str = addresses[0]
        self._client = MailboxClient(
            addresses[0], f"w{self.worker}", self.timeout + 10.0, f"server rank {self.server_rank}"
        )
        params = self.params()
        parts = [[params[i] for i in idx] for idx in self._parts]
        if len(addresses) > 1:
            rest = {k: a for k, a in addresses.items() if k}
            self._links = ShardLinks(rest, self.server_ranks, self.worker, self.timeout)
        hello = self._client.call(
            "hello",
            worker=self.worker,
            shapes=[list(p.shape) for p in parts[0]],
            dtypes=[str(p.dtype) for p in parts[0]],
        )
        self.local_step = self.global_step = int(hello["global_step"])  # local_step_init_op
        self._load_shard(0, hello["params"])
        self._version = int(hello.get("version", self.global_step))
        if self._links is not None:
            for k, values in self._links.hello(parts).items():
                self._load_shard(k, values)

    # ----------------------------------------------------------------- set-up helpers
    def _average_indices(self, variables: Iterable[torch.Tensor] | None) -> list[int]:
        if variables is None:
            return []
        out = []
        for v in variables:
            if id(v) not in self._index:
                raise ValueError(
                    f"{_OWNER}: variables_to_average holds a tensor of shape "
                    f"{tuple(v.shape)} that is not a parameter of the optimizer"
                )
            out.append(self._index[id(v)])
        return out

    @staticmethod
    def _resolve_worker(worker: int | None, address: str | None, N: int) -> int:
        if worker is None:
            if not (dist.is_available() and dist.is_initialized()):
                if N == 1:
                    return 0
                raise RuntimeError(
                    f"{_OWNER}: N={N} workers need torch.distributed (or pass "
                    "server_address= and worker= explicitly)"
                )
            worker = dist.get_rank()
            if address is None and dist.get_world_size() != N:
                raise ValueError(
                    f"{_OWNER}: total_num_replicas={N} must equal the world size "
                    f"({dist.get_world_size()}): one process per worker replica"
                )
        return check_int(_OWNER, "worker", worker, 0)

    def _shard_params(self, k: int) -> list[torch.Tensor]:
        params = self.params()
        return [params[i] for i in self._parts[k]]

    def _load_shard(self, k: int, values: Sequence[torch.Tensor]) -> None:
        """Copy shard ``k``'s new values into the parameters (those the transport received
        in place already are skipped)."""
        with torch.no_grad():
            for p, v in zip(self._shard_params(k), values, strict=True):
                copy_received(p, v)

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
        self._sync(grads)
        with torch.no_grad():
            global_step.fill_(self.global_step)

    def _sync(self, grads: list[torch.Tensor | None]) -> None:
        grads = [None if g is None else g.detach() for g in grads]
        if self._allreduce is not None:
            accepted, self.local_step, self.global_step = self._allreduce.step(
                self.local_step, grads
            )
        else:
            accepted = self._server_step(grads)
        self.last_gradient_accepted = accepted
        self.counters["accepted" if accepted else "dropped"] += 1

    def _server_step(self, grads: list[torch.Tensor | None]) -> bool:
        """Push (shards 1.. first, then shard 0 with the chief), take a token, read."""
        assert self._client is not None, "optimizer is closed"
        parts = [[grads[i] for i in idx] for idx in self._parts]
        tag, accepted = self.local_step, True
        if self._links is None:  # one server: push and wait for the token in one request
            self._client.request(
                "step", worker=self.worker, tag=tag, grads=parts[0], version=self._version
            )
        else:  # every shard (the chief's too) receives at once; then the token
            if self._nonfinite != "apply" and not all(_finite(g) for g in grads):
                tag = -1  # stale everywhere: no shard keeps any part (the bad shard reports it)
            self._links.push(tag, parts)
            if tag < 0:  # bad input: the shard holding it raises before the chief hears of it
                accepted = self._links.pushed()
            self._client.request("push", worker=self.worker, tag=tag, grads=parts[0])
            if tag >= 0:
                accepted = self._links.pushed()
            accepted = bool(self._client.response()["accepted"]) and accepted
            self._client.request("step", worker=self.worker, tag=tag, version=self._version)
        reply = self._client.response(receive_into=self._shard_params(0))
        accepted = bool(reply["accepted"]) and accepted and tag == self.local_step
        self.local_step, self.global_step = int(reply["token"]), int(reply["global_step"])
        if "params" in reply:
            self._load_shard(0, reply["params"])
        self._version = int(reply.get("version", self.global_step))
        if self._links is not None:
            into = {k: self._shard_params(k) for k in self._links.clients}
            for k, values in self._links.read(into).items():
                self._load_shard(k, values)
        return accepted

    # ----------------------------------------------------------------- queries / shutdown
    def worker_counters(self, shard: int = 0) -> dict[int, dict[str, int]]:
        """Per-worker accepted / dropped / nonfinite counts as the server (``shard``'s
        accumulators when sharded) saw them."""
        if self._allreduce is not None:
            return self._allreduce.stats
        assert self._client is not None
        if shard:
            assert self._links is not None, "no such shard"
            stats = self._links.clients[shard].call("stats", worker=self.worker)["stats"]
        else:
            stats = self._client.call("stats", worker=self.worker)["stats"]
        return {int(k): v for k, v in stats.items()}

    def averaged_variables(self) -> list[torch.Tensor | None]:
        """Moving averages of the variables, in parameter order (None if not averaged);
        sharded: gathered from every shard."""
        if self._allreduce is not None or self._links is None:
            ema = self._allreduce.ema if self._allreduce is not None else None
            ema = ema if ema is not None or self._server is None else self._server.ema
            if ema is None:
                raise RuntimeError(f"{_OWNER}: no variable_averages here (read them on the chief)")
            return [ema.shadows.get(i) for i in range(len(self._index))]
        assert self._client is not None
        pairs = list(self._client.call("ema", worker=self.worker)["shadows"])
        for reply in self._links.call_all("ema").values():
            pairs.extend(reply["shadows"])
        found = {int(i): s for i, s in pairs}
        return [found.get(i) for i in range(len(self._index))]

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this worker sent to the servers (all-reduce: bytes reduced)."""
        if self._allreduce is not None:
            return self._allreduce.bytes_sent
        sent = self._client.bytes_out if self._client is not None else 0
        return sent + (self._links.bytes_out if self._links is not None else 0)

    def forget_workers(self, ranks: Iterable[int]) -> None:
        """Count the workers ``ranks`` as having left (they died and will not come back), on
        every server: a server rank's :meth:`close` then stops waiting for them at once
        instead of after ``timeout`` seconds of their silence.  Any rank may call it; a
        forgotten worker that does come back (``hello``) is counted again."""
        if self._client is None:
            raise RuntimeError(f"{_OWNER}.forget_workers: the optimizer is closed")
        ranks = [int(r) for r in ranks]
        bad = [r for r in ranks if not 0 <= r < self.total_num_replicas]
        if bad:
            raise ValueError(
                f"{_OWNER}.forget_workers: ranks must be in [0, {self.total_num_replicas}), "
                f"got {bad}"
            )
        for client in [self._client, *(self._links.clients.values() if self._links else ())]:
            for r in ranks:
                client.call("done", worker=r)

    def close(self) -> None:
        """Leave: tell every server; a server rank keeps serving until every worker left or
        has been silent for ``timeout`` seconds, then stops its servers (shards, then chief)."""
        for client in [self._client, *(self._links.clients.values() if self._links else ())]:
            try:
                if client is not None:
                    client.call("done", worker=self.worker, timeout=5.0)
            except Exception:
                pass
        self._client = self._links = None
        end = time.monotonic() + self.timeout
        for server, mailbox in self._hosted.values():
            while time.monotonic() < end and not server.finished():
                time.sleep(0.02)
            mailbox.close()
        self._hosted = {}
        if self._mailbox is not None and self._server is not None:
            while time.monotonic() < end:
                gone = self._server.done | set(self._server.silent_workers())
                if gone >= set(range(self.total_num_replicas)):
                    break
                time.sleep(0.02)
            self._mailbox.close()
            self._mailbox = None

    def __enter__(self) -> SyncReplicasOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------- checkpoints
    def _wrapper_state(self) -> dict[str, Any]:
        return {
            "local_step": self.local_step,
            "global_step": self.global_step,
            "counters": dict(self.counters),
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "total_num_replicas": self.total_num_replicas,
            "server": self._server.state_dict() if self._server is not None else None,
            "allreduce": self._allreduce.state_dict() if self._allreduce is not None else None,
            **self._shards_state(),
        }

    def _shards_state(self) -> dict[str, Any]:
        """Sharded: ``{"shards": {k: state}}`` for the shards hosted by this rank (shard 0 is
        in ``"server"``); unsharded checkpoints keep their old layout."""
        if len(self.server_ranks) == 1:
            return {}
        return {"shards": {k: srv.shard.state_dict() for k, (srv, _) in self._hosted.items()}}

    def _check_wrapper_state(self, counters: dict[str, Any]) -> None:
        super()._check_wrapper_state(counters)
        for key in ("replicas_to_aggregate", "total_num_replicas"):
            if counters[key] != getattr(self, key):
                raise ValueError(
                    f"{_OWNER}.load_state_dict: checkpoint has {key}="
                    f"{counters[key]}, this optimizer {getattr(self, key)}"
                )
        if (counters["server"] is None) != (self._server is None):
            raise ValueError(f"{_OWNER}.load_state_dict: load the chief's checkpoint on the chief")
        if set(counters.get("shards", {})) != set(self._hosted):
            raise ValueError(
                f"{_OWNER}.load_state_dict: checkpoint holds shards "
                f"{sorted(counters.get('shards', {}))}, this rank hosts {sorted(self._hosted)} "
                "(load each server rank's own checkpoint, same server_ranks)"
            )

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        if self._server is not None:
            self._server.load_state_dict(state["server"])
        if self._allreduce is not None:
            self._allreduce.load_state_dict(state["allreduce"])
        for k, shard_state in state.get("shards", {}).items():
            self._hosted[int(k)][0].shard.load_state_dict(shard_state)
        self.local_step, self.global_step = int(state["local_step"]), int(state["global_step"])
        self.counters = dict(state["counters"])
        self._version = -1  # the next step reloads the variables from the server(s)
        if self._links is not None:
            self._links.versions = dict.fromkeys(self._links.versions, -1)

    def compute_gradients(self, loss: Any, var_list: Any = None) -> GradsAndVars:
        """Pass-through to the wrapped optimizer (TF: clip per replica here)."""
        return super().compute_gradients(loss, var_list=var_list)


def _finite(g: torch.Tensor | None) -> bool:
    return g is None or all_finite(g)
