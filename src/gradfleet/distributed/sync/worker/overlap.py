"""Overlap of ``SyncReplicasOptimizer``'s gradient pushes with backward (``overlap=True``).

DDP all-reduces a bucket of gradients as soon as backward has produced every gradient in it
(reference: cluster anchors); here the unit is a parameter shard (``server_ranks``): a
post-accumulate-grad hook on every trainable parameter marks its gradient as ready, and once
every trainable parameter of shard ``k`` is ready the shard's push starts at once -- shard
``k >= 1`` to its server, shard 0 with the token request to the chief -- while backward goes
on with the earlier layers.  ``step()`` then sends the shards that are not complete (a
parameter that got no gradient: its ``None`` is pushed as such) and only waits for answers.

What is pushed is ``.grad`` as it stands when the shard completes, so anything done between
``backward()`` and ``step()`` (clipping, ``GradScaler`` unscaling, an LR change read from the
optimizer) does not reach the servers: the reason the option is off by default.

A gradient hook firing twice for one parameter before ``step()`` means a second backward pass
(gradient accumulation): its shard may have been pushed with the first pass's partial sum, so
this raises instead of pushing a wrong gradient silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

__all__ = ["ShardReadiness"]

log = logging.getLogger(__name__)


class ShardReadiness:
    """Which shards' gradients are complete in this step; calls ``on_ready(shards)`` with the
    shards that one parameter's gradient completed (each shard once per step: when its
    trainable parameters have all accumulated their gradient).  Together, so that they go out
    in the worker's push order rather than in the order the hook found them.

    ``params``: the optimizer's parameters in order; ``owners``: parameter indices per shard,
    and ``shards_of``: the shards holding each parameter, as the worker's
    :class:`~..layout.shard_layout.ShardLayout` maps them (``shard_assignment="split"``: a
    parameter cut into pieces is in several shards).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        owners: Sequence[Sequence[int]],
        shards_of: Mapping[int, Sequence[int]],
        on_ready: Callable[[list[int]], None],
        owner: str,
    ) -> None:
        self.params, self.parts, self.owner = list(params), [list(p) for p in owners], owner
        self._on_ready = on_ready
        self._shards_of = shards_of
        self._handles: dict[int, Any] = {}
        self.sent: set[int] = set()  # shards pushed from a hook in this step
        self._seen: set[int] = set()  # parameters whose gradient accumulated in this step
        self._left: list[set[int]] = []
        self.reset()

    def reset(self) -> None:
        """Start a new step.  Trainability is re-read here: a parameter unfrozen since the
        last step gets its hook now, a frozen one no longer holds its shard back."""
        for i, p in enumerate(self.params):
            if p.requires_grad and i not in self._handles:
                self._handles[i] = p.register_post_accumulate_grad_hook(partial(self._hook, i))
        self._left = [{i for i in idx if self.params[i].requires_grad} for idx in self.parts]
        self._seen.clear()
        self.sent.clear()

    def _hook(self, i: int, param: torch.Tensor) -> None:
        if i in self._seen:
            raise RuntimeError(
                f"{self.owner}(overlap=True): the gradient of parameter {i} "
                f"{tuple(param.shape)} accumulated twice before step(); overlap pushes each "
                "shard as soon as its gradients are in, so several backward passes per step "
                "(gradient accumulation) need overlap=False"
            )
        self._seen.add(i)
        ready = []
        for k in self._shards_of[i]:
            left = self._left[k]
            left.discard(i)
            if not left and k not in self.sent:
                self.sent.add(k)
                ready.append(k)
        if ready:
            log.debug("%s: shards %s complete, pushing them now", self.owner, ready)
            self._on_ready(ready)

    def remove(self) -> None:
        """Remove the hooks (the optimizer closed)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}
