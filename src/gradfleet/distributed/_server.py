"""Server-side state of ``SyncReplicasOptimizer`` (TF's parameter server + chief sync thread).

``SyncServer`` owns the real variables, a copy of the wrapped optimizer, the
:class:`GradientAggregator`, the :class:`TokenQueue` and ``global_step``.  It is driven by
:class:`MailboxServer` requests, one at a time on the server thread, so it needs no lock:

* ``hello``:  validate the worker's parameter count/shapes/dtypes; reply variables + step
  (TF's ``local_step_init_op``: ``local_step := global_step``).
* ``step``:   push the gradients with the worker's tag; if ``R`` are in, take the averages,
  apply them with the wrapped optimizer, ``global_step += 1`` after all variables, enqueue
  ``max(N, R)`` tokens, update the moving averages; then answer with a token (deferred while
  the queue is empty) and the current variables.
* ``done``:   the worker left.
* ``tick``:   a worker that waited ``timeout`` seconds for a token gets a ``TimeoutError``
  naming the ranks it is waiting for (silent ones), never a silent hang.

``last_step`` (beyond TF): once ``global_step`` reaches it every token request is answered at
once, so no worker blocks at the end of training (TF's end-of-training hangs, #7970).
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ._aggregator import GradientAggregator, TokenQueue
from ._mailbox import Reply
from ._wrapper import apply_with_step

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


class SyncServer:
    """TF's PS variables + accumulators + token queue + chief sync op (see module docstring)."""

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
    ) -> None:
        self.source = opt  # hyperparameters (LR schedules) are read from here before each apply
        self.opt, self.params = server_optimizer(opt)
        self.R, self.N = replicas_to_aggregate, total_num_replicas
        self.tokens_per_step = max(total_num_replicas, replicas_to_aggregate)
        self.aggregator = GradientAggregator(self.params, replicas_to_aggregate, nonfinite)
        self.tokens = TokenQueue()
        self.tokens.put(0, num_tokens)
        self.global_step = 0
        self.timeout = timeout
        self.ema = variable_averages
        self.average_indices = list(average_indices)
        self.last_step = last_step
        self.waiting: deque[tuple[int, Reply, float, bool, int]] = deque()
        self.seen: dict[int, float] = {}
        self.done: set[int] = set()

    # ------------------------------------------------------------------ requests
    def handle(self, msg: dict[str, Any], reply: Reply) -> None:
        worker = int(msg["worker"])
        self.seen[worker] = time.monotonic()
        op = msg["op"]
        if op == "hello":
            self._check_layout(worker, msg["shapes"], msg["dtypes"])
            self.done.discard(worker)
            reply.send({"global_step": self.global_step, "params": self.params})
        elif op == "step":
            accepted = self.push(worker, int(msg["tag"]), msg["grads"])
            self.waiting.append((worker, reply, time.monotonic(), accepted, int(msg["version"])))
            self._serve_tokens()
        elif op == "done":
            self.done.add(worker)
            reply.send({"global_step": self.global_step})
        elif op == "stats":
            reply.send({"global_step": self.global_step, "stats": self.aggregator.stats})
        else:
            raise ValueError(f"unknown request {op!r}")

    def _check_layout(self, worker: int, shapes: list, dtypes: list) -> None:
        mine = [list(p.shape) for p in self.params]
        if [list(s) for s in shapes] != mine:
            raise ValueError(
                f"SyncReplicasOptimizer: worker rank {worker} has parameter shapes {shapes}, the "
                f"server (chief) has {mine}; every worker must build the same model"
            )
        theirs = [str(d) for d in dtypes]
        if theirs != [str(p.dtype) for p in self.params]:
            raise ValueError(f"SyncReplicasOptimizer: worker rank {worker} has dtypes {theirs}")

    def push(self, worker: int, tag: int, grads: list[torch.Tensor | None]) -> bool:
        """Offer gradients; run the chief's sync op when ``R`` are in.  True iff accepted."""
        if self.last_step is not None and self.global_step >= self.last_step:
            return False
        accepted = self.aggregator.push(worker, tag, grads)
        if self.aggregator.ready():
            self._update()
        return accepted

    def _update(self) -> None:
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
        self.global_step += 1
        self.tokens.put(self.global_step, self.tokens_per_step)
        if self.ema is not None:
            chosen = self.average_indices or range(len(self.params))
            self.ema.apply({i: self.params[i] for i in chosen}, num_updates=self.global_step)

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
            answer = {"token": token, "accepted": accepted, "global_step": self.global_step}
            if version != self.global_step:
                answer["params"] = self.params
            reply.send(answer)

    # ------------------------------------------------------------------ liveness
    def tick(self) -> None:
        now = time.monotonic()
        while self.waiting and now - self.waiting[0][2] > self.timeout:
            worker, reply, since, _, _ = self.waiting[0]
            message = self.stall_message(worker, now - since)
            self.waiting.popleft()
            reply.send({"error": "TimeoutError", "message": message})

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
        return (
            f"SyncReplicasOptimizer: worker rank {worker} waited {waited:.1f}s for a token at "
            f"global step {self.global_step} ({self.aggregator.counter} of {self.R} fresh "
            f"gradients in); {who}; progress needs replicas_to_aggregate={self.R}"
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.opt.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "tokens": self.tokens.state(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shapes = [tuple(p.shape) for p in state["params"]]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError(f"SyncReplicasOptimizer: checkpoint variables have shapes {shapes}")
        self.aggregator.load_state_dict(state["aggregator"])
        self.opt.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for p, v in zip(self.params, state["params"], strict=True):
                p.copy_(v)
        self.global_step = int(state["global_step"])
        self.tokens.load(state["tokens"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
