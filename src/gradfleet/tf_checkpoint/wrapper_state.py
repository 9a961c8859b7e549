"""The TF variables of the EASGD and model-averaging wrappers, as ``tf.contrib.opt`` kept them.

TF's ``ElasticAverageCustomGetter`` turns every trainable variable ``<name>`` into three:

* ``<name>``: the worker's own copy (a *local* variable: not in a default ``Saver``);
* ``global_center_variable/<name>``: the centre on the parameter server (global);
* ``local_center_variable/<name>``: the worker's cached centre from its last exchange (local);

and ``ElasticAverageOptimizer`` keeps ``local_step`` (int32, local) and moves the wrapped
optimizer's slots and non-slot variables to the local collection.  ``ModelAverageCustomGetter``
makes ``<name>`` (local) and ``global_center_variable/<name>`` (global, the last average);
``ModelAverageOptimizer`` keeps ``local_step`` (int32, local) and leaves the wrapped optimizer's
variables global.  Both advance ``global_step`` once per exchange (EASGD) or averaging round.

So a chief's default ``Saver`` writes the centres, ``global_step`` and (model averaging) the
wrapped optimizer's state; a ``Saver`` over global and local variables writes everything.
Loading follows TF's restart: what the checkpoint lacks comes from the centre as TF's init op
sets it (``<name> := centre``, ``local_center_variable/<name> := centre``), ``local_step``
restarts at 0 and the wrapped optimizer's missing variables start afresh.  Writing writes
everything.  gradfleet's model averaging keeps no separate global copy: the current parameters
are written as ``global_center_variable/<name>``, the value TF's restart copies into
``<name>`` (TF's next round overwrites its global copy before anything reads it).

TF's ``SyncReplicasOptimizer`` adds no global variables (``sync_rep_local_step`` is local;
accumulators and the token queue are not variables): its chief's checkpoint is the parameter
server's variables, the wrapped optimizer's and ``global_step``.  gradfleet's servers keep
their own copies of the variables and of the wrapped optimizer, so writing takes them from the
chief's server (one server; between steps) and loading refuses the wrapper: load the model and
the optimizer to wrap, then build the wrapper with ``global_step=``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from gradfleet.tf_checkpoint import names as _names
from gradfleet.tf_checkpoint.bundle import CheckpointReader

log = logging.getLogger(__name__)

GLOBAL_CENTRE = "global_center_variable"
LOCAL_CENTRE = "local_center_variable"
LOCAL_STEP = "local_step"


@dataclass
class SyncState:
    """What a ``SyncReplicasOptimizer`` rank writes: the optimizer the updates are applied
    with, the values of the variables (id of the worker's parameter -> the server's
    variable, keyed by which that optimizer's state is found) and ``global_step``."""

    optimizer: torch.optim.Optimizer
    served: dict[int, torch.Tensor]
    global_step: int


def _sync_wrapper(optimizer: torch.optim.Optimizer | None):
    """``optimizer`` if it is a ``SyncReplicasOptimizer``, else None."""
    if optimizer is None or not hasattr(optimizer, "optimizer"):
        return None
    from gradfleet.distributed.sync import SyncReplicasOptimizer

    return optimizer if isinstance(optimizer, SyncReplicasOptimizer) else None


def refuse_sync(optimizer: torch.optim.Optimizer | None) -> None:
    """A ``SyncReplicasOptimizer`` cannot be loaded into: its servers copied the variables and
    the optimizer state when they started (TypeError saying what to do instead)."""
    if _sync_wrapper(optimizer) is not None:
        raise TypeError(
            "load_tf_checkpoint: a SyncReplicasOptimizer's variables and optimizer state live on "
            "its servers, copied when it was built; load into the model and the optimizer to "
            "wrap before building it, and pass it global_step=<the loaded global_step>"
        )


def sync_state(optimizer: torch.optim.Optimizer | None) -> SyncState | None:
    """A ``SyncReplicasOptimizer``'s TF state (TF's chief saves the parameter server's
    variables, the wrapped optimizer's and ``global_step``): on the chief, its server's
    variables and optimizer copy; with ``transport="allreduce"``, this rank's own.  None for
    other optimizers; ValueError on a rank that does not hold them."""
    sync = _sync_wrapper(optimizer)
    if sync is None:
        return None
    applied = sync.applied_state()
    if applied is None:
        where = "one server" if sync.is_chief else f"the chief (rank {sync.server_rank})"
        raise ValueError(
            "save_tf_checkpoint: a SyncReplicasOptimizer's variables and optimizer state are "
            f"its servers'; write them on {where}: a sharded job's or another rank's are not "
            "written"
        )
    opt, variables, step = applied
    params = sync.params()
    return SyncState(opt, {id(params[i]): v for i, v in variables.items()}, step)


@dataclass
class CentreWrapper:
    """An EASGD (``elastic``) or model-averaging wrapper and its parameters' TF names."""

    wrapper: torch.optim.Optimizer
    elastic: bool
    # (parameter, torch name, TF name, transform), in the wrapper's parameter order
    params: list[tuple[torch.Tensor, str, str, _names.Transform]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "ElasticAverageOptimizer" if self.elastic else "ModelAverageOptimizer"


def centre_wrapper(
    optimizer: torch.optim.Optimizer | None, model: torch.nn.Module, name_map: _names.NameMap
) -> CentreWrapper | None:
    """``optimizer`` as a :class:`CentreWrapper` when it is an EASGD or model-averaging
    wrapper, else None (a plain optimizer, or SyncReplicas whose TF state is the chief's)."""
    if optimizer is None or not hasattr(optimizer, "optimizer"):
        return None
    # Imported here: the distributed package is not needed by plain checkpoints.
    from gradfleet.distributed.easgd import ElasticAverageOptimizer
    from gradfleet.distributed.wrappers.model_average import ModelAverageOptimizer

    if not isinstance(optimizer, (ElasticAverageOptimizer, ModelAverageOptimizer)):
        return None
    out = CentreWrapper(optimizer, isinstance(optimizer, ElasticAverageOptimizer))
    torch_names = {id(p): n for n, p in model.named_parameters()}
    for p in optimizer.params():
        torch_name = torch_names.get(id(p))
        entry = None if torch_name is None else _names.resolve(name_map, torch_name)
        if entry is not None:  # else reported (not in the model) or deliberately absent
            out.params.append((p, torch_name, *entry))
    return out


def restore_view(reader: CheckpointReader, cw: CentreWrapper) -> tuple[CheckpointReader, bool]:
    """``reader``, with each local variable the checkpoint lacks read from its centre (TF's
    init op after a restore); and whether the checkpoint holds the worker's local variables."""
    local_names = [tf for _, _, tf, _ in cw.params] + [LOCAL_STEP]
    if any(n in reader.shapes for n in local_names):
        log.info("%s: has the worker's local variables; loading them", reader.prefix)
        return reader, True
    keys = {n: n for n in reader.names()}
    for _, _, tf, _ in cw.params:
        centre = f"{GLOBAL_CENTRE}/{tf}"
        if centre in reader.shapes:
            keys[tf] = centre
            if cw.elastic:
                keys[f"{LOCAL_CENTRE}/{tf}"] = centre
    log.info(
        "%s: no local variables of the %s (a default Saver's checkpoint): parameters%s start "
        "at the centre, local_step at 0, missing optimizer variables afresh, as TF's restart",
        reader.prefix,
        cw.kind,
        " and local centres" if cw.elastic else "",
    )
    return reader.view(keys), False


def plan_wrapper(plan, cw: CentreWrapper) -> Callable[[int | None], None]:
    """Claim the wrapper's variables in ``plan`` (a ``convert._Plan``); returns the step that
    sets the wrapper's centre and counters once the copies are done (given ``global_step``)."""
    centre: list[torch.Tensor | None] = [None] * len(cw.params)
    local_centre = cw.wrapper.local_centre() if cw.elastic else []
    index = {id(p): i for i, p in enumerate(cw.wrapper.params())}
    for k, (p, torch_name, tf, transform) in enumerate(cw.params):

        def keep(value, k=k):
            centre[k] = value

        plan.claim(
            f"{GLOBAL_CENTRE}/{tf}", transform, p.shape, p.dtype, f"{torch_name} centre", keep
        )
        if cw.elastic:
            target = local_centre[index[id(p)]]

            def into(value, t=target):
                t.copy_(value)

            what = f"{torch_name} local centre"
            plan.claim(f"{LOCAL_CENTRE}/{tf}", transform, p.shape, p.dtype, what, into)
    step_name = _plan_local_step(plan)

    def finish(global_step: int | None) -> None:
        if cw.elastic and len(cw.params) == len(index):
            cw.wrapper._strategy.load_state_dict({"centre": centre})
        elif cw.elastic:  # some parameters are not in the checkpoint: keep their centre
            values = [c.detach().clone() for c in cw.wrapper.centre()]
            for (p, *_), value in zip(cw.params, centre, strict=True):
                values[index[id(p)]] = value
            cw.wrapper._strategy.load_state_dict({"centre": values})
        local_step = int(plan.reader.get(step_name)) if step_name else 0
        cw.wrapper.local_step = local_step
        cw.wrapper.global_step = int(global_step or 0)
        log.info(
            "%s loaded: local_step %d, global_step %d",
            cw.kind,
            local_step,
            cw.wrapper.global_step,
        )

    return finish


def _plan_local_step(plan) -> str | None:
    if LOCAL_STEP not in plan.reader.shapes:
        return None
    plan.claimed.add(LOCAL_STEP)
    shape, dtype = plan.reader.shapes[LOCAL_STEP], plan.reader.dtypes[LOCAL_STEP]
    if shape != ():
        plan.problems["shape mismatch"].append(f"{LOCAL_STEP} {list(shape)} vs a scalar")
    elif not np.issubdtype(dtype, np.integer):
        plan.problems["dtype mismatch"].append(f"{LOCAL_STEP} {dtype} vs an integer")
    else:
        return LOCAL_STEP
    return None


def wrapper_tensors(cw: CentreWrapper) -> dict[str, tuple[str, torch.Tensor]]:
    """TF name -> (what, torch-layout tensor in TF's layout) of the wrapper's own variables."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    index = {id(p): i for i, p in enumerate(cw.wrapper.params())}
    centre = cw.wrapper.centre() if cw.elastic else None
    for p, torch_name, tf, transform in cw.params:
        value = centre[index[id(p)]] if centre is not None else p
        out[f"{GLOBAL_CENTRE}/{tf}"] = (f"{torch_name} centre", transform.to_tf(value.detach()))
        if cw.elastic:
            local = cw.wrapper.local_centre()[index[id(p)]]
            out[f"{LOCAL_CENTRE}/{tf}"] = (f"{torch_name} local centre", transform.to_tf(local))
    out[LOCAL_STEP] = ("local_step", torch.tensor(cw.wrapper.local_step, dtype=torch.int32))
    return out
