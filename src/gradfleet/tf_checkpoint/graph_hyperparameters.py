"""The hyperparameters a TF1 run trained with, read from its graph (``PREFIX.meta``).

A TF1 checkpoint holds variables only; the optimizer's hyperparameters are in the graph that
TF's ``Saver`` writes next to it (``PREFIX.meta``, a ``MetaGraphDef``).  TF's optimizers turn
each Python-float hyperparameter into a constant in ``_prepare`` and feed it to the apply op
of every variable (``ResourceApplyAdam(var, m, v, beta1_power, beta2_power, lr, beta1, beta2,
epsilon, grad)``); a slot's initial value (Adagrad's ``initial_accumulator_value``) is the
constant its initializer fills it with.  :func:`read_graph_hyperparameters` finds the apply
ops that update the given variables and evaluates, with TensorFlow, each hyperparameter input
that depends on constants only (``Cast``, arithmetic: FTRL's ``l2 + beta / (2 lr)`` is such
an expression).  An input that depends on a placeholder or a variable (a learning-rate
schedule of ``global_step``, RETURNN's ``learning_rate`` variable) has no value in the graph:
it is reported in ``missing`` with the reason, and the caller must be given it.

Apply ops are TF1's fused kernels; TF's sparse Adam and GradientDescent updates are plain
ops, so a graph that updates only row-sparse variables with them holds no apply op to read.
RETURNN's own optimizers update with plain ops too: their hyperparameters are never read here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradfleet import optimizers as _opts
from gradfleet.tf_checkpoint.bundle import import_tensorflow

_LR = "learning_rate"
_L1, _L2 = "l1_regularization_strength", "l2_regularization_strength"
_SHRINK = "l2_shrinkage_regularization_strength"


@dataclass(frozen=True)
class _ApplyOp:
    """One TF apply kernel family: ``base`` names ``Apply<base>``, ``ResourceApply<base>``,
    ``SparseApply<base>`` and ``ResourceSparseApply<base>``."""

    base: str
    inputs: dict[str, str]  # op input argument -> gradfleet constructor keyword
    fixed: dict[str, Any] = field(default_factory=dict)  # what choosing this op implies
    attrs: dict[str, str] = field(default_factory=dict)  # op attribute -> keyword
    slot_init: dict[str, str] = field(default_factory=dict)  # slot input -> keyword


_APPLY_OPS: dict[type, tuple[_ApplyOp, ...]] = {
    _opts.GradientDescentOptimizer: (_ApplyOp("GradientDescent", {"alpha": _LR}),),
    _opts.ProximalGradientDescentOptimizer: (
        _ApplyOp("ProximalGradientDescent", {"alpha": _LR, "l1": _L1, "l2": _L2}),
    ),
    _opts.MomentumOptimizer: (
        _ApplyOp(
            "Momentum", {"lr": _LR, "momentum": "momentum"}, attrs={"use_nesterov": "use_nesterov"}
        ),
    ),
    _opts.AdamOptimizer: (
        _ApplyOp("Adam", {"lr": _LR, "beta1": "beta1", "beta2": "beta2", "epsilon": "epsilon"}),
    ),
    _opts.AdadeltaOptimizer: (
        _ApplyOp("Adadelta", {"lr": _LR, "rho": "rho", "epsilon": "epsilon"}),
    ),
    _opts.AdagradOptimizer: (
        _ApplyOp("Adagrad", {"lr": _LR}, slot_init={"accum": "initial_accumulator_value"}),
    ),
    _opts.AdagradDAOptimizer: (
        _ApplyOp(
            "AdagradDA",
            {"lr": _LR, "l1": _L1, "l2": _L2},
            slot_init={
                "gradient_squared_accumulator": "initial_gradient_squared_accumulator_value"
            },
        ),
    ),
    # TF's FTRL feeds ``l2 + beta / (2 * max(lr, 1e-36))`` as the op's l2 and picks the V2
    # kernel only for l2_shrinkage > 0: read back, that sum is l2 with beta 0 (the same update).
    _opts.FtrlOptimizer: (
        _ApplyOp(
            "Ftrl",
            {"lr": _LR, "l1": _L1, "l2": _L2, "lr_power": "learning_rate_power"},
            fixed={_SHRINK: 0.0, "beta": 0.0},
            slot_init={"accum": "initial_accumulator_value"},
        ),
        _ApplyOp(
            "FtrlV2",
            {
                "lr": _LR,
                "l1": _L1,
                "l2": _L2,
                "l2_shrinkage": _SHRINK,
                "lr_power": "learning_rate_power",
            },
            fixed={"beta": 0.0},
            slot_init={"accum": "initial_accumulator_value"},
        ),
    ),
    _opts.ProximalAdagradOptimizer: (
        _ApplyOp(
            "ProximalAdagrad",
            {"lr": _LR, "l1": _L1, "l2": _L2},
            slot_init={"accum": "initial_accumulator_value"},
        ),
    ),
    _opts.RMSPropOptimizer: (
        _ApplyOp(
            "RMSProp",
            {"lr": _LR, "rho": "decay", "momentum": "momentum", "epsilon": "epsilon"},
            fixed={"centered": False},
        ),
        _ApplyOp(
            "CenteredRMSProp",
            {"lr": _LR, "rho": "decay", "momentum": "momentum", "epsilon": "epsilon"},
            fixed={"centered": True},
        ),
    ),
}

#: TF op type -> (gradfleet class, its apply-op family).
_BY_OP_TYPE: dict[str, tuple[type, _ApplyOp]] = {
    f"{resource}{sparse}Apply{op.base}": (cls, op)
    for cls, ops in _APPLY_OPS.items()
    for op in ops
    for resource in ("", "Resource")
    for sparse in ("", "Sparse")
}

#: Ops a hyperparameter is passed through unchanged in meaning (a cast to the variable's
#: dtype is TF's ``math_ops.cast``; the value before it is the one TF's Python level made).
_PASS_THROUGH = ("Identity", "Cast", "Snapshot", "StopGradient")
_FED = ("Placeholder", "PlaceholderV2", "PlaceholderWithDefault")
_VARIABLES = ("VarHandleOp", "VariableV2", "Variable")


class GraphMismatch(ValueError):
    """The TF graph trains the variables with another optimizer, or with different values
    for different variables: one optimizer's hyperparameters cannot continue it."""


@dataclass
class GraphHyperparameters:
    """What :func:`read_graph_hyperparameters` found: ``values`` by gradfleet constructor
    keyword (TF's argument names), ``sources`` saying where in the graph each value is, and
    ``missing``: keyword -> why the graph does not hold it."""

    meta: str | None
    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    #: TF's dtype of each value (float32 for Python floats): the precision TF computed in.
    dtypes: dict[str, np.dtype] = field(default_factory=dict)


def hyperparameter_keywords(optimizer_class: type) -> list[str]:
    """The constructor keywords (TF's names) of ``optimizer_class``'s hyperparameters and
    options that change its maths: ``learning_rate``, ``beta1`` ..., ``use_nesterov``."""
    names = ["learning_rate" if k == "lr" else k for k in optimizer_class.hyperparameters]
    return names + [f for f in optimizer_class.flags if f not in names]


def meta_path(prefix: str) -> str:
    """Where TF's ``Saver`` writes the graph of checkpoint ``prefix``."""
    return f"{prefix}.meta"


def read_graph_hyperparameters(
    prefix: str | os.PathLike,
    optimizer_class: type,
    variables: Iterable[str] | None = None,
) -> GraphHyperparameters:
    """The hyperparameters of ``optimizer_class`` (a gradfleet class) that TF's graph of
    checkpoint ``prefix`` (its ``PREFIX.meta``) trains ``variables`` (TF names; None: every
    variable) with.  Every keyword of :func:`hyperparameter_keywords` ends up in ``values``
    or in ``missing``.  Raises :class:`GraphMismatch` when the graph updates the variables
    with another optimizer's kernels or with different values for different variables."""
    prefix = os.fspath(prefix)
    keywords = hyperparameter_keywords(optimizer_class)
    owner = optimizer_class.__name__
    meta = meta_path(prefix)
    if optimizer_class not in _APPLY_OPS:
        why = f"RETURNN's {owner} updates with plain TF ops: its values are not read from a graph"
        return GraphHyperparameters(None, missing=dict.fromkeys(keywords, why))
    if not os.path.exists(meta):
        why = (
            f"no TF graph: {meta} does not exist (a Saver with write_meta_graph=False, a TF2 "
            f"checkpoint or one gradfleet wrote)"
        )
        return GraphHyperparameters(None, missing=dict.fromkeys(keywords, why))
    graph = _Graph(meta)
    wanted = None if variables is None else set(variables)
    found: dict[str, list[tuple[str, Any, np.dtype | None, str]]] = {}  # keyword -> readings
    pending: list[tuple[str, str, str]] = []  # (keyword, tensor, where)
    others: dict[str, tuple[set[str], set[str]]] = {}  # class -> (variables, op types)
    updated = 0
    for node in graph.nodes.values():
        family = _BY_OP_TYPE.get(node.op)
        if family is None:
            continue
        inputs = graph.data_inputs(node)
        var = _node_name(inputs[0]) if inputs else ""
        if wanted is not None and var not in wanted:
            continue
        cls, op = family
        if cls is not optimizer_class:
            seen_vars, seen_ops = others.setdefault(cls.__name__, (set(), set()))
            seen_vars.add(var)
            seen_ops.add(node.op)
            continue
        updated += 1
        arg_names = graph.input_arg_names(node.op)
        by_arg = dict(zip(arg_names, inputs))
        where = f"{node.name} ({node.op})"
        for arg, keyword in op.inputs.items():
            pending.append((keyword, by_arg[arg], f"input {arg} of {where}"))
        for arg, keyword in op.slot_init.items():
            slot = _node_name(by_arg[arg])
            initial = graph.initial_values.get(slot)
            if initial is None:
                found.setdefault(keyword, []).append(
                    (f"slot {slot} of {where}", None, None, "no initializer in the graph")
                )
            else:
                pending.append((keyword, initial, f"initializer of slot {slot}"))
        for attr, keyword in op.attrs.items():
            found.setdefault(keyword, []).append(
                (f"attribute {attr} of {where}", bool(node.attr[attr].b), None, "")
            )
        for keyword, value in op.fixed.items():
            found.setdefault(keyword, []).append(
                (f"{where}: {node.op} implies it", value, None, "")
            )
    if others:
        trained = "; ".join(
            f"{', '.join(sorted(v))} with {name} ({', '.join(sorted(o))})"
            for name, (v, o) in sorted(others.items())
        )
        raise GraphMismatch(f"the TF graph {meta} trains {trained}, not with {owner}")
    result = GraphHyperparameters(meta)
    if not updated:
        scope = "the variables" if wanted is None else f"any of {sorted(wanted)}"
        why = (
            f"the TF graph {meta} has no {_kinds_of(optimizer_class)} op that updates "
            f"{scope} (TF's sparse Adam and GradientDescent updates are plain ops)"
        )
        result.missing = dict.fromkeys(keywords, why)
        return result
    for (keyword, _, where), (value, dtype, why) in zip(
        pending, graph.evaluate([t for _, t, _ in pending])
    ):
        found.setdefault(keyword, []).append((where, value, dtype, why))
    for keyword in keywords:
        readings = found.get(keyword)
        if not readings:  # not an input of this optimizer's kernels
            result.missing[keyword] = f"TF's {_kinds_of(optimizer_class)} ops do not take it"
            continue
        unknown = [(where, why) for where, value, _, why in readings if value is None]
        if unknown:
            where, why = unknown[0]
            result.missing[keyword] = f"{where}: {why}"
            continue
        values = {_as_python(value, dtype) for _, value, dtype, _ in readings}
        if len(values) > 1:
            listing = "; ".join(f"{_as_python(v, d)!r} ({w})" for w, v, d, _ in readings)
            raise GraphMismatch(
                f"the TF graph {meta} trains with different {keyword} values: {listing}"
            )
        where, value, dtype, _ = readings[0]
        result.values[keyword] = values.pop()
        result.sources[keyword] = (
            where if len(readings) == 1 else f"{where} and {len(readings) - 1} more"
        )
        if dtype is not None:
            result.dtypes[keyword] = dtype
    return result


def _kinds_of(optimizer_class: type) -> str:
    """``"ApplyFtrl/ApplyFtrlV2"``: the apply-op families of ``optimizer_class``."""
    return "/".join(f"Apply{op.base}" for op in _APPLY_OPS.get(optimizer_class, ()))


def tf_sees(optimizer_class: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (constructor keywords) as TF's apply ops receive them: FTRL's ``beta`` folded
    into l2 (``l2 + beta / (2 * max(lr, 1e-36))`` in float32, TF's ``_prepare``)."""
    out = dict(values)
    if optimizer_class is _opts.FtrlOptimizer and {_L2, "beta", _LR} <= set(out):
        if any(_is_schedule(out[k]) for k in (_L2, "beta", _LR)):
            out[_L2], out["beta"] = None, 0.0  # not known before the schedule is called
            return out
        f32 = np.float32
        l2 = f32(out[_L2]) + f32(out["beta"]) / (f32(2) * np.maximum(f32(out[_LR]), f32(1e-36)))
        out[_L2] = _as_python(l2, np.dtype(np.float32))
        out["beta"] = 0.0
    return out


def _as_python(value: Any, dtype: np.dtype | None) -> Any:
    """A scalar as a Python value; a float32 one as the shortest decimal that rounds to it
    (``0.01``, not ``0.009999999776482582``), which TF's float32 rounding gives back."""
    if isinstance(value, bool) or dtype is None:
        return value
    if dtype == np.float32:
        return float(str(np.float32(value)))
    if np.issubdtype(dtype, np.floating):
        return float(value)
    if np.issubdtype(dtype, np.bool_):
        return bool(value)
    return int(value)


def _node_name(tensor: str) -> str:
    return tensor.lstrip("^").split(":")[0]


class _Graph:
    """The nodes of a ``MetaGraphDef`` and its variables' initial values."""

    def __init__(self, meta: str) -> None:
        import_tensorflow()
        from tensorflow.core.framework import variable_pb2
        from tensorflow.core.protobuf import meta_graph_pb2

        proto = meta_graph_pb2.MetaGraphDef()
        with open(meta, "rb") as f:
            proto.ParseFromString(f.read())
        self.graph_def = proto.graph_def
        self.nodes = {n.name: n for n in proto.graph_def.node}
        self.initial_values: dict[str, str] = {}  # variable node -> its initial value tensor
        for key in ("variables", "local_variables"):
            if key not in proto.collection_def:
                continue
            for raw in proto.collection_def[key].bytes_list.value:
                var = variable_pb2.VariableDef()
                var.ParseFromString(raw)
                if var.initial_value_name:
                    self.initial_values[_node_name(var.variable_name)] = var.initial_value_name

    def data_inputs(self, node: Any) -> list[str]:
        return [i for i in node.input if not i.startswith("^")]

    def input_arg_names(self, op_type: str) -> list[str]:
        from tensorflow.python.framework import op_def_registry

        return [arg.name for arg in op_def_registry.get(op_type).input_arg]

    def evaluate(self, tensors: list[str]) -> list[tuple[Any, np.dtype | None, str]]:
        """Per tensor: (scalar value, dtype, "") where it depends on constants only (after
        the casts TF puts in front of a kernel), else (None, None, why not)."""
        tf = import_tensorflow()
        out: list[tuple[Any, np.dtype | None, str]] = [(None, None, "")] * len(tensors)
        runnable: dict[str, list[int]] = {}
        for i, tensor in enumerate(tensors):
            tensor = self._before_casts(tensor)
            why = self._not_constant(tensor)
            if why:
                out[i] = (None, None, why)
            else:
                runnable.setdefault(tensor, []).append(i)
        if not runnable:
            return out
        names = list(runnable)
        subgraph = tf.compat.v1.GraphDef()
        for name in self._ancestors(names):
            node = subgraph.node.add()
            node.CopyFrom(self.nodes[name])
            del node.input[:]
            node.input.extend(self.data_inputs(self.nodes[name]))  # no control edges
            if "_class" in node.attr:  # colocation with nodes left out
                del node.attr["_class"]
        graph = tf.Graph()
        with graph.as_default():
            fetched = tf.graph_util.import_graph_def(
                subgraph, return_elements=[_tensor_name(n) for n in names], name=""
            )
        with tf.compat.v1.Session(graph=graph) as sess:
            arrays = sess.run(fetched)
        for name, array in zip(names, arrays):
            array = np.asarray(array)
            flat = array.reshape(-1)
            if flat.size == 0 or not np.all(flat == flat[0]):
                result = (None, None, f"{name} is not one value (shape {list(array.shape)})")
            else:
                result = (flat[0].item(), array.dtype, "")
            for i in runnable[name]:
                out[i] = result
        return out

    def _before_casts(self, tensor: str) -> str:
        while True:
            node = self.nodes.get(_node_name(tensor))
            if node is None or node.op not in _PASS_THROUGH or _output(tensor) != 0:
                return tensor
            tensor = self.data_inputs(node)[0]

    def _not_constant(self, tensor: str) -> str:
        """Why ``tensor`` does not depend on constants only ("" if it does)."""
        from tensorflow.python.framework import op_def_registry

        nodes = [(name, self.nodes.get(name)) for name in self._ancestors([tensor])]
        absent = [name for name, node in nodes if node is None]
        if absent:
            return f"{tensor} reads {absent[0]!r}, which the graph lacks"
        fed = sorted(name for name, node in nodes if node.op in _FED)
        if fed:
            return f"{tensor} is fed through the placeholder {fed[0]!r}"
        variables = sorted(name for name, node in nodes if node.op in _VARIABLES)
        if variables:
            return (
                f"{tensor} is computed from the variable {', '.join(map(repr, variables))}: "
                f"its value changes while training (a schedule, or set by the training loop)"
            )
        for name, node in nodes:
            op_def = op_def_registry.get(node.op)
            if op_def is None:
                return f"{tensor} is computed by {name!r}, an op ({node.op}) TF does not know"
            if op_def.is_stateful:
                return f"{tensor} is computed by the stateful op {name!r} ({node.op})"
        return ""

    def _ancestors(self, tensors: list[str]) -> list[str]:
        """Node names ``tensors`` depend on through data edges (themselves included)."""
        seen: dict[str, None] = {}
        stack = [_node_name(t) for t in tensors]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen[name] = None
            node = self.nodes.get(name)
            if node is not None:
                stack.extend(_node_name(i) for i in self.data_inputs(node))
        return list(seen)


def _output(tensor: str) -> int:
    _, _, index = tensor.partition(":")
    return int(index) if index else 0


def _tensor_name(tensor: str) -> str:
    return tensor if ":" in tensor else f"{tensor}:0"


def tf_keywords(optimizer_class: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` constructor arguments under TF's names: torch's aliases (``lr``, ``betas``,
    ``eps``, ``nesterov``, ``alpha``) renamed, ``betas`` unpacked."""
    out = {}
    for key, value in given.items():
        tf = "learning_rate" if key == "lr" else optimizer_class.torch_names.get(key, key)
        if isinstance(tf, tuple):
            out.update(zip(tf, value))
        else:
            out[tf] = value
    return out


def disagreements(
    optimizer_class: type, given: Mapping[str, Any], graph: GraphHyperparameters
) -> list[str]:
    """Each hyperparameter for which ``given`` (constructor keywords, TF's names; the graph's
    values fill the rest) makes TF's apply ops receive another value than the graph's, as
    ``"learning_rate 0.001, the TF graph's 0.01 (input lr of ...)"``.  Values compare at TF's
    precision (a float32 constant: after rounding to float32); callables are not compared."""
    mine = tf_sees(optimizer_class, {**graph.values, **given})
    theirs = tf_sees(optimizer_class, graph.values)
    out = []
    for key, value in theirs.items():
        if key not in mine or _same(mine[key], value, graph.dtypes.get(key)):
            continue
        if key in given:
            told = f"{key} {given[key]!r}"
        else:  # FTRL's l2 from a given beta or learning rate
            told = f"{key} as TF's op takes it (l2 + beta / (2 lr)) {mine[key]!r}"
        out.append(f"{told}, the TF graph's {value!r} ({graph.sources[key]})")
    return out


def _is_schedule(value: Any) -> bool:
    return callable(value) and not hasattr(value, "item")


def _same(a: Any, b: Any, dtype: np.dtype | None) -> bool:
    if a is None or _is_schedule(a):
        return True  # a schedule: its value is not known before it is called
    if hasattr(a, "item"):  # a one-element tensor or numpy scalar
        a = a.item()
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    dtype = dtype or np.dtype(np.float64)
    return bool(np.asarray(a, dtype=dtype) == np.asarray(b, dtype=dtype))
