"""Streamed reads: ``step()`` returns once the token is in, and each module's next forward
waits only for the shards that hold its own parameters (``SyncReplicasOptimizer.stream_reads``).

Why: a sharded worker's step ends with reading every shard's new values.  Waited for in
``step()``, the read is added to the step: forward cannot start before the last shard's values
are in, although the first layers' shards came in long before.  BytePS starts a layer's forward
as soon as that layer's parameters are in (reference: cluster anchors); so does this.  With
``overlap=True`` pushing during backward (best with ``shard_assignment="backward_order"``),
a step then hides much of its transfer behind compute instead of costing their sum
(docs/cluster.md, measured).

With overlap the answers are taken from the first push a gradient hook makes, so a shard
whose gradients are all in gets its new values (received in place) while backward still
computes the earlier layers: the parameters are in flux from then until
``SyncReplicasOptimizer.wait_reads()`` or the next forward, not only after ``step()``.

What a worker sees does not change: every value it loads, and when it reads again (a shard
answered before the update its token stands for), is that of :meth:`~.links.SyncLinks.
token_and_read`; only *when* the wait happens moves, from ``step()`` to the first use:

* a module's forward pre-hook waits for the shards holding the module's own parameters
  (``recurse=False``: a parent's hook does not wait for its children, each child waits in its
  own forward);
* ``state_dict()`` and ``load_state_dict()`` of any module of the model wait for every shard;
* every call of the optimizer (``step``, ``apply_gradients``, ``state_dict``, queries,
  ``close``) and overlap's gradient hooks wait for every shard first;
* anything else that reads a parameter between ``step()`` and the next forward (the
  parameter's ``.data`` in user code, a function given a parameter directly) must call
  ``SyncReplicasOptimizer.wait_reads()`` first.

``last_gradient_accepted``, ``counters`` and the shards' part of ``global_step`` are known once
every shard is in: they are final after the next forward (or ``wait_reads()``); ``local_step``
and the chief's ``global_step`` are set in ``step()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["PendingReads", "StreamedReads"]

log = logging.getLogger(__name__)


class PendingReads:
    """One read-ahead step's values still coming in (``shards``, loaded by ``taker``'s thread)
    after its ``token``; :meth:`wait` for some shards, :meth:`finish` for all."""

    def __init__(
        self,
        links: Any,
        taker: Any,
        token: dict[str, Any],
        shards: Sequence[int],
        load: Callable[[int, list[torch.Tensor]], None],
    ) -> None:
        self.links, self.taker, self.token, self.load = links, taker, token, load
        self.left = list(shards)  # shards whose values are not final yet
        self.timeout = links.timeout + 10.0
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None

    def wait(self, shards: Iterable[int]) -> None:
        """Until the values of ``shards`` are final (read again where behind the token)."""
        wanted = set(shards)
        todo = [k for k in self.left if k in wanted]
        if self._error is not None:
            raise self._error
        if not todo:
            return
        answers = {}
        for k in todo:
            control = self.taker.wait_loaded(k, self.timeout)
            if control is None:  # the step failed: the taker's end() raises its error
                self._fail()
            answers[k] = control
        self.links.finish_reads(answers, self.token, self.load)
        self.left = [k for k in self.left if k not in answers]

    def _fail(self) -> None:
        try:
            self.taker.end(self.timeout)
        except BaseException as exc:
            self._error = exc
            raise
        self._error = RuntimeError("read-ahead: a shard's answer was lost")
        raise self._error

    def finish(self) -> dict[str, Any]:
        """Every shard final: the step's ``token``, ``accepted`` and ``global_step``."""
        if self._result is not None:
            return self._result
        self.wait(self.left)
        try:
            answers = self.taker.end(self.timeout)
        except BaseException as exc:
            self._error = exc
            raise
        self.links.shard_steps = [int(a["step"]) for a in answers.values()]
        token = self.token
        # the step this worker has seen is the oldest shard values it holds now: a shard that
        # answered a stale push without values may be past them ("step") while the worker
        # keeps values it need not read again for its token; claiming that shard's step
        # would end a `while opt.global_step < last_step` loop on older values than the
        # other workers'
        held = min(self.links.versions[k] for k in answers) if answers else -1
        self._result = {
            "token": int(token["token"]),
            "accepted": bool(token["accepted"])
            and all(bool(a["accepted"]) for a in answers.values()),
            "global_step": max(int(token["token"]), held),
            "r": token.get("r"),
        }
        return self._result


class StreamedReads:
    """A sharded worker's streamed reads (module docstring): the step whose values are still
    coming in, and the model's hooks that wait for them.  ``settle(accepted, global_step)``
    records a step's verdict in the optimizer's books once every value is in."""

    def __init__(
        self,
        links: Any,
        layout: Any,
        index: dict[int, int],
        worker: int,
        settle: Callable[[bool, int], None],
    ) -> None:
        self.links, self.layout, self.index, self.worker = links, layout, index, worker
        self.settle = settle
        self._pending: tuple[PendingReads, bool] | None = None  # (reads, own verdict)
        self._hooks: list[Any] = []

    def stream_reads(self, model: torch.nn.Module) -> None:
        """From now on ``step()`` returns once the token is in; each module of ``model`` waits
        in its forward for the shards holding its own parameters (module docstring)."""
        if not self.links.ahead:
            raise ValueError(
                "SyncReplicasOptimizer.stream_reads: needs transport='server' with several "
                "shards (server_ranks, e.g. [0, 0, 0, 0] for four shards on rank 0): one "
                "shard's values arrive as one answer, so there is nothing to stream"
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"SyncReplicasOptimizer.stream_reads: model must be a torch.nn.Module, got "
                f"{type(model).__name__}"
            )
        shards_of: dict[int, set[int]] = {}  # parameter index -> shards holding a piece
        for k, idx in enumerate(self.layout.parts):
            for j in idx:
                shards_of.setdefault(self.layout.pieces[j].index, set()).add(k)
        owned = [
            (m, sorted(set().union(*[self._shards(p, shards_of) for p in m.parameters(False)])))
            for m in model.modules()
        ]
        if not any(shards for _, shards in owned):
            raise ValueError(
                "SyncReplicasOptimizer.stream_reads: no parameter of this optimizer is in model"
            )
        self.remove_hooks()
        for module, shards in owned:
            if shards:
                hook = module.register_forward_pre_hook(self._forward_hook(shards))
                self._hooks.append(hook)
            self._hooks.append(module.register_state_dict_pre_hook(self._wait_all))
            self._hooks.append(module.register_load_state_dict_pre_hook(self._wait_all))
        log.info("worker rank %d: reads stream into the next forward", self.worker)

    def _shards(self, p: torch.Tensor, shards_of: dict[int, set[int]]) -> set[int]:
        i = self.index.get(id(p))
        return set() if i is None else shards_of.get(i, set())

    def _forward_hook(self, shards: list[int]) -> Callable[..., None]:
        def wait_for_shards(module: torch.nn.Module, args: Any) -> None:
            if self._pending is not None:
                reads = self._pending[0]
                reads.wait(shards)
                if not reads.left:
                    self.wait()

        return wait_for_shards

    def _wait_all(self, *args: Any, **kwargs: Any) -> None:
        self.wait()

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @property
    def on(self) -> bool:
        """Does ``step()`` leave the reads to the next forward (:meth:`stream_reads`)?"""
        return bool(self._hooks)

    @property
    def pending(self) -> bool:
        """Are values of the last step still coming in?"""
        return self._pending is not None

    def wait(self) -> None:
        """Until every value of the last step is loaded; its verdict goes to ``settle``."""
        if self._pending is None:
            return
        reads, own = self._pending
        try:
            result = reads.finish()
        finally:
            self._pending = None
        self.settle(bool(result["accepted"]) and own, int(result["global_step"]))

    def start(self, tag: int, own: bool) -> dict[str, Any]:
        """The step's token (``token``, ``global_step``); its reads are left pending.
        ``own``: this worker's part of the verdict (the token's and shards' are added once
        the reads finish)."""
        reads = self.links.token_then_reads(tag, self.layout.load_shard)
        self._pending = (reads, own)
        return reads.token
