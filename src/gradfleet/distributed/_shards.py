"""Parameter shards of ``SyncReplicasOptimizer``: TF's variables spread over several ps tasks.

``server_ranks=[r0, r1, ...]`` (S shards): shard ``k`` is hosted by rank ``server_ranks[k]``
(a rank may host several shards); :func:`assign` gives each shard whole parameters, balancing
bytes (:func:`by_bytes`, default) or round-robin ``i % S`` (:func:`round_robin`, TF's
``replica_device_setter`` over ps tasks).  A :class:`Shard` holds its variables,
their accumulators (one :class:`GradientAggregator`: TF's per-accumulator staleness rule and
accepted counts, per shard) and a copy of the wrapped optimizer restricted to its variables.
Shard 0 lives inside the chief's :class:`SyncServer`, which also keeps ``global_step`` and the
token queue; shards 1.. are served by a :class:`ShardServer` on their own mailbox.

Per worker step::

    worker: push shard k's gradients to every shard k at once (the chief's with "push"),
            tagged local_step; then the chief's "step": wait for a token; then "read" every
            shard 1.. at once (values come back only if the shard stepped since the last read)
    shard:  when its accumulators hold R fresh gradients: average, apply with its optimizer
            copy, its step += 1, tell the chief "applied" (before answering the push, so the
            chief knows before the pusher asks for its token)
    chief:  global_step := min over shards of their step; every increment enqueues max(N, R)
            tokens (TF: global_step += 1 after all variables were updated, then tokens)

Shards check staleness independently, as TF's accumulators do: with backup workers a gradient
set can be accepted by one shard and dropped by another (TF's per-variable race); a worker's
``last_gradient_accepted`` is True iff every shard accepted it.  A shard may run one update
ahead of ``global_step``; a worker reads each shard's newest values after its token, as a TF
worker reads variables from several ps tasks (no cross-shard snapshot).

Optimizer state shared across variables (Adam's ``beta1_power``/``beta2_power``, kept per
param group): every shard's copy keeps every group and advances its own powers once per
update of that shard, i.e. once per global step; this equals TF's single shared pair as long
as every shard updates every step, which holds unless all of a shard's parameters receive
``None`` from every worker (that shard then skips its optimizer call and its powers lag).
Hyperparameters are re-read before each update from the wrapped optimizer of the rank that
hosts the shard (so LR schedules must run on every server rank, as they do when every rank
runs the same loop).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._aggregator import GradientAggregator
from ._wrapper import apply_with_step
from .transport import MailboxClient, Reply, ServerUnreachable

__all__ = [
    "Shard",
    "ShardServer",
    "ShardLinks",
    "round_robin",
    "by_bytes",
    "assign",
    "check_server_ranks",
    "shard_optimizer",
    "server_optimizer",
    "probe",
]


def check_server_ranks(
    ranks: Sequence[int], N: int, num_params: int, transport: str, address: Any
) -> list[int]:
    """Validate ``server_ranks`` (and ``server_address`` against it); returns a list."""
    owner = "SyncReplicasOptimizer"
    ranks = list(ranks)
    if not ranks:
        raise ValueError(f"{owner}: server_ranks must name at least one rank")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < N:
            raise ValueError(
                f"{owner}: server rank {r!r} is not a worker rank (total_num_replicas={N})"
            )
    if len(ranks) > 1:
        if transport == "allreduce":
            raise ValueError(f"{owner}: server_ranks (sharding) needs transport='server'")
        if len(ranks) > num_params:
            raise ValueError(f"{owner}: {len(ranks)} server shards for {num_params} parameters")
        if isinstance(address, str) or (address is not None and len(address) != len(ranks)):
            raise ValueError(
                f"{owner}: with {len(ranks)} shards server_address must list one address per "
                "shard (the server_addresses property of a running optimizer)"
            )
    return ranks


def round_robin(num_params: int, num_shards: int) -> list[list[int]]:
    """Parameter indices of each shard: ``i`` goes to shard ``i % num_shards``."""
    return [list(range(k, num_params, num_shards)) for k in range(num_shards)]


def by_bytes(nbytes: Sequence[int], num_shards: int) -> list[list[int]]:
    """Parameter indices of each shard, balancing bytes: largest parameter first, each to the
    shard holding the fewest bytes so far (ties: lowest shard).  Whole parameters only, so
    per-tensor reductions of the wrapped optimizer (norms) stay exact."""
    load = [0] * num_shards
    parts: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        k = min(range(num_shards), key=lambda k: (load[k], len(parts[k]), k))
        parts[k].append(i)
        load[k] += nbytes[i]
    return [sorted(p) for p in parts]


ASSIGNMENTS = ("bytes", "round_robin")


def assign(params: Sequence[torch.Tensor], num_shards: int, how: str) -> list[list[int]]:
    """Shard assignment ``how`` in :data:`ASSIGNMENTS` (one shard: every parameter)."""
    if how not in ASSIGNMENTS:
        raise ValueError(
            f"SyncReplicasOptimizer: shard_assignment must be one of {ASSIGNMENTS}, got {how!r}"
        )
    if how == "round_robin" or num_shards == 1:
        return round_robin(len(params), num_shards)
    return by_bytes([p.numel() * p.element_size() for p in params], num_shards)


def server_optimizer(
    opt: torch.optim.Optimizer,
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """A deep copy of ``opt`` over copies of its parameters (the server's variables).

    Copies the instance ``__dict__`` (``torch.optim.Optimizer.__getstate__`` would keep only
    groups/state/defaults and lose a subclass's own attributes)."""
    originals = [p for g in opt.param_groups for p in g["params"]]
    params = [p.detach().clone() for p in originals]
    memo: dict[int, Any] = {id(o): c for o, c in zip(originals, params, strict=True)}
    clone = object.__new__(type(opt))
    clone.__dict__.update({k: copy.deepcopy(v, memo) for k, v in opt.__dict__.items()})
    return clone, params


def shard_optimizer(
    opt: torch.optim.Optimizer, indices: Sequence[int]
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """:func:`server_optimizer` keeping only the parameters ``indices`` (every param group is
    kept, possibly empty, so per-group shared state such as beta powers is kept too)."""
    clone, params = server_optimizer(opt)
    mine = [params[i] for i in indices]
    keep = {id(p) for p in mine}
    if len(mine) != len(params):
        for group in clone.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
        for p in list(clone.state):
            if id(p) not in keep:
                del clone.state[p]
    return clone, mine


class Shard:
    """Variables ``indices`` of the model, their accumulators and an optimizer copy."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        indices: Sequence[int],
        replicas_to_aggregate: int,
        nonfinite: str = "raise",
        ema: Any = None,
        average_indices: Sequence[int] = (),
        last_step: int | None = None,
    ) -> None:
        self.source = opt  # hyperparameters (LR schedules) are re-read from here
        self.indices = list(indices)
        self.opt, self.params = shard_optimizer(opt, self.indices)
        self.aggregator = GradientAggregator(self.params, replicas_to_aggregate, nonfinite)
        self.ema, self.last_step = ema, last_step
        chosen = set(average_indices) if average_indices else set(self.indices)
        self.averaged = [(j, i) for j, i in enumerate(self.indices) if i in chosen]
        self.loads = 0  # checkpoint loads: they change the variables without a step

    @property
    def values_key(self) -> tuple[int, int, int]:
        """Equal for equal variable values: replies carrying them may share one copy."""
        return (id(self), self.loads, self.step)

    @property
    def step(self) -> int:
        """Updates applied so far (the accumulators' ``current_global_step``)."""
        return self.aggregator.global_step

    def check_layout(self, worker: int, shapes: list, dtypes: list, where: str) -> None:
        mine = [list(p.shape) for p in self.params]
        if [list(s) for s in shapes] != mine:
            raise ValueError(
                f"SyncReplicasOptimizer: worker rank {worker} has parameter shapes {shapes}, the "
                f"server ({where}) has {mine}; every worker must build the same model"
            )
        theirs = [str(d) for d in dtypes]
        if theirs != [str(p.dtype) for p in self.params]:
            raise ValueError(f"SyncReplicasOptimizer: worker rank {worker} has dtypes {theirs}")

    def push(self, worker: int, tag: int, grads: list[torch.Tensor | None]) -> tuple[bool, bool]:
        """Offer this shard's gradients: ``(accepted, updated)``; updates once R are in."""
        if self.last_step is not None and self.step >= self.last_step:
            return False, False
        accepted = self.aggregator.push(worker, tag, grads)
        if not self.aggregator.ready():
            return accepted, False
        self.update()
        return accepted, True

    def update(self) -> None:
        """TF's sync op for these variables: take the averages, apply them, moving averages."""
        averages = self.aggregator.take_average()
        for mine, theirs in zip(self.opt.param_groups, self.source.param_groups, strict=True):
            mine.update({k: v for k, v in theirs.items() if k not in ("params", "non_slot")})
        pairs = [(g, p) for g, p in zip(averages, self.params, strict=True) if g is not None]
        if pairs:
            inner = getattr(self.opt, "apply_gradients", None)
            if inner is not None:
                inner(pairs)
            else:
                apply_with_step(self.opt, pairs)
        if self.ema is not None and self.averaged:
            self.ema.apply({i: self.params[j] for j, i in self.averaged}, num_updates=self.step)

    def shadows(self) -> list[list[Any]]:
        """``[[index, moving average], ...]`` of this shard's averaged variables."""
        if self.ema is None:
            return []
        return [[i, self.ema.shadows[i]] for _, i in self.averaged if i in self.ema.shadows]

    def state_dict(self) -> dict[str, Any]:
        return {
            "indices": list(self.indices),
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.opt.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "shadows": [[i, s.clone()] for i, s in self.shadows()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["indices"]) != self.indices:
            raise ValueError(
                f"SyncReplicasOptimizer: checkpoint shard holds parameters {state['indices']}, "
                f"this shard {self.indices} (same server_ranks and model needed)"
            )
        shapes = [tuple(p.shape) for p in state["params"]]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError(f"SyncReplicasOptimizer: checkpoint variables have shapes {shapes}")
        self.loads += 1
        self.aggregator.load_state_dict(state["aggregator"])
        self.opt.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for p, v in zip(self.params, state["params"], strict=True):
                p.copy_(v)
        if self.ema is not None:
            for i, s in state["shadows"]:
                self.ema.shadows[int(i)] = s.clone()


class ShardServer:
    """Mailbox handler of a non-chief shard: ``hello``, ``push``, ``read``, ``done``,
    ``stats``, ``ema``.  After an update it calls ``applied`` on the chief (waiting for the
    chief's link, set by :meth:`connect_chief`, at most ``timeout`` seconds)."""

    def __init__(self, shard_id: int, shard: Shard, total_num_replicas: int, timeout: float):
        self.k, self.shard, self.N, self.timeout = shard_id, shard, total_num_replicas, timeout
        self.seen: dict[int, float] = {}
        self.done: set[int] = set()
        self._chief: MailboxClient | None = None
        self._linked = threading.Event()
        self.notify: Callable[[int, int], None] = self._notify_chief

    def connect_chief(self, address: str, rank: int) -> None:
        self._chief = MailboxClient(
            address,
            f"shard{self.k}",
            self.timeout + 10.0,
            f"server rank {rank} (chief)",
            data=False,  # "applied" reports carry no tensors
        )
        self._linked.set()

    def _notify_chief(self, shard: int, step: int) -> None:
        if not self._linked.wait(self.timeout) or self._chief is None:
            raise ServerUnreachable(f"shard {self.k}: no link to the chief")
        self._chief.call("applied", worker=-1, shard=shard, step=step)

    def handle(self, msg: dict[str, Any], reply: Reply) -> None:
        worker = int(msg["worker"])
        self.seen[worker] = time.monotonic()
        op = msg["op"]
        if op == "hello":
            self.shard.check_layout(worker, msg["shapes"], msg["dtypes"], f"shard {self.k}")
            self.done.discard(worker)
            reply.send(
                {"version": self.shard.step, "params": self.shard.params},
                share=self.shard.values_key,
            )
        elif op == "push":
            accepted, updated = self.shard.push(worker, int(msg["tag"]), msg["grads"])
            if updated:
                self.notify(self.k, self.shard.step)
            reply.send({"accepted": accepted})
        elif op == "read":
            answer: dict[str, Any] = {"version": self.shard.step}
            if int(msg["version"]) != self.shard.step:
                answer["params"] = self.shard.params
            reply.send(answer, share=self.shard.values_key if "params" in answer else None)
        elif op == "done":
            self.done.add(worker)
            reply.send({})
        elif op == "stats":
            reply.send({"stats": self.shard.aggregator.stats})
        elif op == "ema":
            reply.send({"shadows": self.shard.shadows()})
        else:
            raise ValueError(f"unknown request {op!r}")

    def finished(self) -> bool:
        """Every worker left or has been silent for ``timeout`` seconds."""
        now = time.monotonic()
        gone = self.done | {
            w for w in range(self.N) if now - self.seen.get(w, -float("inf")) > self.timeout
        }
        return gone >= set(range(self.N))


def probe(address: str, seconds: float) -> Callable[[], None]:
    """A liveness check of the mailbox at ``address``: raises once its process is gone."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=seconds))

    def check() -> None:
        store.queue_len("gf/probe")

    return check


class ShardLinks:
    """A worker's connections to shards 1.. (shard 0 is reached through the chief)."""

    def __init__(
        self, addresses: dict[int, str], ranks: Sequence[int], worker: int, timeout: float
    ) -> None:
        self.worker = worker
        self.clients = {
            k: MailboxClient(a, f"w{worker}", timeout + 10.0, f"server rank {ranks[k]} (shard {k})")
            for k, a in sorted(addresses.items())
        }
        self.versions = {k: -1 for k in self.clients}

    def hello(self, parts: Sequence[Sequence[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        out = {}
        for k, client in self.clients.items():
            reply = client.call(
                "hello",
                worker=self.worker,
                shapes=[list(p.shape) for p in parts[k]],
                dtypes=[str(p.dtype) for p in parts[k]],
            )
            self.versions[k] = int(reply["version"])
            out[k] = reply["params"]
        return out

    def push(self, tag: int, parts: Sequence[list[torch.Tensor | None]]) -> None:
        """Start pushing shard k's gradients to every shard k (they travel concurrently);
        :meth:`pushed` collects the answers."""
        for k, client in self.clients.items():
            client.request("push", worker=self.worker, tag=tag, grads=parts[k])

    def pushed(self) -> bool:
        """True iff every shard accepted the gradients of the last :meth:`push`."""
        accepted = [bool(c.response()["accepted"]) for c in self.clients.values()]
        return all(accepted)

    def read(self, into: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Values of every shard that stepped since the last read (read concurrently; the
        tensors are views of each link's buffer, or of shard k's ``into[k]`` tensors where
        they were received in place: copy the others before the next read)."""
        for k, client in self.clients.items():
            client.request("read", worker=self.worker, version=self.versions[k])
        out = {}
        for k, client in self.clients.items():
            reply = client.response(receive_into=into.get(k))
            self.versions[k] = int(reply["version"])
            if "params" in reply:
                out[k] = reply["params"]
        return out

    def call_all(self, op: str, **fields: Any) -> dict[int, dict[str, Any]]:
        return {k: c.call(op, worker=self.worker, **fields) for k, c in self.clients.items()}

    @property
    def bytes_out(self) -> int:
        return sum(c.bytes_out for c in self.clients.values())
