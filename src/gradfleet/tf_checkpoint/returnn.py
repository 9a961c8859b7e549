"""A TF-backend RETURNN checkpoint -> the files RETURNN's PyTorch engine continues from.

RETURNN's TF engine saves epoch ``E`` as the TF checkpoint ``<model>.<EEE>`` (with
``global_step`` and its ``learning_rate`` variable next to the parameters and the optimizer's
slots).  Its PyTorch engine continues training from ``<model>.<EEE>.pt``
(``{"model": state_dict, "epoch", "step", "effective_learning_rate", "returnn_version"}``)
and ``<model>.<EEE>.opt.pt`` (``{"optimizer": state_dict, "optimizer_class_name",
"param_names", "epoch", "step", ...}``; RETURNN matches the optimizer state to parameters by
``param_names``).  :func:`convert_returnn_checkpoint` writes both.

RETURNN's TF engine saves no optimizer state (its ``Saver`` lists only the parameters and
``global_step``), so a RETURNN-TF run restarted from a checkpoint starts its optimizer
afresh; the converted run does the same.  A checkpoint that does hold the optimizer's slots
and non-slot variables (a ``Saver`` over all global variables) has them loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

import torch

from gradfleet.tf_checkpoint import names as _names
from gradfleet.tf_checkpoint import slot_names as _slots
from gradfleet.tf_checkpoint.bundle import CheckpointReader, Progress
from gradfleet.tf_checkpoint.convert import load_tf_checkpoint

#: Variables of RETURNN's TF updater that are not model or optimizer state.
RETURNN_TF_EXTRAS = ("learning_rate",)


def convert_returnn_checkpoint(
    prefix: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    name_map: _names.NameMap,
    out_model: str | os.PathLike,
    *,
    epoch: int | None = None,
    progress: Progress | None = None,
    fresh_slots: Iterable[str] = (),
) -> tuple[str, str]:
    """Load the RETURNN TF checkpoint ``prefix`` (e.g. ``net-model/network.003``) into
    ``model``/``optimizer`` (see :func:`load_tf_checkpoint`) and write RETURNN's PyTorch
    checkpoint files for ``out_model`` (the torch config's ``model`` setting) at ``epoch``
    (default: the number at the end of ``prefix``); ``fresh_slots`` as for
    :func:`load_tf_checkpoint`.  Returns the two file names."""
    prefix = os.fspath(prefix)
    if epoch is None:
        match = re.search(r"\.(\d+)$", prefix)
        if match is None:
            raise ValueError(
                f"epoch: cannot tell the epoch from {prefix!r} (RETURNN names checkpoints "
                f"<model>.<epoch>); pass epoch="
            )
        epoch = int(match.group(1))
    reader = CheckpointReader(prefix)
    learning_rate = None
    if "learning_rate" in reader.shapes:
        learning_rate = float(reader.get("learning_rate"))
    # RETURNN's TF Saver keeps only the parameters and global_step: a TF run restarted from
    # such a checkpoint starts its optimizer afresh, and so does the converted one.
    with_state = optimizer if _holds_optimizer_state(reader, optimizer) else None
    loaded = load_tf_checkpoint(
        prefix,
        model,
        with_state,
        name_map,
        ignore=RETURNN_TF_EXTRAS,
        progress=progress,
        fresh_slots=fresh_slots if with_state is not None else (),
    )
    step = loaded.global_step or 0
    param_name = {id(p): n for n, p in model.named_parameters()}
    param_names = [param_name[id(p)] for g in optimizer.param_groups for p in g["params"]]
    common: dict[str, Any] = {
        "epoch": epoch,
        "step": step,
        "effective_learning_rate": learning_rate,
        "returnn_version": _returnn_version(),
    }
    base = f"{os.fspath(out_model)}.{epoch:03d}"
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    model_file, opt_file = base + ".pt", base + ".opt.pt"
    torch.save({"model": model.state_dict(), **common}, model_file)
    opt_state = {
        "optimizer": optimizer.state_dict(),
        "optimizer_class_name": type(optimizer).__name__,
        "param_names": param_names,
        **common,
    }
    torch.save(opt_state, opt_file)
    return model_file, opt_file


def _holds_optimizer_state(reader: CheckpointReader, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the checkpoint has any of ``optimizer``'s slots or non-slot variables."""
    slot = re.compile(rf"/{re.escape(optimizer.get_name())}(_\d+)?$")
    non_slot = {_slots.NON_SLOT_NAMES[k] for g in optimizer.param_groups for k in g["non_slot"]}
    non_slot.discard("global_step")  # RETURNN always saves it
    return any(slot.search(n) or n.rsplit("/", 1)[-1] in non_slot for n in reader.names())


def _returnn_version() -> str:
    try:
        import returnn

        return returnn.__long_version__
    except (ImportError, AttributeError):
        return "unknown (written by gradfleet.tf_checkpoint)"
