"""gradfleet.distributed.init(): torchrun's environment, idempotence, no launcher, user group."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradfleet.distributed import init
from gradfleet.distributed.testing import run_ranks
from gradfleet.distributed.transport import process_group
from tests.distributed import ranks

pytestmark = pytest.mark.timeout(60)


def _documented_default(rank: int, ranks_here: int) -> tuple[str, torch.device]:
    """init()'s documented choice on this machine (docs/distributed.md): the combined
    backend when every local rank gets a GPU of its own, gloo on the CPU otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= ranks_here:
        return "cpu:gloo,cuda:nccl", torch.device("cuda", rank)
    return "gloo", torch.device("cpu")


def test_init_from_torchrun_environment():
    # On a CPU machine gloo; on a one-GPU machine gloo after a warning; with >= 2 GPUs the
    # combined backend, and the CPU all-reduce below still works (it goes over gloo).
    out = run_ranks(ranks.init_from_env, 2, rendezvous="env")
    for rank, res in enumerate(out):
        info = res["info"]
        assert (info.rank, info.world_size, info.local_rank) == (rank, 2, rank)
        assert (info.backend, info.device) == _documented_default(rank, 2)
        assert res["again"] == info and res["sum"] == 2.0


def test_default_backend_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process_group._default_backend(4) == ("gloo", None)


@pytest.mark.parametrize("gpus,ranks_here", [(1, 1), (2, 2), (8, 2)])
def test_default_backend_is_combined_with_a_gpu_per_rank(monkeypatch, gpus, ranks_here):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert process_group._default_backend(ranks_here) == ("cpu:gloo,cuda:nccl", None)


def test_default_backend_falls_back_to_gloo_when_ranks_outnumber_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    backend, why = process_group._default_backend(2)
    assert backend == "gloo"
    assert "2 ranks on this machine but 1 CUDA device(s)" in why and "backend='gloo'" in why


def test_ranks_on_this_machine(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert process_group._ranks_on_this_machine(env_ok=True) == 4  # torchrun's count wins
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert process_group._ranks_on_this_machine(env_ok=True) == 8  # no launcher: one machine
    assert process_group._ranks_on_this_machine(env_ok=False) == 1


def init_with_one_fake_gpu(ctx) -> dict:
    """Two ranks on a machine that claims one GPU (CUDA faked in this rank process only)."""
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = init(timeout=7)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"info": info, "warned": [str(w.message) for w in caught], "sum": t.item()}


def test_init_falls_back_to_gloo_with_a_warning_when_ranks_outnumber_gpus():
    out = run_ranks(init_with_one_fake_gpu, 2, rendezvous="env")
    for res in out:
        assert (res["info"].backend, res["info"].device) == ("gloo", torch.device("cpu"))
        assert any("2 ranks on this machine but 1 CUDA device" in w for w in res["warned"])
        assert res["sum"] == 2.0


def disagree_on_fallback(ctx) -> str:
    try:
        process_group._agree_on_fallback(fell_back=ctx.rank == 0)
    except RuntimeError as exc:
        return f"{exc} initialized={dist.is_initialized()}"
    return "no error"


def test_ranks_that_chose_different_backends_fail_together():
    out = run_ranks(disagree_on_fallback, 2)
    for msg in out:
        assert "1 rank(s) fell back to gloo" in msg and "1 chose 'cpu:gloo,cuda:nccl'" in msg
        assert msg.endswith("initialized=False")


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
