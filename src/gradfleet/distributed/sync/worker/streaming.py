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
answered before the update its token stands for), is that of the step's
:class:`~.pending_step.PendingStep` waited for in ``step()``; only *when* the wait happens
moves, from ``step()`` to the first use:

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["StreamedReads"]

log = logging.getLogger(__name__)


class StreamedReads:
    """A sharded worker's streamed reads (module docstring): the model's hooks that wait for
    the last step's values.  ``wait(shards)``: until the values of ``shards`` (all: None) are
    in, once all are with the step's verdict recorded (``ServerExchange.wait_reads``, which
    holds the step); ``take_answers()``: from now on the read-ahead answers of this step's
    pushes are taken (loaded into the parameters); None where a step's values do not come
    shard by shard (one server).  ``shards_of``: the shards holding each parameter (the
    layout's map); ``index``: ``id(parameter) -> index``."""

    def __init__(
        self,
        shards_of: Mapping[int, Sequence[int]],
        index: dict[int, int],
        worker: int,
        wait: Callable[[Iterable[int] | None], None],
        take_answers: Callable[[], None] | None,
    ) -> None:
        self.shards_of, self.index, self.worker = shards_of, index, worker
        self._wait, self._take_answers = wait, take_answers
        self._hooks: list[Any] = []

    @property
    def streamable(self) -> bool:
        """Do a step's values come shard by shard (reading ahead)?"""
        return self._take_answers is not None

    def pushed_early(self) -> None:
        """Overlap pushed shards from a gradient hook.  Streamed, their answers are taken at
        once: backward is done with these parameters (their gradients are in, so every node
        that saved them has run), and their new values may land before ``step()``."""
        if self.on and self._take_answers is not None:
            self._take_answers()

    def stream_reads(self, model: torch.nn.Module) -> None:
        """From now on ``step()`` returns once the token is in; each module of ``model`` waits
        in its forward for the shards holding its own parameters (module docstring)."""
        if not self.streamable:
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
        owned = [
            (m, sorted(set().union(*[self._shards(p) for p in m.parameters(False)])))
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

    def _shards(self, p: torch.Tensor) -> set[int]:
        """The shards holding a piece of ``p`` (none: not a parameter of this optimizer)."""
        i = self.index.get(id(p))
        return set() if i is None else set(self.shards_of.get(i, ()))

    def _forward_hook(self, shards: list[int]) -> Callable[..., None]:
        def wait_for_shards(module: torch.nn.Module, args: Any) -> None:
            self._wait(shards)

        return wait_for_shards

    def _wait_all(self, *args: Any, **kwargs: Any) -> None:
        self._wait(None)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @property
    def on(self) -> bool:
        """Does ``step()`` leave the reads to the next forward (:meth:`stream_reads`)?"""
        return bool(self._hooks)
