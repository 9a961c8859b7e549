"""docs/servers.md: every ```python block runs, and does what the page says."""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import pytest
import torch

from gradfleet.distributed.testing import run_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "servers.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def run_block(ctx, index: int, entry: str):
    """A rank of the job runs the page's block ``index`` and calls its ``entry``."""
    namespace: dict = {"__name__": "servers_doc"}
    exec(compile(blocks()[index], f"{DOC}:block{index}", "exec"), namespace)
    return namespace[entry]()


def test_the_page_has_its_three_blocks():
    assert len(blocks()) == 3


@pytest.mark.timeout(180)
def test_sync_replicas_on_two_dedicated_servers_trains():
    """Workers 0-1 train, ranks 2-3 serve and return their states (chief + shard)."""
    out = run_ranks(run_block, 4, args=(0, "main"), rendezvous="env", timeout=150)
    # 30 updates of R = 2 accepted gradients: 60 steps at least between the two workers; a
    # fast worker may take a spare token and give two gradients to one update (TF's shared
    # tokens), so one worker alone can make fewer than 30, even none when the other starts
    # first on a loaded machine. The one that made the most steps saw most of the training.
    busier, other = sorted(out[:2], key=len, reverse=True)
    assert len(busier) + len(other) >= 60 and len(busier) >= 30
    assert busier[-1] < 0.5 * busier[0]
    assert all(math.isfinite(loss) for loss in other)
    chief, shard = out[2], out[3]
    assert chief["kind"] == shard["kind"] == "SyncReplicasOptimizer"
    assert chief["server"]["global_step"] == 30 and chief["shards"] == {}
    assert chief["server"] is not None and shard["server"] is None and list(shard["shards"]) == [1]


@pytest.mark.timeout(120)
def test_easgd_centre_on_its_own_rank():
    out = run_ranks(run_block, 3, args=(1, "easgd_main"), rendezvous="env", timeout=100)
    served = out[2]
    assert served["kind"] == "AsyncCentre"
    # after both workers' last exchange the centre the server returns is the final one
    assert all(torch.isfinite(c).all() for c in served["centre"])
    assert [c.shape for c in served["centre"]] == [torch.Size([1, 4]), torch.Size([1])]


def test_checkpoint_helpers_round_trip():
    namespace: dict = {}
    exec(compile(blocks()[2], f"{DOC}:block2", "exec"), namespace)
    state = {"kind": "AsyncCentre", "centre": [torch.arange(3.0)]}
    with tempfile.TemporaryDirectory() as d:
        path = namespace["save_server_state"](state, 5, d)
        assert path.endswith("server-5.pt")
        back = namespace["load_server_state"](5, d)
    assert back["kind"] == "AsyncCentre" and torch.equal(back["centre"][0], state["centre"][0])
