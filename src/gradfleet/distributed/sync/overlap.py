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
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

__all__ = ["OverlappedPushes", "ShardReadiness"]

log = logging.getLogger(__name__)


class ShardReadiness:
    """Which shards' gradients are complete in this step; calls ``on_ready(shards)`` with the
    shards that one parameter's gradient completed (each shard once per step: when its
    trainable parameters have all accumulated their gradient).  Together, so that they go out
    in the worker's push order rather than in the order the hook found them.

    ``params``: the optimizer's parameters in order; ``parts``: parameter indices per shard
    (``shard_assignment="split"``: a parameter cut into pieces appears in several shards).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        parts: Sequence[Sequence[int]],
        on_ready: Callable[[list[int]], None],
        owner: str,
    ) -> None:
        self.params, self.parts, self.owner = list(params), [list(p) for p in parts], owner
        self._on_ready = on_ready
        self._shards_of: dict[int, list[int]] = {}  # split: a parameter feeds several shards
        for k, idx in enumerate(self.parts):
            for i in set(idx):
                self._shards_of.setdefault(i, []).append(k)
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

    @property
    def started(self) -> bool:
        """Did any gradient accumulate since the last :meth:`reset`?"""
        return bool(self._seen)

    def remove(self) -> None:
        """Remove the hooks (the optimizer closed)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}


class OverlappedPushes:
    """``SyncReplicasOptimizer``'s side of overlap (a mixin over its links): the hook's push
    of a complete shard, and the step that pushes what backward did not."""

    local_step: int
    worker: int
    _links: Any
    _hyper: Any
    _readiness: ShardReadiness | None
    _step_extra: dict[str, Any] | None
    _parts: list[list[int]]
    _pieces: list[Any]
    params: Callable[[], list[torch.Tensor]]
    _shard_grads: Callable[..., list[torch.Tensor | None]]
    _grad_parts: Callable[..., list[list[torch.Tensor | None]]]
    _finish_step: Callable[[int, bool], bool | None]
    wait_reads: Callable[[], None]
    streaming: bool

    def _extra(self) -> dict[str, Any]:
        """What every push of this step carries (changed hyperparameters), decided once."""
        if self._step_extra is None:
            hyper = self._hyper.changed()
            self._step_extra = {} if hyper is None else {"hyper": hyper}
        return self._step_extra

    def _push_early(self, shards: list[int]) -> None:
        """A gradient hook found ``shards`` complete: push them now (shard 0 with the token
        request).  The answers are taken from ``step()`` on; with streamed reads at once, so
        these shards' values may land while backward computes the earlier layers."""
        if self._links is None:
            return  # closed: the step will say so
        self.wait_reads()  # the last step's streamed reads use the links and the parameters
        params = self.params()
        jobs = {}
        for k in shards:
            whole: list[torch.Tensor | None] = [None] * len(params)
            for j in self._parts[k]:  # only this shard's parameters: once per shard and step
                g = params[self._pieces[j].index].grad
                whole[self._pieces[j].index] = None if g is None else g.detach()
            jobs[k] = self._shard_grads(k, whole)
        self._links.push_early(jobs, self.local_step, self._extra())
        if self.streaming and self._links.ahead:
            # backward is done with these parameters (their gradients are in, so every node
            # that saved them has run): their new values may land now, before step()
            self._links.start_taking()

    def _overlapped_step(self, grads: list[torch.Tensor | None]) -> bool | None:
        """Push the shards backward did not complete (``grads``), then the token and read.
        No bad-input tagging here: ``check_overlap`` allows overlap only where each shard
        judges its own gradients (one shard, or ``nonfinite="apply"``)."""
        assert self._links is not None and self._readiness is not None
        tag, sent = self.local_step, self._readiness.sent
        log.debug("worker rank %d: shards %s pushed during backward", self.worker, sorted(sent))
        parts = self._grad_parts(grads)
        rest = {k: part for k, part in enumerate(parts) if k not in sent}
        if self._links.ahead:  # backward is over: the answers may be taken (in place) now
            self._links.start_taking()
            if rest:  # several shards: paced, in push order, as the others
                self._links.push_early(rest, tag, self._extra())
        elif 0 in rest:  # one server: its gradients travel with the token request
            self._links.carry(rest[0], self._extra())
        self._links.settle_pushes()
        return self._finish_step(tag, True)
