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
