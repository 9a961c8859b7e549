"""``ModelAverageOptimizer``: local SGD with periodic exact model averaging (TF ``contrib.opt``).

Update rule, per worker ``i`` of ``N = num_worker``, wrapped optimizer ``opt``::

    x_i := opt.update(x_i, g_i)          # a purely local step
    local_step += 1
    if local_step % interval_steps == 0: # after local steps interval, 2*interval, ...
        x_i := (1/N) * sum_j x_j         # every replica gets the same exact mean
        global_step += 1                 # global_step counts averaging rounds

TF argument mapping: ``opt``, ``num_worker``, ``interval_steps`` keep their meaning;
``is_chief``, ``ma_custom_getter`` and ``use_locking`` have no equivalent (there is no parameter
server: the mean is an all-reduce and the "global" copy is the averaged parameters themselves).

Deliberate differences from TF, all opt-in or safer:

* replicas start identical: the constructor broadcasts rank 0's parameters (``broadcast=True``);
  TF's hook never ran its init op, so replicas started from their own initialisers;
* ``buffers=`` (e.g. ``model.buffers()``, BatchNorm statistics) and
  ``average_optimizer_state=True`` (slot tensors shaped like their parameter: momentum, Adam
  moments) are averaged in the same round; TF averages neither;
* every parameter of the wrapped optimizer is averaged, also one that got no gradient this round
  (TF skips those); replicas start identical, so such a parameter keeps its value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..transport.collectives import resolve_collective
from .wrapper import WrapperOptimizer, check_int

__all__ = ["ModelAverageOptimizer"]


class ModelAverageOptimizer(WrapperOptimizer):
    """Wrap ``opt`` so that every ``interval_steps`` local steps all replicas are averaged.

    Args:
        opt: any ``torch.optim.Optimizer`` (gradfleet's or torch's) over the local replica.
        num_worker: number of workers; must equal the process group's world size.
        interval_steps: local steps between averaging rounds (>= 1).
        buffers: extra tensors averaged with the parameters (and broadcast at start), e.g.
            ``model.buffers()``; non-floating ones (``num_batches_tracked``) are only broadcast.
        average_optimizer_state: also average the wrapped optimizer's slot tensors.
        broadcast: copy rank 0's parameters, buffers and optimizer state to every rank at
            construction so replicas start identical.
        process_group: the group to average over (default: the default group).
        name: TF's ``name``, returned by ``get_name()``.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        num_worker: int,
        interval_steps: int = 100,
        *,
        buffers: Iterable[torch.Tensor] | None = None,
        average_optimizer_state: bool = False,
        broadcast: bool = True,
        process_group: dist.ProcessGroup | None = None,
        name: str = "ModelAverageOptimizer",
    ) -> None:
        owner = "ModelAverageOptimizer"
        check_int(owner, "num_worker", num_worker, 1)
        check_int(owner, "interval_steps", interval_steps, 1)
        buffer_list = list(buffers) if buffers is not None else []
        for b in buffer_list:
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"{owner}: buffers must be tensors, got {type(b).__name__}")
        super().__init__(opt, name)
        self._comm = resolve_collective(num_worker, process_group, owner)
        self.num_worker = num_worker
        self.interval_steps = interval_steps
        self.average_optimizer_state = bool(average_optimizer_state)
        self._buffers = buffer_list
        self.local_step = 0
        self.global_step = 0
        if broadcast:
            self.broadcast_from(0)

    # ----------------------------------------------------------------- what is synchronised
    def _float_buffers(self) -> list[torch.Tensor]:
        return [b for b in self._buffers if b.is_floating_point() or b.is_complex()]

    def _slot_tensors(self) -> list[torch.Tensor]:
        """Slot tensors (shaped like their parameter) in a rank-independent order."""
        out = []
        for p in self.params():
            s = self.state.get(p, {})
            for key in sorted(s, key=str):
                v = s[key]
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape:
                    out.append(v)
        return out

    def _checked_slots(self) -> list[torch.Tensor]:
        # A rank whose optimizer has not created every slot yet would join a collective of a
        # different size and hang: compare counts first (one tiny all-reduce).
        slots = self._slot_tensors()
        hi, neg_lo = self._comm.all_reduce_max_int([len(slots), -len(slots)])
        if hi != -neg_lo:
            raise RuntimeError(
                "ModelAverageOptimizer: ranks hold different numbers of optimizer slots "
                f"({-neg_lo}..{hi}); average_optimizer_state needs every rank to have stepped "
                "every parameter"
            )
        return slots

    def _synced_tensors(self) -> list[torch.Tensor]:
        tensors = [p.data for p in self.params()] + self._float_buffers()
        if self.average_optimizer_state:
            tensors += self._checked_slots()
        return tensors

    # ----------------------------------------------------------------- collective operations
    def broadcast_from(self, src: int = 0) -> None:
        """Make every replica equal to rank ``src`` (parameters, all buffers, and the optimizer
        slots when ``average_optimizer_state``). Collective: every rank must call it."""
        tensors = [p.data for p in self.params()] + [b.data for b in self._buffers]
        if self.average_optimizer_state:
            tensors += self._checked_slots()
        self._comm.broadcast_(tensors, src=src)

    def average(self) -> None:
        """One averaging round now (collective), without touching the counters."""
        with torch.no_grad():
            self._comm.all_reduce_mean_(self._synced_tensors())

    def _after_local_step(self) -> int:
        self.local_step += 1
        if self.local_step % self.interval_steps != 0:
            return 0
        self.average()
        self.global_step += 1
        return 1

    # ----------------------------------------------------------------- checkpoints
    def _wrapper_state(self) -> dict[str, Any]:
        return {
            "local_step": self.local_step,
            "global_step": self.global_step,
            "interval_steps": self.interval_steps,
            "num_worker": self.num_worker,
        }

    def _check_wrapper_state(self, counters: dict[str, Any]) -> None:
        super()._check_wrapper_state(counters)
        for key in ("interval_steps", "num_worker"):
            if counters[key] != getattr(self, key):
                raise ValueError(
                    f"ModelAverageOptimizer.load_state_dict: checkpoint has {key}="
                    f"{counters[key]}, this optimizer {getattr(self, key)}"
                )

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        self.local_step = int(state["local_step"])
        self.global_step = int(state["global_step"])
