"""Load a TF checkpoint into a torch model + gradfleet optimizer, and write one back.

Everything is checked before anything changes: names the map asks for that the checkpoint
lacks, checkpoint variables nothing claims, shape and dtype mismatches, partial or absent slot
sets and another optimizer's slots are collected into ONE :class:`CheckpointMismatch`, and
then nothing is loaded.  A parameter without any slot in the checkpoint is refused, as TF's
``Saver`` refuses a checkpoint without the slot variables its graph has, unless the caller
names it in ``fresh_slots``.  Where TF's graph (``PREFIX.meta``) is next to the checkpoint,
the optimizer must be the one the graph trains with, and hyperparameters that differ from the
graph's are named in a :class:`GraphHyperparametersWarning`.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from gradfleet.tf_checkpoint import graph_hyperparameters as _graph
from gradfleet.tf_checkpoint import names as _names
from gradfleet.tf_checkpoint import object_graph as _object_graph
from gradfleet.tf_checkpoint import slot_names as _slots
from gradfleet.tf_checkpoint import wrapper_state as _wrapper
from gradfleet.tf_checkpoint.bundle import CheckpointReader, Progress

GLOBAL_STEP = "global_step"

log = logging.getLogger(__name__)


class GraphHyperparametersWarning(UserWarning):
    """The optimizer's hyperparameters differ from those TF's graph (``PREFIX.meta``) trained
    with: the loaded run continues with other values than TF's."""


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit the model/optimizer; ``problems`` lists every misfit."""

    def __init__(self, prefix: str, problems: dict[str, list[str]]) -> None:
        self.problems = {k: v for k, v in problems.items() if v}
        lines = [f"TF checkpoint {prefix!r} does not fit; nothing was loaded:"]
        for kind, items in self.problems.items():
            lines.append(f"  {kind} ({len(items)}): " + "; ".join(items))
        super().__init__("\n".join(lines))


@dataclass
class LoadedCheckpoint:
    """What :func:`load_tf_checkpoint` read: the checkpoint's ``global_step`` (None if it has
    none) and the TF names it used."""

    prefix: str
    global_step: int | None
    used: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    reader: CheckpointReader
    problems: dict[str, list[str]]
    claimed: set[str] = field(default_factory=set)
    # (tf name, transform, destination setter)
    copies: list[tuple[str, _names.Transform, Callable[[torch.Tensor], None]]] = field(
        default_factory=list
    )
    # run after the copies: non-slot variables a restarted TF worker re-initialises
    resets: list[Callable[[], None]] = field(default_factory=list)

    def claim(self, tf_name, transform, target_shape, target_dtype, what, setter) -> bool:
        r = self.reader
        if tf_name not in r.shapes:
            self.problems["missing in the checkpoint"].append(f"{tf_name} (for {what})")
            return False
        self.claimed.add(tf_name)
        shape = _transformed_shape(transform, r.shapes[tf_name])
        if shape != tuple(target_shape):
            self.problems["shape mismatch"].append(
                f"{tf_name} {list(r.shapes[tf_name])}{_via(transform)} vs {what} "
                f"{list(target_shape)}"
            )
            return False
        dtype = _torch_dtype(r.dtypes[tf_name])
        if dtype != target_dtype:
            self.problems["dtype mismatch"].append(
                f"{tf_name} {r.dtypes[tf_name]} vs {what} {target_dtype}"
            )
            return False
        self.copies.append((tf_name, transform, setter))
        return True


def load_tf_checkpoint(
    prefix: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    name_map: _names.NameMap = None,
    *,
    ignore: Iterable[str] | Callable[[str], bool] = (),
    non_slot_names: Mapping[str, str] | None = None,
    global_step: torch.Tensor | None = None,
    progress: Progress | None = None,
    fresh_slots: Iterable[str] = (),
) -> LoadedCheckpoint:
    """Load the TF checkpoint ``prefix`` (or a directory: its latest) into ``model`` and
    ``optimizer``: parameters/buffers by ``name_map`` (see :mod:`.names`), each parameter's
    slots under TF's slot names (``<var>/Adam``, ``<var>/Adam_1`` ...), the optimizer's
    non-slot variables (``beta1_power``, AdagradDA's step from ``global_step``, ...).

    A TF2 object-based checkpoint is read under TF1 names (``model/dense/kernel``,
    ``model/dense/kernel/Adam``; see :mod:`.object_graph`).  An EASGD or model-averaging
    wrapper as ``optimizer`` also gets its centres and counters (see :mod:`.wrapper_state`).

    ``ignore``: checkpoint names (or a predicate) that are deliberately not loaded;
    ``non_slot_names``: gradfleet non-slot key -> TF name, where the last-component lookup is
    ambiguous; ``global_step``: a 0-dim int64 tensor that receives the checkpoint's
    ``global_step``; ``fresh_slots``: torch names of parameters (``"dense.bias"``) whose
    slots may be absent from the checkpoint, and then start afresh (as the optimizer creates
    them at the parameter's first gradient); any other parameter without its slots is refused,
    as TF's ``Saver`` refuses it.

    Where the checkpoint's TF graph (``PREFIX.meta``) is next to it, an optimizer that is not
    the one the graph trains the variables with is refused, and each hyperparameter that
    differs from the graph's (see :mod:`.graph_hyperparameters`) is named in a
    :class:`GraphHyperparametersWarning`.  Replaces the optimizer's whole state.  Not into a
    ``SyncReplicasOptimizer`` (TypeError): load the model and the optimizer to wrap, then
    build it with ``global_step=`` the loaded step.
    """
    _wrapper.refuse_sync(optimizer)
    opt = _inner(optimizer)
    reader = CheckpointReader(prefix)
    object_based = reader.object_graph() is not None
    if object_based:  # TF2 tf.train.Checkpoint: the same variables under TF1 names
        reader = _object_graph.tf1_view(reader, opt)
    centres = _wrapper.centre_wrapper(optimizer, model, name_map)
    locals_saved = True
    if centres is not None:
        reader, locals_saved = _wrapper.restore_view(reader, centres)
    plan = _Plan(reader, {k: [] for k in _PROBLEM_KINDS})
    tf_by_param = _plan_model(plan, model, name_map)
    fresh = _fresh_slot_names(model, opt, fresh_slots)
    graph_notes: list[str] = []
    if opt is not None:
        _plan_optimizer(plan, model, opt, tf_by_param, non_slot_names or {}, locals_saved, fresh)
        if not object_based:
            graph_notes = _check_graph(plan, opt, tf_by_param)
    finish_wrapper = _wrapper.plan_wrapper(plan, centres) if centres is not None else None
    step_name = _find(reader, GLOBAL_STEP, (non_slot_names or {}).get(GLOBAL_STEP))
    if step_name:
        plan.claimed.add(step_name)
    elif global_step is not None:
        plan.problems["missing in the checkpoint"].append(f"{GLOBAL_STEP} (for global_step)")
    skip = ignore if callable(ignore) else set(ignore).__contains__
    if object_based:  # tf.train.Checkpoint's count of its saves is nobody's state
        plan.claimed.add(_object_graph.SAVE_COUNTER)
    unused = sorted(n for n in reader.names() if n not in plan.claimed and not skip(n))
    plan.problems["unused checkpoint variables"] += unused
    if opt is not None:
        _name_other_optimizer(plan, opt, tf_by_param, unused)
    if any(plan.problems.values()):
        raise CheckpointMismatch(reader.prefix, plan.problems)
    if graph_notes:
        warnings.warn(
            f"load_tf_checkpoint: {type(opt).__name__}'s hyperparameters differ from those "
            f"TF's graph {_graph.meta_path(reader.prefix)} trained with, so the loaded run "
            f"does not continue TF's: {'; '.join(graph_notes)}",
            GraphHyperparametersWarning,
            stacklevel=2,
        )
    values = _read(plan, progress)
    step_value = int(reader.get(step_name)) if step_name else None
    with torch.no_grad():
        if opt is not None:
            opt.state.clear()
        for (_, transform, setter), value in zip(plan.copies, values):
            setter(transform.to_torch(value))
        for reset in plan.resets:
            reset()
        if finish_wrapper is not None:
            finish_wrapper(step_value)
        if global_step is not None:
            global_step.fill_(step_value)
    return LoadedCheckpoint(reader.prefix, step_value, sorted(plan.claimed))


_PROBLEM_KINDS = (
    "optimizer mismatch",
    "missing in the checkpoint",
    "unused checkpoint variables",
    "shape mismatch",
    "dtype mismatch",
    "no slots",
    "incomplete slots",
    "not in the model",
    "ambiguous",
)


def _plan_model(plan: _Plan, model: torch.nn.Module, name_map) -> dict[int, tuple]:
    """Plan the model's tensors; returns id(tensor) -> (tf name, transform, torch name, fits)."""
    out = {}
    for torch_name, tensor in model.state_dict(keep_vars=True).items():
        entry = _names.resolve(name_map, torch_name)
        if entry is None:
            continue
        tf_name, transform = entry

        def setter(value, t=tensor):
            t.copy_(value)

        ok = plan.claim(tf_name, transform, tensor.shape, tensor.dtype, torch_name, setter)
        if tf_name in plan.reader.shapes:  # its slots belong to it even when it misfits
            out[id(tensor)] = (tf_name, transform, torch_name, ok)
    return out


def _plan_optimizer(
    plan, model, opt, tf_by_param, non_slot_names, locals_saved=True, fresh=frozenset()
) -> None:
    param_names = {id(p): n for n, p in model.named_parameters()}
    # position in RETURNN's var_list; by identity (list.index would compare tensors)
    position = {id(p): i for i, p in enumerate(q for g in opt.param_groups for q in g["params"])}
    for group in opt.param_groups:
        suffixes = _slots.slot_suffixes(opt, group)
        for p in group["params"]:
            if id(p) not in param_names:
                plan.problems["not in the model"].append(
                    f"optimizer parameter of shape {list(p.shape)}"
                )
                continue
            if id(p) not in tf_by_param:
                continue  # not in the checkpoint by the map, or already reported
            tf_name, transform, torch_name, ok = tf_by_param[id(p)]
            if _slots.is_amsgrad(opt):
                names = _slots.amsgrad_names(position[id(p)])
            else:
                names = {s: f"{tf_name}/{suffix}" for s, suffix in suffixes.items()}
            present = [s for s, n in names.items() if n in plan.reader.shapes]
            if not ok:  # already reported; its slots are not "unused" on top
                plan.claimed.update(names[s] for s in present)
                continue
            if not present:
                # TF's Saver refuses a checkpoint without the slots of its graph; a variable
                # TF never updated has none, and its slots here start afresh only by name.
                if names and locals_saved and torch_name not in fresh:
                    plan.problems["no slots"].append(
                        f"{torch_name}: no {list(names.values())} (name it in fresh_slots to "
                        f"start them afresh)"
                    )
                continue
            if len(present) < len(names):
                absent = [n for s, n in names.items() if s not in present]
                plan.problems["incomplete slots"].append(f"{torch_name}: no {absent}")
                plan.claimed.update(names[s] for s in present)
                continue
            for slot, name in names.items():
                plan.claim(
                    name,
                    transform,
                    p.shape,
                    p.dtype,
                    f"{torch_name} slot {slot}",
                    _slot_setter(opt, p, slot),
                )
    keys = sorted({k for group in opt.param_groups for k in group["non_slot"]})
    for key in keys:
        base = _slots.NON_SLOT_NAMES[key]
        name = _find(plan.reader, base, non_slot_names.get(key), plan.problems)
        if name is None and not locals_saved:  # a wrapper moved them to TF's local variables
            log.info("%s: no %s; non-slot %s starts afresh", plan.reader.prefix, base, key)
            plan.resets.append(_reset_non_slot(opt, key))
            continue
        if name is None:
            if not plan.problems["ambiguous"]:
                plan.problems["missing in the checkpoint"].append(f"{base} (for non-slot {key})")
            continue
        tensors = [g["non_slot"][key] for g in opt.param_groups if key in g["non_slot"]]
        plan.claim(
            name,
            _names.IDENTITY,
            tensors[0].shape,
            tensors[0].dtype,
            f"non-slot {key}",
            _fill_all(tensors),
        )


def _fresh_slot_names(model, opt, fresh_slots: Iterable[str]) -> frozenset[str]:
    """``fresh_slots`` checked: each a parameter of ``model`` that ``opt`` updates."""
    fresh = frozenset([fresh_slots] if isinstance(fresh_slots, str) else fresh_slots)
    if not fresh:
        return fresh
    mine = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else set()
    known = {n for n, p in model.named_parameters() if id(p) in mine}
    unknown = sorted(fresh - known)
    if unknown:
        raise ValueError(
            f"fresh_slots: {unknown} are not parameters the optimizer updates; they are "
            f"{sorted(known)}"
        )
    return fresh


def _expected_slots(opt) -> str:
    """``"accum = <var>/Ftrl, linear = <var>/Ftrl_1"``: the slot names ``opt`` reads."""
    if _slots.is_amsgrad(opt):
        return "m, v, v_hat = Variable_{3i+1}, Variable_{3i+2}, Variable_{3i+3}"
    suffixes = _slots.slot_suffixes(opt, opt.param_groups[0]) if opt.param_groups else {}
    if not suffixes:
        return "no slots"
    return ", ".join(f"{slot} = <var>/{suffix}" for slot, suffix in suffixes.items())


def _default_names() -> dict[str, str]:
    """TF's default optimizer name (its slots' suffix) -> the gradfleet class name."""
    import inspect

    out = {}
    for cls in _slots.SLOT_ORDER:
        default = inspect.signature(cls.__init__).parameters.get("name")
        if default is not None and isinstance(default.default, str):
            out.setdefault(default.default, cls.__name__)
    return out


def _name_other_optimizer(plan: _Plan, opt, tf_by_param, unused: list[str]) -> None:
    """Where the checkpoint holds another optimizer's slots (unused ``<var>/<name>[_k]``
    variables of the model's variables), or no slot of any parameter although ``opt`` has
    slots: one "optimizer mismatch" problem naming both optimizers and the slots expected."""
    if plan.problems["optimizer mismatch"]:
        return  # the graph already named the optimizer it trains with
    owner = f"{type(opt).__name__} (name {opt.get_name()!r})"
    expected = _expected_slots(opt)
    variables = {entry[0] for entry in tf_by_param.values()}
    found: dict[str, list[str]] = {}
    for name in unused:
        var, _, suffix = name.rpartition("/")
        if var in variables and suffix:
            found.setdefault(re.sub(r"_\d+$", "", suffix), []).append(name)
    if found:
        known = _default_names()
        theirs = []
        for base, names in sorted(found.items()):
            listing = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            if base in known:
                theirs.append(f"{known[base]} slots named {base!r} ({listing})")
            else:  # TF optimizers take a name=: perhaps this optimizer under another name
                theirs.append(
                    f"slots named {base!r} ({listing}; if the TF optimizer was named "
                    f"{base!r}, build {type(opt).__name__} with name={base!r})"
                )
        plan.problems["optimizer mismatch"].append(
            f"the checkpoint holds {'; '.join(theirs)}; {owner} expects {expected}"
        )
    elif plan.problems["no slots"] and not any(
        n.startswith(f"{v}/") for v in variables for n in plan.reader.names()
    ):
        plan.problems["optimizer mismatch"].append(
            f"the checkpoint holds no slot of any optimizer for the model's variables (a TF "
            f"GradientDescentOptimizer or ProximalGradientDescentOptimizer keeps none); "
            f"{owner} expects {expected}"
        )


def _check_graph(plan: _Plan, opt, tf_by_param) -> list[str]:
    """Compare ``opt`` with TF's graph next to the checkpoint, if any: another optimizer's
    kernels are an "optimizer mismatch" problem; differing hyperparameters are returned."""
    prefix = plan.reader.prefix
    if not os.path.exists(_graph.meta_path(prefix)):
        return []
    cls = _slots.optimizer_class(opt)
    notes = []
    for gi, group in enumerate(opt.param_groups):
        variables = [tf_by_param[id(p)][0] for p in group["params"] if id(p) in tf_by_param]
        if not variables:
            continue
        try:
            graph = _graph.read_graph_hyperparameters(prefix, cls, variables)
        except _graph.GraphMismatch as exc:
            plan.problems["optimizer mismatch"].append(str(exc))
            return []
        except Exception as exc:  # an unreadable graph must not stop a load the files allow
            notes.append(f"the graph could not be read ({type(exc).__name__}: {exc})")
            return notes
        values = _graph.tf_keywords(cls, opt._values(group))
        values.update({f: group[f] for f in opt.flags if f in group})
        differ = _graph.disagreements(cls, values, graph)
        notes += [f"group {gi}: {d}" for d in differ]
    return notes


def _find(reader, base: str, explicit: str | None, problems=None) -> str | None:
    """The checkpoint name for a scalar whose last name component is ``base``."""
    if explicit is not None:
        return explicit if explicit in reader.shapes else None
    if base in reader.shapes:
        return base
    found = [n for n in reader.names() if n.rsplit("/", 1)[-1] == base]
    if len(found) > 1 and problems is not None:
        problems["ambiguous"].append(f"{base}: {found} (pass non_slot_names)")
        return None
    return found[0] if found else None


def _reset_non_slot(opt, key):
    """Set ``key`` of every group to the value a new optimizer starts with."""

    def reset():
        for group in opt.param_groups:
            if key in group["non_slot"]:
                group["non_slot"][key].copy_(opt._init_shared(group)[key])

    return reset


def _slot_setter(opt, p, slot):
    def setter(value):
        opt.state[p][slot] = value.to(device=p.device, dtype=p.dtype).clone()

    return setter


def _fill_all(tensors):
    def setter(value):
        for t in tensors:
            t.copy_(value)

    return setter


def _read(plan: _Plan, progress: Progress | None) -> list[torch.Tensor]:
    total = sum(_nbytes(plan.reader, n) for n, _, _ in plan.copies)
    done, out = 0, []
    for tf_name, _, _ in plan.copies:
        out.append(torch.from_numpy(np.array(plan.reader.get(tf_name), copy=True)))
        done += _nbytes(plan.reader, tf_name)
        if progress is not None:
            progress(done, total)
    return out


def _nbytes(reader, name) -> int:
    return int(np.prod(reader.shapes[name], dtype=np.int64)) * reader.dtypes[name].itemsize


def _transformed_shape(transform, shape) -> tuple[int, ...]:
    try:
        return tuple(transform.to_torch(torch.empty(shape, device="meta")).shape)
    except Exception:  # a transform meta tensors cannot run: ask it with real zeros
        return tuple(transform.to_torch(torch.zeros(shape)).shape)


def _via(transform) -> str:
    return "" if transform is _names.IDENTITY else f" after {transform!r}"


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _inner(optimizer):
    """The gradfleet optimizer inside a distributed wrapper (which keeps its state there)."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optimizer", None)
    opt = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    _slots.optimizer_class(opt)  # TypeError for optimizers without a TF layout
    return opt
