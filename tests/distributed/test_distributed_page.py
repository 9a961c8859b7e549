"""docs/distributed.md's SyncReplicas example runs as the page says: on 4 gloo ranks (as under
``torchrun --nproc-per-node 4``), 3 of 4 gradients per update, until ``last_step``.

The example fits ``y = sum(x)`` with a linear model, which that model represents exactly, so the
server's variables must reach the true weights (ones) and bias (zero).
"""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed.testing import run_ranks
from tests.doc_blocks import claimed_blocks

PAGE = "docs/distributed.md"


def run_sync_replicas_block(ctx) -> dict:
    (block,) = claimed_blocks(PAGE, __file__)
    namespace: dict = {}
    exec(block, namespace)  # noqa: S102 - the page's own example
    opt, model = namespace["opt"], namespace["model"]
    return {
        "global_step": int(opt.global_step),
        "dropped": namespace["dropped"],
        "weight": model.weight.detach().clone(),
        "bias": model.bias.detach().clone(),
    }


def test_page_has_one_claimed_sync_replicas_block():
    (block,) = claimed_blocks(PAGE, __file__)
    assert "SyncReplicasOptimizer(" in block and "replicas_to_aggregate=3" in block


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sync_replicas_example_trains_on_4_ranks():
    outs = run_ranks(run_sync_replicas_block, 4, timeout=150, pg_timeout=60)
    for out in outs:
        assert out["global_step"] >= 200
    # the chief (rank 0) holds the server's variables; the model fits the target exactly
    torch.testing.assert_close(outs[0]["weight"], torch.ones(1, 8), atol=1e-3, rtol=0)
    torch.testing.assert_close(outs[0]["bias"], torch.zeros(1), atol=1e-3, rtol=0)
