"""TF2 object-based checkpoints (``tf.train.Checkpoint``) seen under TF1 ``Saver`` names.

``tf.train.Checkpoint(model=..., optimizer=tf.compat.v1.train.AdamOptimizer(...))`` keys each
variable by its path in the object graph, not by its TF name::

    model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE                              the variable
    model/dense/kernel/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE  its slot "m"
    optimizer/beta1_power/.ATTRIBUTES/VARIABLE_VALUE                           a non-slot variable
    save_counter/.ATTRIBUTES/VARIABLE_VALUE                                    Checkpoint's own

:func:`tf1_view` reads the checkpoint's ``TrackableObjectGraph`` (which node is a variable,
which is a slot of which variable under which slot name) and names every variable as the TF1
path does: a variable by its object path (``model/dense/kernel``), a slot as
``<variable path>/<optimizer name>[_k]`` numbered in the optimizer's creation order
(``model/dense/kernel/Adam``, ``.../Adam_1``), a non-slot variable by its path
(``optimizer/beta1_power``, found by its last component).  Loading then goes the TF1 way.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from gradfleet.tf_checkpoint import slot_names as _slots
from gradfleet.tf_checkpoint.bundle import CheckpointReader

log = logging.getLogger(__name__)

#: Suffix of a variable's value in an object-based checkpoint key.
VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
#: ``tf.train.Checkpoint``'s own counter of ``save()`` calls: neither model nor optimizer.
SAVE_COUNTER = "save_counter"


def tf1_view(reader: CheckpointReader, optimizer: torch.optim.Optimizer | None) -> CheckpointReader:
    """``reader`` (object-based) under TF1-style names; slot names follow ``optimizer``
    (its ``get_name()`` and slot order).  Without an optimizer, or for a slot it does not
    know, a slot keeps its object path (and so is reported as unused when loading)."""
    graph = reader.object_graph()
    if graph is None:
        return reader
    key_of = _value_keys(graph)
    path_of = {node: key.removesuffix(VALUE_SUFFIX) for node, key in key_of.items()}
    slots: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for node in graph.nodes:
        for slot in node.slot_variables:
            slots[slot.original_variable_node_id].append(
                (slot.slot_name, slot.slot_variable_node_id)
            )
    slot_nodes = {sid for entries in slots.values() for _, sid in entries}
    names = {path_of[n]: key for n, key in key_of.items() if n not in slot_nodes}
    for original, entries in slots.items():
        suffix = _slots.suffixes_for_slots(optimizer, [s for s, _ in entries]) if optimizer else {}
        for slot, sid in entries:
            name = f"{path_of[original]}/{suffix[slot]}" if slot in suffix else path_of[sid]
            if name in names:
                raise ValueError(
                    f"TF checkpoint {reader.prefix!r}: two variables take the TF1 name {name!r} "
                    f"({names[name]!r}, {key_of[sid]!r}); several optimizers own slots of "
                    f"{path_of[original]!r}"
                )
            names[name] = key_of[sid]
    covered = set(names.values())
    # Anything else the checkpoint holds (a Keras layer's config, another saveable) keeps its
    # key, so loading reports it instead of passing over it.
    names.update({key: key for key in reader.names() if key not in covered})
    log.info(
        "%s is a TF2 object-based checkpoint: %d variables (%d slots) read under TF1 names",
        reader.prefix,
        len(names),
        len(slot_nodes),
    )
    return reader.view(names)


def _value_keys(graph) -> dict[int, str]:
    """Node id -> checkpoint key, for every node that holds a variable value."""
    out = {}
    for node_id, node in enumerate(graph.nodes):
        for attribute in node.attributes:
            if attribute.checkpoint_key.endswith(VALUE_SUFFIX):
                out[node_id] = attribute.checkpoint_key
    return out
