"""gradfleet.distributed.init(): torchrun's environment, idempotence, no launcher, user group."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from gradfleet.distributed import init
from gradfleet.distributed.testing import run_ranks

from . import ranks

pytestmark = pytest.mark.timeout(60)


def test_init_from_torchrun_environment():
    out = run_ranks(ranks.init_from_env, 2, rendezvous="env")
    for rank, res in enumerate(out):
        info = res["info"]
        assert (info.rank, info.world_size, info.local_rank) == (rank, 2, rank)
        assert info.backend == "gloo" and info.device == torch.device("cpu")
        assert res["again"] == info and res["sum"] == 2.0


def test_init_without_launcher_and_with_user_group():
    (solo,) = run_ranks(ranks.init_without_launcher, 1, init_process_group=False)
    assert (solo["info"].rank, solo["info"].world_size) == (0, 1)
    assert solo["after"] is False and solo["ma"] == 1  # shutdown() destroyed init()'s group
    out = run_ranks(ranks.init_after_user_group, 2)
    assert [r["info"].rank for r in out] == [0, 1]
    assert all(r["still"] for r in out)  # a group the user created is left alone


@pytest.mark.parametrize("bad", [0, -1.0, timedelta(seconds=0)])
def test_init_rejects_bad_timeout(bad):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        init(timeout=bad)
    assert not torch.distributed.is_initialized()


def test_init_rejects_bad_backend_type():
    with pytest.raises(TypeError, match="backend must be a string"):
        init(backend=3)
