"""``ElasticAverageOptimizer``: Elastic Averaging SGD (EASGD, TF ``contrib.opt``).

Per worker ``i`` with local parameters ``x_i``, cached centre ``c_loc`` (TF's
``local_center_variable``), centre ``c`` (TF's ``global_center_variable``), ``alpha =
moving_rate``, ``tau = communication_period``::

    compute_gradients / minimize:  g_i := dL/dx_i + rho * (x_i - c_loc)
                                   (the gradient of L + rho/2 * ||x_i - c_loc||^2)
    apply_gradients / step:        x_i := opt.update(x_i, g_i); local_step += 1
    if local_step % tau == 0:      c_loc := c;  d_i := x_i - c_loc
                                   x_i := x_i - alpha * d_i;  c := c + alpha * (sum of d's)
                                   global_step += num_worker   (TF: one per worker communication)

Defaults as in TF: ``moving_rate = BETA / (tau * num_worker)`` with ``BETA = 0.9``;
``rho = moving_rate / learning_rate``, read from each parameter group's current ``"lr"`` (or
``"learning_rate"``) so it works for every wrapped optimizer and follows LR schedules (TF read the
private ``_learning_rate`` and failed for Adam). ``step()`` after ``loss.backward()`` is TF's
``apply_gradients`` path and adds no penalty; call :meth:`add_elastic_penalty_` before it to
get the ``minimize`` behaviour in a torch-style loop.

Where the centre lives is chosen by ``mode``: ``"allreduce"`` keeps it replicated on every rank and
exchanges synchronously, the EASGD paper's synchronous form (with one worker it reproduces TF's
asynchronous numbers exactly); ``"async"`` (:class:`~.async_centre.AsyncCentre`) keeps it on a
server rank, TF's asynchronous form.  TF's ``synchronous`` flag (a start-up barrier) is accepted;
in ``"allreduce"`` mode start-up is always synchronised by the initial broadcast.
TF arguments without equivalent: ``ea_custom_getter``, ``use_locking``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..common.apply import GradsAndVars
from ..hosting.closing import close_at_exit, closed
from ..wrappers.wrapper import WrapperOptimizer, check_int
from .async_centre import CENTRE_MODES  # with "async" registered
from .centre import CentreStrategy

__all__ = ["ElasticAverageOptimizer"]

_OWNER = "ElasticAverageOptimizer"


def _check_real(name: str, value: Any, allowed: str, ok: Any) -> float:
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and ok(value)):
        raise ValueError(f"{_OWNER}: {name} must be a number {allowed}, got {value!r}")
    return float(value)


def _group_lr(group: dict[str, Any]) -> float:
    """The group's current learning rate as a float (a callable lr is called, as TF does)."""
    lr = group.get("lr", group.get("learning_rate"))
    if callable(lr):
        lr = lr()
    if isinstance(lr, torch.Tensor):
        lr = lr.detach().reshape(()).item()
    return float(lr) if isinstance(lr, (int, float)) else float("nan")


class ElasticAverageOptimizer(WrapperOptimizer):
    """Wrap ``opt`` with elastic averaging towards a centre variable.

    Args:
        opt: any ``torch.optim.Optimizer`` over the local replica.
        num_worker: number of workers; must equal the process group's world size.
        communication_period: ``tau``, local steps between elastic exchanges (>= 1).
        moving_rate: ``alpha`` in (0, 1]; default ``0.9 / (tau * num_worker)``.
        rho: elastic penalty in the loss (>= 0); default ``moving_rate / lr`` per group.
        synchronous: TF's start-up barrier flag (implied in ``"allreduce"`` mode).
        mode: ``"allreduce"``, ``"async"`` or a :class:`CentreStrategy` instance (e.g.
            ``AsyncCentre(server_rank=..., timeout=...)`` for the server's options).
        process_group: group of the workers (default: the default group).
        name: returned by ``get_name()``.
    """

    BETA = 0.9

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        num_worker: int,
        communication_period: int = 10,
        moving_rate: float | None = None,
        rho: float | None = None,
        synchronous: bool = False,
        *,
        mode: str | CentreStrategy = "allreduce",
        process_group: dist.ProcessGroup | None = None,
        name: str = "ElasticAverageOptimizer",
    ) -> None:
        check_int(_OWNER, "num_worker", num_worker, 1)
        check_int(_OWNER, "communication_period", communication_period, 1)
        if moving_rate is None:
            alpha = self.BETA / communication_period / num_worker
        else:
            alpha = _check_real("moving_rate", moving_rate, "in (0, 1]", lambda v: 0 < v <= 1)
        if rho is not None:
            rho = _check_real("rho", rho, ">= 0", lambda v: v >= 0)
        if not isinstance(synchronous, bool):
            raise ValueError(f"{_OWNER}: synchronous must be a bool, got {synchronous!r}")
        strategy = self._make_strategy(mode)
        super().__init__(opt, name)
        if rho is None:
            for i, group in enumerate(self.param_groups):
                if not _group_lr(group) > 0:
                    raise ValueError(
                        f"{_OWNER}: rho=None means rho = moving_rate / learning_rate, but "
                        f"param_groups[{i}] has no positive 'lr'; pass rho explicitly"
                    )
        self._comm = strategy.resolve_collective(num_worker, process_group, _OWNER)
        strategy.configure(num_worker, synchronous)
        self.num_worker = num_worker
        self.communication_period = communication_period
        self.moving_rate = alpha
        self.rho = rho
        self.synchronous = synchronous
        self.local_step = 0
        self.global_step = 0
        self._strategy = strategy
        params = self.params()
        strategy.setup(params, self._comm)
        self._local_centre = [p.detach().clone() for p in params]
        self._index = {id(p): i for i, p in enumerate(params)}
        close_at_exit(self)  # a program that never calls close() still leaves cleanly

    @staticmethod
    def _make_strategy(mode: str | CentreStrategy) -> CentreStrategy:
        if isinstance(mode, CentreStrategy):
            return mode
        if isinstance(mode, str) and mode in CENTRE_MODES:
            return CENTRE_MODES[mode]()
        raise ValueError(f"{_OWNER}: mode must be one of {sorted(CENTRE_MODES)}, got {mode!r}")

    @property
    def mode(self) -> str:
        return self._strategy.mode

    # ----------------------------------------------------------------- elastic penalty
    def _rho_by_param(self) -> dict[int, float]:
        out = {}
        for group in self.param_groups:
            r = self.rho if self.rho is not None else self.moving_rate / _group_lr(group)
            out.update({id(p): r for p in group["params"]})
        return out

    def compute_gradients(self, loss: Any, var_list: Any = None) -> GradsAndVars:
        """Gradients of ``loss + rho/2 * sum ||x - c_loc||^2`` (TF's elastic penalty)."""
        pairs = super().compute_gradients(loss, var_list=var_list)
        rhos = self._rho_by_param()
        out: GradsAndVars = []
        for g, v in pairs:
            i = self._index.get(id(v))
            if i is None or rhos[id(v)] == 0.0:
                out.append((g, v))
                continue
            pen = (v.detach() - self._local_centre[i]).mul_(rhos[id(v)])
            if g is not None:
                pen = pen + (g.to_dense() if g.is_sparse else g)
            out.append((pen, v))
        return out

    def add_elastic_penalty_(self) -> None:
        """Add ``rho * (x - c_loc)`` to every parameter's ``.grad`` (torch-style loops)."""
        rhos = self._rho_by_param()
        with torch.no_grad():
            for p, c in zip(self.params(), self._local_centre, strict=True):
                if rhos[id(p)] == 0.0:
                    continue
                pen = (p.detach() - c).mul_(rhos[id(p)])
                if p.grad is None:
                    p.grad = pen
                elif p.grad.is_sparse:
                    p.grad = p.grad.to_dense() + pen
                else:
                    p.grad.add_(pen)

    # ----------------------------------------------------------------- schedule
    def _after_local_step(self) -> int:
        self.local_step += 1
        if self.local_step % self.communication_period != 0:
            return 0
        self._local_centre = self._strategy.exchange(self.params(), self.moving_rate)
        advance = self._strategy.global_step_increment()
        self.global_step += advance
        return advance

    def close(self) -> None:
        """End of training, on every worker: asynchronous mode leaves the server (whose rank
        serves until every worker left) and stops its threads; the all-reduce mode has
        nothing to release.  Called at the interpreter's exit if the program did not
        (:mod:`..closing`)."""
        closed(self)
        self._strategy.close()

    # ----------------------------------------------------------------- centre access/export
    def centre(self) -> list[torch.Tensor]:
        """The centre variables (TF's ``global_center_variable``), in parameter order."""
        return self._strategy.centre()

    def local_centre(self) -> list[torch.Tensor]:
        """The cached centre used by the penalty (TF's ``local_center_variable``)."""
        return self._local_centre

    def swapping_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with every parameter this optimizer manages replaced by its
        centre value: TF's ``swapping_saver``. Load it into a plain model for evaluation."""
        centre = self.centre()
        state = module.state_dict()
        swapped = 0
        for name, p in module.named_parameters():
            i = self._index.get(id(p))
            if i is not None and name in state:
                state[name] = centre[i].detach().clone()
                swapped += 1
        if not swapped:
            raise RuntimeError(
                f"{_OWNER}.swapping_state_dict: no parameter of this module is managed by the "
                "optimizer, so there is no centre to export"
            )
        return state

    # ----------------------------------------------------------------- checkpoints
    def _wrapper_state(self) -> dict[str, Any]:
        return {
            "local_step": self.local_step,
            "global_step": self.global_step,
            "num_worker": self.num_worker,
            "communication_period": self.communication_period,
            "mode": self.mode,
            "centre": self._strategy.state_dict(),
            "local_centre": [c.clone() for c in self._local_centre],
        }

    def _check_wrapper_state(self, counters: dict[str, Any]) -> None:
        super()._check_wrapper_state(counters)
        for key in ("num_worker", "communication_period", "mode"):
            if counters[key] != getattr(self, key):
                raise ValueError(
                    f"{_OWNER}.load_state_dict: checkpoint has {key}={counters[key]!r}, this "
                    f"optimizer {getattr(self, key)!r}"
                )
        shapes = [tuple(c.shape) for c in counters["local_centre"]]
        if shapes != [tuple(p.shape) for p in self.params()]:
            raise ValueError(f"{_OWNER}.load_state_dict: centre shapes do not match parameters")

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        self.local_step = int(state["local_step"])
        self.global_step = int(state["global_step"])
        self._strategy.load_state_dict(state["centre"])
        with torch.no_grad():
            for c, v in zip(self._local_centre, state["local_centre"], strict=True):
                c.copy_(v)
