"""Server-side state of ``SyncReplicasOptimizer`` (TF's parameter server + chief sync thread).

``SyncServer`` owns the real variables, a copy of the wrapped optimizer, the
:class:`GradientAggregator`, the :class:`TokenQueue` and ``global_step``.  It is driven by
:class:`MailboxServer` requests, one at a time on the server thread, so it needs no lock:

* ``hello``:  validate the worker's parameter count/shapes/dtypes; reply variables + step
  (TF's ``local_step_init_op``: ``local_step := global_step``).
* ``push``:   (sharded jobs) only the push below, answered with ``accepted``.
* ``step``:   push the gradients (if given) with the worker's tag; if ``R`` are in, take the
  averages, apply them with the wrapped optimizer, ``global_step += 1`` after all variables, enqueue
  ``max(N, R)`` tokens, update the moving averages; then answer with a token (deferred while
  the queue is empty) and the current variables.
* ``done``:   the worker left.
* ``tick``:   a worker that waited ``timeout`` seconds for a token gets a ``TimeoutError``
  naming the ranks it is waiting for (silent ones), never a silent hang.

With parameter shards (``_shards`` module) the server holds shard 0 only, learns the other
shards' updates from their ``applied`` requests and sets ``global_step`` to the minimum shard
step (tokens after every increment); it probes the shard servers every ``PROBE_S`` seconds and
answers every waiting and later request with ``ServerUnreachable`` naming a dead one.

``last_step`` (beyond TF): once ``global_step`` reaches it every token request is answered at
once, so no worker blocks at the end of training (TF's end-of-training hangs, #7970).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._aggregator import GradientAggregator, TokenQueue
from ._shards import Shard, server_optimizer
from .transport import Reply

__all__ = ["SyncServer", "ExponentialMovingAverage", "server_optimizer"]


class ExponentialMovingAverage:
    """TF's ``ExponentialMovingAverage(decay, num_updates)`` for ``variable_averages``.

    ``shadow := decay' * shadow + (1 - decay') * var`` with ``decay' = min(decay, (1 + n) /
    (10 + n))`` when ``use_num_updates`` (TF passes ``global_step`` as ``num_updates``; here the
    step after the update).  Shadows start at the variable's value when first applied.
    """

    def __init__(self, decay: float, use_num_updates: bool = False) -> None:
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"ExponentialMovingAverage: decay must be in [0, 1], got {decay!r}")
        self.decay, self.use_num_updates = float(decay), bool(use_num_updates)
        self.shadows: dict[int, torch.Tensor] = {}

    def apply(self, variables: dict[int, torch.Tensor], num_updates: int | None = None) -> None:
        decay = self.decay
        if self.use_num_updates and num_updates is not None:
            decay = min(decay, (1.0 + num_updates) / (10.0 + num_updates))
        with torch.no_grad():
            for i, v in variables.items():
                if i not in self.shadows:
                    self.shadows[i] = v.detach().clone()
                self.shadows[i].mul_(decay).add_(v.detach(), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, Any]:
        return {"shadows": {int(i): s.clone() for i, s in self.shadows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadows = {int(i): s.clone() for i, s in state["shadows"].items()}


PROBE_S = 0.5


class SyncServer:
    """TF's PS variables + accumulators + token queue + chief sync op (see module docstring).

    ``indices`` (default: every parameter) are the parameters of shard 0 held here;
    ``num_shards`` > 1 makes ``global_step`` wait for the other shards' ``applied`` reports.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        replicas_to_aggregate: int,
        total_num_replicas: int,
        num_tokens: int,
        timeout: float,
        variable_averages: ExponentialMovingAverage | None = None,
        average_indices: Sequence[int] = (),
        nonfinite: str = "raise",
        last_step: int | None = None,
        indices: Sequence[int] | None = None,
        num_shards: int = 1,
    ) -> None:
        count = sum(len(g["params"]) for g in opt.param_groups)
        self.shard = Shard(
            opt,
            range(count) if indices is None else indices,
            replicas_to_aggregate,
            nonfinite,
            variable_averages,
            average_indices,
            last_step,
        )
        self.R, self.N = replicas_to_aggregate, total_num_replicas
        self.tokens_per_step = max(total_num_replicas, replicas_to_aggregate)
        self.tokens = TokenQueue()
        self.tokens.put(0, num_tokens)
        self.global_step = 0
        self.applied = [0] * num_shards  # each shard's step as last reported
        self.timeout = timeout
        self.ema = variable_averages
        self.last_step = last_step
        self.waiting: deque[tuple[int, Reply, float, bool, int]] = deque()
        self.seen: dict[int, float] = {}
        self.done: set[int] = set()
        self.probes: dict[str, Callable[[], None]] = {}  # shard server name -> liveness check
        self.broken: str | None = None
        self._probed = 0.0

    @property
    def params(self) -> list[torch.Tensor]:
        """The variables held here (shard 0: every variable when unsharded)."""
        return self.shard.params

    @property
    def aggregator(self) -> GradientAggregator:
        return self.shard.aggregator

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.shard.opt

    # ------------------------------------------------------------------ requests
    def handle(self, msg: dict[str, Any], reply: Reply) -> None:
        op = msg["op"]
        if op == "applied":  # a shard server finished an update
            k = int(msg["shard"])
            self.applied[k] = max(self.applied[k], int(msg["step"]))
            self._advance()
            self._serve_tokens()
            reply.send({})
            return
        worker = int(msg["worker"])
        self.seen[worker] = time.monotonic()
        if self.broken is not None and op in ("hello", "push", "step"):
            reply.send({"error": "ServerUnreachable", "message": self.broken})
        elif op == "hello":
            self.shard.check_layout(worker, msg["shapes"], msg["dtypes"], "chief")
            self.done.discard(worker)
            reply.send(
                {
                    "global_step": self.global_step,
                    "params": self.params,
                    "version": self.shard.step,
                },
                share=self.shard.values_key,
            )
        elif op == "push":  # sharded jobs: push first (concurrently with the shards), then "step"
            reply.send({"accepted": self.push(worker, int(msg["tag"]), msg["grads"])})
        elif op == "step":
            accepted = self.push(worker, int(msg["tag"]), msg["grads"]) if "grads" in msg else True
            self.waiting.append((worker, reply, time.monotonic(), accepted, int(msg["version"])))
            self._serve_tokens()
        elif op == "done":
            self.done.add(worker)
            reply.send({"global_step": self.global_step})
        elif op == "stats":
            reply.send({"global_step": self.global_step, "stats": self.aggregator.stats})
        elif op == "ema":
            reply.send({"shadows": self.shard.shadows()})
        else:
            raise ValueError(f"unknown request {op!r}")

    def push(self, worker: int, tag: int, grads: list[torch.Tensor | None]) -> bool:
        """Offer shard 0's gradients; update when ``R`` are in.  True iff accepted."""
        accepted, updated = self.shard.push(worker, tag, grads)
        if updated:
            self.applied[0] = self.shard.step
            self._advance()
        return accepted

    def _advance(self) -> None:
        """``global_step += 1`` once every shard applied the update, then the tokens."""
        while min(self.applied) > self.global_step:
            self.global_step += 1
            self.tokens.put(self.global_step, self.tokens_per_step)

    def take_token(self) -> int | None:
        if self.last_step is not None and self.global_step >= self.last_step:
            return self.global_step
        return self.tokens.get()

    def _serve_tokens(self) -> None:
        while self.waiting:
            token = self.take_token()
            if token is None:
                return
            worker, reply, _, accepted, version = self.waiting.popleft()
            answer = {
                "token": token,
                "accepted": accepted,
                "global_step": self.global_step,
                "version": self.shard.step,
            }
            if version != self.shard.step:
                answer["params"] = self.params
            reply.send(answer, share=self.shard.values_key if "params" in answer else None)

    # ------------------------------------------------------------------ liveness
    def tick(self) -> None:
        now = time.monotonic()
        if self.probes and self.broken is None and now - self._probed > PROBE_S:
            self._probed = now
            self._probe()
        if self.broken is not None:
            while self.waiting:
                self.waiting.popleft()[1].send(
                    {"error": "ServerUnreachable", "message": self.broken}
                )
        while self.waiting and now - self.waiting[0][2] > self.timeout:
            worker, reply, since, _, _ = self.waiting[0]
            message = self.stall_message(worker, now - since)
            self.waiting.popleft()
            reply.send({"error": "TimeoutError", "message": message})

    def _probe(self) -> None:
        for name, check in self.probes.items():
            try:
                check()
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else ""
                self.broken = (
                    f"SyncReplicasOptimizer: {name} is unreachable (dead or stuck), the chief "
                    f"stops at global step {self.global_step}: {type(exc).__name__}: {first}"
                )
                return

    def silent_workers(self, now: float | None = None) -> list[int]:
        now = time.monotonic() if now is None else now
        waiting = {w for w, *_ in self.waiting}  # they are blocked, not silent
        return [
            w
            for w in range(self.N)
            if w not in waiting
            and w not in self.done
            and now - self.seen.get(w, -float("inf")) > self.timeout
        ]

    def stall_message(self, worker: int, waited: float) -> str:
        silent = self.silent_workers()
        who = (
            f"no message from worker rank(s) {silent} for over {self.timeout:g}s (dead or stuck)"
            if silent
            else "every live worker is waiting too (not enough tokens: check num_tokens)"
        )
        shards = f"; shard steps {self.applied}" if len(self.applied) > 1 else ""
        return (
            f"SyncReplicasOptimizer: worker rank {worker} waited {waited:.1f}s for a token at "
            f"global step {self.global_step} ({self.aggregator.counter} of {self.R} fresh "
            f"gradients in{shards}); {who}; progress needs replicas_to_aggregate={self.R}"
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = {
            "global_step": self.global_step,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.opt.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "tokens": self.tokens.state(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }
        if len(self.applied) > 1:
            state["applied"] = list(self.applied)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        applied = list(state.get("applied", [state["global_step"]]))
        if len(applied) != len(self.applied):
            raise ValueError(
                f"SyncReplicasOptimizer: checkpoint has {len(applied)} shard(s), this chief "
                f"{len(self.applied)} (use the same server_ranks)"
            )
        self.shard.load_state_dict(
            {
                "indices": self.shard.indices,
                "params": state["params"],
                "optimizer": state["optimizer"],
                "aggregator": state["aggregator"],
                "shadows": [],
            }
        )
        self.global_step = int(state["global_step"])
        self.applied = [int(a) for a in applied]
        self.tokens.load(state["tokens"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
