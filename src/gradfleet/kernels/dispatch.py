"""Choosing and running an implementation for the dense gradients of one param group.

``group["foreach"]`` / ``group["fused"]`` follow ``torch.optim``:

* ``fused=True``: one compiled kernel per (device, dtype) bucket (``fused.py``);
* ``foreach=True``: ``TensorList`` maths over ``torch._foreach_*`` per bucket;
* ``foreach=False`` (and fused not True): the per-parameter reference loop;
* both ``None`` (the default): the loop on CPU, the fused path on CUDA.  On CPU the loop
  is measured faster than foreach (``_foreach_*`` runs the same per-tensor ATen kernels plus
  list overhead; benchmarks/optimizers/optimizer_speed.py: Adam 52 vs 69 ms on 16.8M
  parameters).  On CUDA foreach is a launch and a pass over memory per operation of the maths
  (Adam: 12, four times torch's fused Adam's time on an H200) where the fused kernel reads and
  writes each tensor once (0.92x torch's fused Adam); its price is a compile on the first step
  (seconds, cached on disk by inductor for later processes).  CUDA stays on foreach where the
  fused kernel would not keep eager CUDA's numbers or cannot compile
  (``_torch_private.fused_by_default_on_cuda``: no Triton for the GPU, torch 2.8's
  approximate division), for groups with parameters on other devices too, for optimizers
  without a fused path, and under ``torch.compile``, which fuses the foreach maths itself.

Sparse gradients never reach this module: the base class sends them to ``_apply_sparse``.

DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): the loop and foreach paths
run the maths on the DTensors themselves, so a whole-tensor reduction is global across
shards as in the unsharded run.  The fused path compiles for plain dense tensors only: each
DTensor goes through its local shard (``kernels/dtensor.py``), and an optimizer whose maths
reduces over the whole tensor gets the global value computed before the kernel.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from gradfleet.kernels import _torch_private as private
from gradfleet.kernels import dtensor
from gradfleet.kernels.fused import run_fused
from gradfleet.kernels.tensorlist import TensorList

PATHS = ("loop", "foreach", "fused")
# Bucket size cap for the foreach path: its temporaries span a whole bucket, so chunking
# bounds the step's peak extra memory to a few times this, whatever the model size.
FOREACH_CHUNK_BYTES = 64 * 2**20


def resolve_path(opt: Any, group: dict[str, Any]) -> str:
    """The implementation for the dense gradients of ``group`` (one of ``PATHS``)."""
    foreach, fused = group.get("foreach"), group.get("fused")
    owner = type(opt).__name__
    if foreach and fused:
        raise RuntimeError(f"{owner}: `fused` and `foreach` cannot be `True` together.")
    supported = getattr(opt, "fast_paths", ("foreach", "fused"))
    wanted = "fused" if fused else "foreach" if foreach else None
    if wanted is not None:
        if wanted not in supported:
            raise RuntimeError(f"{owner} does not support {wanted}=True (fast_paths={supported})")
        return wanted
    if foreach is False or "foreach" not in supported:
        return "loop"
    on_cuda = [p.is_cuda for p in group["params"]]
    if not any(on_cuda):
        return "loop"
    if (
        fused is None
        and "fused" in supported
        and all(on_cuda)
        and not torch.compiler.is_compiling()
        and private.fused_by_default_on_cuda()
    ):
        return "fused"
    return "foreach"


def buckets(params: list[torch.Tensor]) -> dict[Any, list[int]]:
    """Parameter indices grouped by (device, dtype), in parameter order."""
    out: dict[Any, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        out[(p.device, p.dtype)].append(i)
    return out


def apply_dense(
    opt: Any, group: dict[str, Any], params, grads, hp_for, path: str, record=None
) -> None:
    """Run ``opt._apply_dense`` for dense ``params``/``grads`` of ``group`` on ``path``.

    ``record`` (fused path only): a list that gets one ``(compiled, params, slot names,
    constants_key, (device, dtype))`` per kernel call (``fused.run_fused``), or a None
    entry where a bucket ran through DTensor shards (``kernels/plan.py`` cannot replay
    such a step)."""
    shared = opt._shared_state(group)
    if path == "fused":  # before any bucket runs: a refused step changes nothing
        dtensor.check_plain(opt, params, grads, dtensors=True)
    for (device, dtype), idx in buckets(params).items():
        ps = [params[i] for i in idx]
        gs = [grads[i] for i in idx]
        slots = opt._slots_of(ps, group)
        names = list(slots[0]) if slots else []
        hp = hp_for(dtype, device)
        if path == "fused":
            calls = [] if record is not None else None
            _apply_fused(opt, ps, gs, slots, names, hp, shared, calls)
            if record is not None:
                record.extend(c and (*c, (device, dtype)) for c in calls)
            continue
        for chunk in _chunks(ps):
            lists = {n: TensorList(slots[j][n] for j in chunk) for n in names}
            opt._apply_dense(
                TensorList(ps[j] for j in chunk),
                TensorList(gs[j] for j in chunk),
                lists,
                hp,
                shared,
            )


def _apply_fused(opt, ps, gs, slots, names, hp, shared, record=None) -> None:
    """One bucket on the fused path; DTensors run through their local shards."""
    table = {n: [s[n] for s in slots] for n in names}
    # apply_dense's check_plain let through plain tensors and DTensors only
    if dtensor.all_plain((*ps, *gs)):
        work = [(ps, gs, table, shared)]
    else:
        work = dtensor.local_work(opt, ps, gs, table, shared)
        if record is not None:
            record.append(None)  # shards: no replay
            record = None
        for params, grads, _, _ in work:  # to_local() must leave no subclass for the kernel
            dtensor.check_plain(opt, params, grads)
    for params, grads, slot_table, extra_shared in work:
        keep = [j for j, p in enumerate(params) if p.numel()]  # empty: nothing to do
        if keep:
            args = (
                [params[j] for j in keep],
                [grads[j] for j in keep],
                {n: [ts[j] for j in keep] for n, ts in slot_table.items()},
            )
            run_fused(opt, *args, hp, extra_shared, record)


def _chunks(params: list[torch.Tensor]) -> list[list[int]]:
    out: list[list[int]] = [[]]
    size = 0
    for j, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if out[-1] and size + nbytes > FOREACH_CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(j)
        size += nbytes
    return [c for c in out if c]
