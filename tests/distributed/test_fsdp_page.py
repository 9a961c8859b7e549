"""docs/fsdp.md ("FSDP2, DDP, ZeRO and torch.compile"): its code blocks run.

The first three blocks (FSDP2 + checkpoint, DDP + ZeRO, HSDP + model averaging) run in that
order in one namespace on 4 gloo ranks, as the page's script would under torchrun; the
torch.compile block runs in this process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import gradfleet as gf
from gradfleet.distributed.testing import run_ranks
from tests.doc_blocks import claimed_blocks


def section_blocks() -> list[str]:
    return claimed_blocks("docs/fsdp.md", __file__)


def run_page_blocks(ctx) -> dict:
    from torch.distributed.tensor import DTensor

    os.chdir(ctx.workdir)  # the page writes its checkpoint to ./checkpoint
    namespace: dict = {}
    fsdp, zero, hsdp = section_blocks()[:3]
    exec(fsdp, namespace)  # noqa: S102 - the page's own example
    out = {
        "fsdp_dtensor": all(isinstance(p, DTensor) for p in namespace["model"].parameters()),
        "fsdp_slots": sorted({k for s in namespace["opt"].state.values() for k in s}),
        "checkpoint": os.path.isdir("checkpoint"),
    }
    exec(zero, namespace)  # noqa: S102
    out["zero"] = type(namespace["opt"].optim).__name__
    exec(hsdp, namespace)  # noqa: S102
    opt, model = namespace["opt"], namespace["model"]
    flat = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat)
    out["hsdp_rounds"] = opt.global_step
    out["replicas_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    return out


def test_page_has_the_four_examples():
    blocks = section_blocks()
    assert len(blocks) == 4
    assert "fully_shard" in blocks[0] and "ZeroRedundancyOptimizer" in blocks[1]
    assert "init_device_mesh" in blocks[2] and "torch.compile" in blocks[3]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_fsdp_zero_hsdp_examples_run_on_4_ranks():
    for out in run_ranks(run_page_blocks, 4, timeout=150, pg_timeout=60):
        assert out["fsdp_dtensor"] and out["checkpoint"]
        assert out["fsdp_slots"] == ["accum", "linear"]
        assert out["zero"] == "AdamOptimizer"
        assert out["hsdp_rounds"] == 2 and out["replicas_equal"]


@pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="torch.compile(opt.step, fullgraph=True) is supported from torch 2.13 "
    "(docs/releases.md): torch 2.8's dynamo stops on an unsupported method call",
)
@pytest.mark.compile
def test_torch_compile_example_runs():
    # a fresh dynamo, as the other compile tests start with: after a compiled step raised in
    # this process (tests/test_torch_compile.py's refused value), torch 2.13's dynamo keeps
    # skip marks on the generator code it fell back on, and a later fullgraph compile that
    # inlines that code stops with "Attempt to trace generator"
    torch._dynamo.reset()
    namespace = {"torch": torch, "gf": gf}
    exec(section_blocks()[3], namespace)  # noqa: S102
    assert namespace["opt"].state  # the compiled step created and updated the slots
