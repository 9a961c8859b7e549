"""How an optimizer's param groups are given and stored: TF's and torch's names for one
value, and each parameter in one place.

Groups store ``lr``, packed tuples such as ``betas`` and ``momentum`` under torch's names
(torch's schedulers edit those keys) and every other hyperparameter under TF's name; a group
given with the other names is rewritten by :func:`canonical`, also when an old checkpoint
holds ``beta1``/``beta2``.
"""

from __future__ import annotations

from typing import Any

import torch


def canonical(opt: Any, group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with every name as the param groups store it: TF's ``learning_rate`` as
    ``lr``, TF names packed into their torch tuple (``beta1`` -> ``betas``), other torch
    aliases (``eps``) as their TF name.  Two names for one value: ``ValueError``."""
    owner = type(opt).__name__
    group = dict(group)

    def clash(a: str, b: str) -> ValueError:
        return ValueError(f"{owner}: param group has both {a} and {b}; give one")

    if "learning_rate" in group:
        if "lr" in group:
            raise clash("lr", "learning_rate")
        group["lr"] = group.pop("learning_rate")
    for torch_name, tf in opt.torch_names.items():
        if isinstance(tf, str):
            if torch_name in group:
                if tf in group:
                    raise clash(torch_name, tf)
                group[tf] = group.pop(torch_name)
            continue
        loose = [name for name in tf if name in group]
        if not loose:
            continue
        if torch_name in group:
            raise clash(torch_name, " and ".join(loose))
        base = opt.defaults.get(torch_name) if hasattr(opt, "defaults") else None
        if base is None and len(loose) != len(tf):
            raise ValueError(f"{owner}: param group needs all of {list(tf)} or {torch_name}")
        values = dict(zip(tf, base or ()))
        values.update((name, group.pop(name)) for name in loose)
        group[torch_name] = tuple(values[name] for name in tf)
    return group


def check_unique(opt: Any, param_group: dict[str, Any]) -> None:
    """A parameter listed twice, in this group or in an earlier one, is refused (torch
    only warns within a group): it would take two updates per step."""
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif not isinstance(params, set):  # sets: torch's own TypeError
        params = list(params)  # a generator is read once: keep what was read
    param_group["params"] = params
    seen = {id(p) for group in opt.param_groups for p in group["params"]}
    mine: set[int] = set()
    for item in params:
        p = item[1] if isinstance(item, tuple) else item
        where = "twice in one param group" if id(p) in mine else "in two param groups"
        if id(p) in seen or id(p) in mine:
            name = f"{item[0]!r} " if isinstance(item, tuple) else ""
            raise ValueError(
                f"{type(opt).__name__}: parameter {name}of shape {tuple(p.shape)} is "
                f"listed {where}; list each parameter once"
            )
        mine.add(id(p))
