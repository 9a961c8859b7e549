"""Write a torch model + gradfleet optimizer as a TF checkpoint that TF's ``Saver`` restores
into the TF graph the name map describes (same names, slots and non-slot variables as the
TF optimizer creates; see :mod:`.slot_names`).  Every parameter the map writes gets its slots,
those not created yet with the values its first step would create them with, as TF's graph
has them from the start."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch

from gradfleet.tf_checkpoint import names as _names
from gradfleet.tf_checkpoint import slot_names as _slots
from gradfleet.tf_checkpoint import wrapper_state as _wrapper
from gradfleet.tf_checkpoint.bundle import Progress, write_checkpoint
from gradfleet.tf_checkpoint.convert import GLOBAL_STEP, _inner


def tf_tensors(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    name_map: _names.NameMap = None,
    *,
    global_step: int | torch.Tensor | None = None,
    non_slot_names: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """TF name -> array of everything :func:`save_tf_checkpoint` writes."""
    out: dict[str, np.ndarray] = {}
    owner: dict[str, str] = {}

    def put(tf_name: str, what: str, value: torch.Tensor) -> None:
        if tf_name in out:
            raise ValueError(f"name_map: {what} and {owner[tf_name]} both map to {tf_name!r}")
        owner[tf_name] = what
        out[tf_name] = value.detach().cpu().numpy().copy()

    opt = _inner(optimizer)
    sync = _wrapper.sync_state(optimizer)
    served = {} if sync is None else sync.served
    if sync is not None:  # the variables and the optimizer the updates were applied with
        opt = sync.optimizer
    by_param: dict[int, tuple[str, _names.Transform, str]] = {}
    for torch_name, tensor in model.state_dict(keep_vars=True).items():
        entry = _names.resolve(name_map, torch_name)
        if entry is not None:
            value = served.get(id(tensor), tensor)
            put(entry[0], torch_name, entry[1].to_tf(value.detach()))
            by_param[id(value)] = (*entry, torch_name)
    step = None if global_step is None else int(global_step)
    if opt is not None:
        step = _put_optimizer(opt, by_param, put, dict(non_slot_names or {}), step)
    if sync is not None:
        if step is not None and step != sync.global_step:
            raise ValueError(
                f"global_step={step} disagrees with the SyncReplicasOptimizer's global_step "
                f"{sync.global_step} (TF's global_step, which it advances)"
            )
        step = sync.global_step
    centres = _wrapper.centre_wrapper(optimizer, model, name_map)
    if centres is not None:
        for tf_name, (what, value) in _wrapper.wrapper_tensors(centres).items():
            put(tf_name, what, value)
        counted = int(centres.wrapper.global_step)
        if step is not None and step != counted:
            raise ValueError(
                f"global_step={step} disagrees with the {centres.kind}'s global_step {counted} "
                f"(TF's global_step, which it advances)"
            )
        step = counted
    if step is not None:
        name = (non_slot_names or {}).get(GLOBAL_STEP, GLOBAL_STEP)
        put(name, "global_step", torch.tensor(step, dtype=torch.int64))
    return out


def _put_optimizer(opt, by_param, put, non_slot_names, step):
    # position in RETURNN's var_list; by identity (list.index would compare tensors)
    position = {id(p): i for i, p in enumerate(q for g in opt.param_groups for q in g["params"])}
    for group in opt.param_groups:
        suffixes = _slots.slot_suffixes(opt, group)
        fills = opt._slot_fills(group)
        for p in group["params"]:
            if id(p) not in by_param:
                continue
            tf_name, transform, torch_name = by_param[id(p)]
            if _slots.is_amsgrad(opt):
                names = _slots.amsgrad_names(position[id(p)])
            else:
                names = {s: f"{tf_name}/{suffix}" for s, suffix in suffixes.items()}
            # A parameter that has had no gradient yet gets the slots TF's graph creates for
            # it (its Saver restores every slot variable of the graph, or refuses the file):
            # the values its first step here would create them with.
            state = opt.state.get(p) or {}
            for slot, name in names.items():
                value = state[slot] if slot in state else torch.full_like(p, fills[slot])
                put(name, f"{torch_name} slot {slot}", transform.to_tf(value.detach()))
    keys = sorted({k for group in opt.param_groups for k in group["non_slot"]})
    for key in keys:
        values = [g["non_slot"][key] for g in opt.param_groups if key in g["non_slot"]]
        if any(not torch.equal(values[0].cpu(), v.cpu()) for v in values[1:]):
            raise ValueError(
                f"optimizer: param groups hold different {key!r} values; TF keeps one per optimizer"
            )
        if key == "step":  # AdagradDA's own step count is TF's global_step
            if step is not None and step != int(values[0]):
                raise ValueError(
                    f"global_step={step} disagrees with AdagradDA's step count "
                    f"{int(values[0])}; TF's AdagradDA reads T = global_step + 1"
                )
            step = int(values[0])
            continue
        name = non_slot_names.get(key, _slots.NON_SLOT_NAMES[key])
        put(name, f"non-slot {key}", values[0])
    if getattr(opt, "_global_step", None) is not None and step is None:
        step = int(opt._global_step)  # AdagradDA given the caller's global_step tensor
    return step


def save_tf_checkpoint(
    prefix: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    name_map: _names.NameMap = None,
    *,
    global_step: int | torch.Tensor | None = None,
    non_slot_names: Mapping[str, str] | None = None,
    progress: Progress | None = None,
) -> str:
    """Write ``model`` (and ``optimizer``'s slots and non-slot variables) as the TF
    checkpoint ``prefix`` (``PREFIX.index`` + ``PREFIX.data-00000-of-00001`` + the
    directory's ``checkpoint`` file); returns the absolute prefix.  ``name_map`` is the one
    :func:`load_tf_checkpoint` takes; ``global_step`` is written as TF's int64 ``global_step``
    (AdagradDA's step count, or an EASGD / model-averaging wrapper's, is written there without
    it).  A wrapper's own variables are written under TF's names (see :mod:`.wrapper_state`);
    a ``SyncReplicasOptimizer``'s state is its chief's (written on the chief, between steps)."""
    tensors = tf_tensors(
        model, optimizer, name_map, global_step=global_step, non_slot_names=non_slot_names
    )
    return write_checkpoint(prefix, tensors, progress)
