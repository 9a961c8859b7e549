"""``replicate_model``: one process, several devices, one tower per device (TF
``replicate_model_fn``).

``replicate_model(model_fn, module, loss_reduction, devices)`` returns a callable
``rm(features, labels)`` that, with ``T = len(devices) > 1``:

1. splits every tensor in ``features`` / ``labels`` (tensors, dicts, lists, tuples) on dim 0 into
   ``T`` equal shards (``ValueError`` if the batch is not divisible by ``T``);
2. copies the shared parameters and buffers of ``module`` into each tower's replica;
3. runs ``model_fn(tower_module, features_t, labels_t) -> loss`` for all towers in parallel
   threads, where :class:`TowerOptimizer` records the optimizer calls;
4. checks that every tower made the same optimizer calls, merges the ``k``-th call of every tower
   (gradients summed onto the shared parameter's device) and applies it once;
5. copies the updated parameters back into every replica (and the last tower's buffers into
   ``module``), so all towers stay identical.

It returns :class:`TowerOutput` with ``loss`` = the sum of the tower losses, each scaled by
``1/T`` unless ``loss_reduction == "sum"``. With one device ``model_fn`` runs unchanged on
``module`` (no split, no scaling). ``module`` holds the one shared copy of every parameter (TF's
variables on the consolidation device); a tower on the module's own device uses it directly.

TF argument mapping: ``loss_reduction`` takes TF's ``tf.losses.Reduction`` names in lower case
(``"sum"``, ``"mean"``, ``"sum_over_batch_size"``, ``"sum_by_nonzero_weights"`` (default),
``"sum_over_nonzero_weights"``; ``"none"`` is rejected); ``devices=None`` means every local GPU, or
the CPU when there is none. TF's EVAL metric merging and PREDICT concatenation are not ported.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .towers import TowerContext, _enter_tower
from .wrapper import GradsAndVars

__all__ = ["replicate_model", "ReplicatedModel", "TowerOutput", "split_batch", "REDUCTIONS"]

REDUCTIONS = (
    "none",
    "sum",
    "mean",
    "sum_over_batch_size",
    "sum_by_nonzero_weights",
    "sum_over_nonzero_weights",
)


class TowerOutput(NamedTuple):
    loss: torch.Tensor | None
    tower_losses: list[Any]


def split_batch(x: Any, num_towers: int) -> list[Any]:
    """Split ``x`` on dim 0 into ``num_towers`` equal shards (nested dicts/lists/tuples)."""
    if isinstance(x, torch.Tensor):
        if x.is_sparse:
            raise ValueError("replicate_model: sparse input tensors cannot be split")
        size = x.shape[0] if x.dim() > 0 else None
        if size is None or size % num_towers != 0:
            raise ValueError(
                f"Batch size {size} needs to be divisible by the number of devices, which is "
                f"{num_towers}."
            )
        return list(torch.chunk(x, num_towers, dim=0))
    if isinstance(x, dict):
        per_key = {k: split_batch(v, num_towers) for k, v in x.items()}
        return [{k: v[t] for k, v in per_key.items()} for t in range(num_towers)]
    if isinstance(x, (list, tuple)):
        parts = [split_batch(v, num_towers) for v in x]
        return [type(x)(p[t] for p in parts) for t in range(num_towers)]
    return [x] * num_towers  # None, numbers, strings: shared by every tower


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        # Asynchronous only towards a GPU, where the copy is ordered before the tower's
        # kernels on the same stream; a non-blocking copy to the CPU may be read unfinished.
        return x.to(device, non_blocking=device.type == "cuda")
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


def _merge(calls: list[GradsAndVars]) -> GradsAndVars:
    """Per shared variable, sum the towers' gradients (sparse: concatenate), dropping None."""
    grads: dict[int, list[torch.Tensor]] = {}
    owner: dict[int, torch.Tensor] = {}
    for pairs in calls:
        for g, v in pairs:
            owner.setdefault(id(v), v)
            if g is not None:
                grads.setdefault(id(v), []).append(g.to(v.device))
    out: GradsAndVars = []
    for key, v in owner.items():
        gs = grads.get(key)
        if gs:
            out.append((_sum_grads(gs), v))
    return out


def _sum_grads(gs: list[torch.Tensor]) -> torch.Tensor:
    if len(gs) == 1:
        return gs[0]
    if all(g.is_sparse for g in gs):
        indices = torch.cat([g._indices() for g in gs], dim=1)
        values = torch.cat([g._values() for g in gs], dim=0)
        return torch.sparse_coo_tensor(indices, values, gs[0].shape, check_invariants=False)
    total = gs[0].to_dense() if gs[0].is_sparse else gs[0].clone()
    for g in gs[1:]:
        total = total + (g.to_dense() if g.is_sparse else g)
    return total


class ReplicatedModel:
    """Callable returned by :func:`replicate_model`; see the module docstring."""

    def __init__(
        self,
        model_fn: Callable[..., Any],
        module: nn.Module,
        loss_reduction: str,
        devices: Sequence[str | torch.device],
    ) -> None:
        self.model_fn = model_fn
        self.module = module
        self.loss_reduction = loss_reduction
        self.devices = [_canonical(torch.device(d)) for d in devices]
        same = [i for i, d in enumerate(self.devices) if _same_device(d, self.home)]
        self.shared_tower = same[-1] if same else None
        self.towers = [
            module if i == self.shared_tower else self._replica(d)
            for i, d in enumerate(self.devices)
        ]

    @property
    def home(self) -> torch.device:
        """Where the one shared copy of every parameter lives (the consolidation device)."""
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    @property
    def num_towers(self) -> int:
        return len(self.devices)

    def _replica(self, device: torch.device) -> nn.Module:
        replica = copy.deepcopy(self.module).to(device)
        for p in replica.parameters():
            p.grad = None
        return replica

    def sync_towers(self) -> None:
        """Copy ``module``'s parameters and buffers into every replica."""
        with torch.no_grad():
            for tower in self.towers:
                if tower is self.module:
                    continue
                for src, dst in zip(self.module.parameters(), tower.parameters(), strict=True):
                    dst.copy_(src)
                for src, dst in zip(self.module.buffers(), tower.buffers(), strict=True):
                    dst.copy_(src)

    def _context(self) -> TowerContext:
        shared = list(self.module.parameters())
        tower_params, shared_params = [], []
        for tower in self.towers:
            local = list(tower.parameters())
            tower_params.append({id(s): t for s, t in zip(shared, local, strict=True)})
            shared_params.append({id(t): s for s, t in zip(shared, local, strict=True)})
        return TowerContext(
            num_towers=self.num_towers,
            scale_loss=self.loss_reduction != "sum",
            tower_params=tower_params,
            shared_params=shared_params,
        )

    def __call__(self, features: Any = None, labels: Any = None, *, train: bool = True):
        """Run one replicated step; returns :class:`TowerOutput`."""
        if self.num_towers == 1:
            home = next((p.device for p in self.module.parameters()), self.devices[0])
            loss = self.model_fn(self.module, _to_device(features, home), _to_device(labels, home))
            return TowerOutput(loss, [loss])
        f_shards = split_batch(features, self.num_towers)
        l_shards = split_batch(labels, self.num_towers)
        self.sync_towers()
        ctx = self._context()
        losses = self._run_towers(ctx, f_shards, l_shards)
        self._apply(ctx, train)
        self._finish()
        return TowerOutput(self._total_loss(losses, ctx), losses)

    def _run_towers(self, ctx: TowerContext, f_shards: list, l_shards: list) -> list[Any]:
        results: list[Any] = [None] * self.num_towers
        errors: list[BaseException | None] = [None] * self.num_towers
        grad_mode = torch.is_grad_enabled()

        def body(t: int) -> None:
            _enter_tower(ctx, t)
            try:
                dev = self.devices[t]
                with torch.set_grad_enabled(grad_mode), _device_scope(dev):
                    results[t] = self.model_fn(
                        self.towers[t], _to_device(f_shards[t], dev), _to_device(l_shards[t], dev)
                    )
            except BaseException as exc:  # re-raised in the caller's thread
                errors[t] = exc
            finally:
                _enter_tower(None, 0)

        threads = [threading.Thread(target=body, args=(t,)) for t in range(self.num_towers)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for t, exc in enumerate(errors):
            if exc is not None:
                raise RuntimeError(f"replicate_model: tower {t} failed: {exc}") from exc
        return results

    def _apply(self, ctx: TowerContext, train: bool) -> None:
        if not train:
            if ctx.calls:
                raise ValueError("replicate_model: optimizer calls need train=True")
            return
        if not ctx.calls:
            raise ValueError(
                "Please wrap optimizers with TowerOptimizer in order to use replicate_model "
                "with multiple `devices`."
            )
        for _opt, per_tower in ctx.calls.values():
            if len({len(c) for c in per_tower}) != 1:
                raise ValueError(
                    "Each invocation of model_fn was supposed to make the same optimizer calls."
                )
        # On the shared parameters' device: kernels launched without a device argument (an
        # optimizer's scalars, a fused step) must land where the parameters are.
        with _device_scope(self.home):
            for key, k in ctx.last_order:
                opt, per_tower = ctx.calls[key]
                merged = _merge([calls[k][0] for calls in per_tower])
                opt._apply_now(merged, per_tower[-1][k][1])

    def _finish(self) -> None:
        last = self.towers[-1]
        if last is not self.module:  # buffers (e.g. BatchNorm statistics) follow the last tower
            with torch.no_grad():
                for dst, src in zip(self.module.buffers(), last.buffers(), strict=True):
                    dst.copy_(src)
        self.sync_towers()

    def _total_loss(self, losses: list[Any], ctx: TowerContext) -> torch.Tensor | None:
        if not all(isinstance(x, torch.Tensor) for x in losses):
            return None
        home = self.home
        scaled = [x.to(home) / self.num_towers if ctx.scale_loss else x.to(home) for x in losses]
        return torch.stack([s.reshape(()) for s in scaled]).sum()


def _canonical(device: torch.device) -> torch.device:
    """``cuda`` as the GPU it means now (the current device), so that two towers named
    ``cuda`` and ``cuda:0`` are recognised as one device and each replica has an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        return (a.index or 0) == (b.index or 0)
    return True


def _device_scope(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def replicate_model(
    model_fn: Callable[..., Any],
    module: nn.Module,
    loss_reduction: str = "sum_by_nonzero_weights",
    devices: Sequence[str | torch.device] | None = None,
) -> ReplicatedModel:
    """Replicate ``module`` over ``devices`` and run ``model_fn`` as towers (TF's
    ``replicate_model_fn``). See the module docstring for the algorithm."""
    if not callable(model_fn):
        raise TypeError("replicate_model: model_fn must be callable (module, features, labels)")
    if not isinstance(module, nn.Module):
        raise TypeError(f"replicate_model: module must be an nn.Module, got {type(module)}")
    reduction = str(loss_reduction).lower()
    if reduction not in REDUCTIONS:
        raise ValueError(f"replicate_model: loss_reduction must be one of {REDUCTIONS}")
    if reduction == "none":
        raise ValueError(
            "Tower losses need to be reduced in some way, yet none reduction is specified."
        )
    if devices is None:
        n = torch.cuda.device_count()
        devices = [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    devices = list(devices)
    if not devices:
        raise ValueError("replicate_model: devices must name at least one device")
    return ReplicatedModel(model_fn, module, reduction, devices)
