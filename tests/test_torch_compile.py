"""``torch.compile(opt.step, fullgraph=True)`` on the TF core optimizers.

Each optimizer takes 4 compiled steps and 4 eager steps from the same start with the same
gradients; inductor's kernels differ from ATen's eager ones in the last bits (see
``gradfleet/kernels``), so the comparison uses the fused path's float32 tolerance
(rtol 2e-6 / atol 2e-7).  ``fullgraph=True`` makes any graph break an error.  The first step
creates the slots, so the second traces once more; later steps must reuse that graph (no
recompilation, so dynamo's recompile limit is never in reach).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import gradfleet as gf

pytestmark = pytest.mark.compile  # a graph per optimizer and schedule

CORE = {
    "AdamOptimizer": {},
    "RMSPropOptimizer": {},
    "MomentumOptimizer": {"momentum": 0.9},
    "AdagradOptimizer": {},
    "AdadeltaOptimizer": {},
    "GradientDescentOptimizer": {},
    "FtrlOptimizer": {},
}


def _train(name: str, compiled: bool, graphs: list[int]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = getattr(gf, name)(params, learning_rate=0.1, **CORE[name])
    step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        step()
        graphs.append(counters["stats"]["unique_graphs"])
    return [p.detach().clone() for p in params] + [t.clone() for t in opt.variables()]


@pytest.mark.parametrize("name", sorted(CORE))
def test_compiled_step_fullgraph_matches_eager(name):
    torch._dynamo.reset()
    counters.clear()
    graphs: list[int] = []
    eager = _train(name, False, [])
    for a, b in zip(eager, _train(name, True, graphs)):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)
    assert graphs[1] == graphs[3] <= 2, graphs


# ---------------------------------------------------------------- under torch's LR schedulers
# 12 steps whose lr (and, for OneCycleLR, beta1) changes every step.  The first call traces
# with the values as constants; the first change makes dynamo trace them as symbolic inputs
# (its automatic dynamic shapes), and every later step reuses that graph: 2 graphs, as for
# torch's own Adam.  The step is compiled before the scheduler wraps ``opt.step``.
# The compiled kernels differ from the eager ones in the last bits (inductor fuses and
# reorders float32 arithmetic): after 12 Adam steps of size <= 0.1 the difference stays
# within a few float32 ulps of |w| <= 4, bounded here by 12 steps x 2 ulps x 4.
SCHEDULE_ATOL = 12 * 2 * 4 * 2.0**-24


def _scheduled(compiled: bool, tensor_lr: bool, fullgraph: bool, one_cycle: bool):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    lr = torch.tensor(0.1) if tensor_lr else 0.1
    opt = gf.AdamOptimizer(params, lr=lr, betas=(0.95, 0.999))
    step = torch.compile(opt.step, fullgraph=fullgraph) if compiled else opt.step
    if one_cycle:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=13)
    else:
        # The first change after a few steps: the slots made by the first step must not
        # count as a change (dynamo runs ``_init_group`` eagerly before the graph).
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        step()
        sched.step()
    return [p.detach().clone() for p in params] + [t.clone() for t in opt.variables()]


@pytest.mark.parametrize(
    "tensor_lr,fullgraph,one_cycle",
    [(False, False, False), (True, True, True)],
    ids=["StepLR-float-lr", "OneCycleLR-tensor-lr-fullgraph"],
)
def test_compiled_step_under_a_schedule_makes_at_most_two_graphs(tensor_lr, fullgraph, one_cycle):
    torch._dynamo.reset()
    counters.clear()
    eager = _scheduled(False, tensor_lr, fullgraph, one_cycle)
    compiled = _scheduled(True, tensor_lr, fullgraph, one_cycle)
    assert counters["stats"]["unique_graphs"] <= 2
    assert sum(counters["graph_break"].values()) == 0
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=SCHEDULE_ATOL)


def test_compiled_step_refuses_a_bad_scheduled_value():
    # The checks of a Python number are comparisons, traced as guards: a bad value fails the
    # guard, and the retrace raises the eager step's error.  Nothing changes.
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = gf.FtrlOptimizer(params, lr=0.1)
    step = torch.compile(opt.step)
    for lr in (0.1, 0.2):
        opt.param_groups[0]["lr"] = lr
        params[0].grad = torch.ones(3)
        step()
    before = [params[0].detach().clone()] + [t.clone() for t in opt.variables()]
    opt.param_groups[0]["lr"] = 0.0
    with pytest.raises(ValueError, match="learning_rate must be > 0, got 0.0.*schedule"):
        step()
    after = [params[0].detach()] + opt.variables()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
