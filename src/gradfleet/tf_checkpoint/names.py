"""The user's name map between a torch model and a TF checkpoint, with layout transforms.

A name map takes a torch ``state_dict`` key (``"dense.weight"``) to the TF variable name
(``"dense/kernel"``), optionally with a :class:`Transform` between TF's layout and torch's.
It is either a dict (keys not in it take the default) or a callable; a value is

* ``"tf/name"``: same layout on both sides;
* ``("tf/name", transform)``: ``transform.to_torch`` turns the TF tensor into the torch one
  and ``transform.to_tf`` back; the same transform applies to the variable's slots;
* ``None``: this torch tensor is not in the checkpoint (it keeps its value when loading and
  is not written when saving).

The default for keys the map does not name is ``key.replace(".", "/")``.  One map serves both
directions, which is why it goes from torch names to TF names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Transform:
    """A layout change: ``to_torch(tf_tensor)`` and its inverse ``to_tf(torch_tensor)``."""

    to_torch: Callable[[torch.Tensor], torch.Tensor]
    to_tf: Callable[[torch.Tensor], torch.Tensor]
    name: str = "transform"

    def __repr__(self) -> str:
        return self.name


def _transpose(t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 2:
        raise ValueError(f"transpose needs a 2-D tensor, got shape {tuple(t.shape)}")
    return t.t().contiguous()


#: TF ``Dense`` kernel ``[in, out]`` <-> ``nn.Linear`` weight ``[out, in]``.
TRANSPOSE = Transform(_transpose, _transpose, "TRANSPOSE")
IDENTITY = Transform(lambda t: t, lambda t: t, "IDENTITY")

Entry = str | tuple[str, Transform] | None
NameMap = Mapping[str, Entry] | Callable[[str], Entry] | None


def default_tf_name(torch_name: str) -> str:
    return torch_name.replace(".", "/")


def resolve(name_map: NameMap, torch_name: str) -> tuple[str, Transform] | None:
    """``(tf_name, transform)`` for ``torch_name``, or None when it is not in the checkpoint."""
    if name_map is None:
        entry: Entry = default_tf_name(torch_name)
    elif isinstance(name_map, Mapping):
        entry = name_map.get(torch_name, default_tf_name(torch_name))
    elif callable(name_map):
        entry = name_map(torch_name)
    else:
        raise TypeError(f"name_map must be a dict, a callable or None, got {type(name_map)}")
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry, IDENTITY
    if (
        isinstance(entry, tuple)
        and len(entry) == 2
        and isinstance(entry[0], str)
        and isinstance(entry[1], Transform)
    ):
        return entry
    raise TypeError(
        f"name_map entry for {torch_name!r} must be a TF name, (TF name, Transform) or None, "
        f"got {entry!r}"
    )


def load_name_map(path: str) -> NameMap:
    """The ``NAME_MAP`` (dict or callable) defined by the Python file ``path`` (for the CLI);
    the file may use ``TRANSPOSE``, ``IDENTITY`` and ``Transform`` without importing them."""
    namespace = {"TRANSPOSE": TRANSPOSE, "IDENTITY": IDENTITY, "Transform": Transform}
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, namespace)
    if "NAME_MAP" not in namespace:
        raise ValueError(f"{path} defines no NAME_MAP (a dict or a callable)")
    return namespace["NAME_MAP"]
