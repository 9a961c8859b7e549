"""SyncReplicas's exchanges over real ranks against float64 references: the default all-reduce
exchange (R == N, no server named; overlapped with backward, resent when a gradient changed
after it left), a named server with one gradient per worker per update, and plain ``for``
loops that either finish or fail at once naming the cause."""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed.sync.worker.allreduce import AllReduceExchange
from gradfleet.distributed.sync.worker.buckets import Buckets
from gradfleet.distributed.sync.worker.serverless import any_nonfinite, nonfinite_screen
from gradfleet.distributed.testing import RankKilled, run_ranks

from . import exchange_ranks

pytestmark = pytest.mark.timeout(180)

# float64 throughout: the exchanges sum N gradients in another order than the reference, so
# each update differs by a few ulps of its terms; Adam's step is about lr per element, so
# 1e-10 leaves a margin of 1e4 over that rounding and is far below any real difference
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "clip", "accumulate"])
def test_default_allreduce_exchange_matches_the_reference(mode):
    steps = 4
    out = run_ranks(exchange_ranks.lockstep_job, 3, args=(steps, mode, {}, 8), timeout=120)
    want = exchange_ranks.simulate_lockstep(3, steps, mode)
    for o in out:
        assert o["transport"] == "allreduce" and o["global_step"] == steps
        for got, ref in zip(o["params"], want, strict=True):
            torch.testing.assert_close(got, ref, **TOL)
        assert o["counters"] == {"accepted": steps, "dropped": 0}
    # plain: the buckets but the last (it carries the flags) went out during backward and
    # overlap stayed on; clipping or a second backward changed the gradients after they
    # left: sent again, overlap off
    assert all(o["buckets"] == 4 for o in out)
    if mode == "plain":
        assert all(o["sent_in_backward"] == 3 * steps for o in out)
    else:
        assert all(o["sent_in_backward"] > 0 for o in out)
    assert all(o["overlap"] is (mode == "plain") for o in out)


@pytest.mark.slow
def test_default_allreduce_exchange_without_overlap_matches_the_reference():
    out = run_ranks(exchange_ranks.lockstep_job, 2, args=(3, "clip", {"overlap": False}))
    want = exchange_ranks.simulate_lockstep(2, 3, "clip")
    for o in out:
        assert o["sent_in_backward"] == 0
        for got, ref in zip(o["params"], want, strict=True):
            torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.slow
def test_named_server_takes_one_gradient_from_each_worker():
    """R = N = 4 with the server inside rank 0, which reaches it first every time: every
    update takes one gradient from each worker, computed on the current variables (TF's
    shared tokens let rank 0 fill updates alone and waste a round at the start)."""
    steps = 5
    out = run_ranks(exchange_ranks.lockstep_job, 4, args=(steps, "plain", {"server_rank": 0}))
    want = exchange_ranks.simulate_lockstep(4, steps, "plain")
    assert out[0]["server_counters"] == {
        r: {"accepted": steps, "dropped": 0, "nonfinite": 0} for r in range(4)
    }
    for o in out:
        assert o["transport"] == "server" and o["global_step"] == steps
        for got, ref in zip(o["params"], want, strict=True):
            torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.slow
def test_allreduce_exchange_sparse_rows_and_missing_gradients():
    out = run_ranks(exchange_ranks.sparse_and_missing, 3)
    # the server's rule: rows averaged over the ranks that sent them, dense None as zeros,
    # a parameter without any gradient untouched
    emb = torch.zeros(4, 2, dtype=torch.float64)
    for r in range(3):
        emb[r] -= torch.tensor([1.0, 2.0], dtype=torch.float64)
    emb[3] -= torch.tensor([(10.0 + 20.0 + 30.0) / 3, 1.0], dtype=torch.float64)
    bias = -torch.tensor([3.0, 6.0, 9.0], dtype=torch.float64) / 3
    for o in out:
        assert o["transport"] == "allreduce" and o["global_step"] == 1
        torch.testing.assert_close(o["emb"], emb, rtol=0, atol=1e-15)
        torch.testing.assert_close(o["bias"], bias, rtol=0, atol=1e-15)
        torch.testing.assert_close(o["unused"], torch.ones(2, dtype=torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, {"server_rank": 0}, {"server_ranks": [0, 1]}])
def test_a_fixed_length_loop_finishes(kwargs):
    out = run_ranks(
        exchange_ranks.fixed_loop, 2, args=(12, dict(kwargs, replicas_to_aggregate=2), None)
    )
    for o in out:
        assert o["error"] is None and o["steps"] == 12 and o["global_step"] == 12


@pytest.mark.slow
def test_a_fixed_length_loop_with_a_backup_fails_at_once_naming_the_cause():
    """R = 2 of N = 3, rank 2 slow: ranks 0 and 1 finish their 8 steps and leave; rank 2's
    next gradient can never be joined by a second one, and it hears so at once (the timeout
    is 30 s)."""
    kwargs = {"replicas_to_aggregate": 2, "total_num_replicas": 3, "server_rank": 0}
    out = run_ranks(exchange_ranks.fixed_loop, 3, args=(8, kwargs, 2), timeout=120)
    assert out[0]["error"] is None and out[1]["error"] is None
    assert out[0]["steps"] == out[1]["steps"] == 8
    error = out[2]["error"]
    assert error is not None and error.startswith("RuntimeError"), error
    assert "can never be made" in error and "left at global step" in error
    assert "global_step reaches" in error
    assert out[2]["end"] - max(out[0]["end"], out[1]["end"]) < 10.0


@pytest.mark.slow
def test_shared_tokens_loop_never_waits_for_the_timeout():
    """TF's shared tokens (the issue's plain loop): a fast worker may give two gradients to
    one update and finish first; the other then fails at once naming the cause, or finishes
    -- never a wait for the 30 s timeout."""
    kwargs = {"replicas_to_aggregate": 2, "tokens": "shared", "server_rank": 0}
    out = run_ranks(exchange_ranks.fixed_loop, 2, args=(30, kwargs, None), timeout=120)
    for o in out:
        if o["error"] is not None:
            assert o["error"].startswith("RuntimeError") and "can never be made" in o["error"]
    assert max(o["end"] for o in out) - min(o["end"] for o in out) < 10.0


def test_buckets_follow_ddp_layout():
    params = [torch.zeros(1 << 17), torch.zeros(8, dtype=torch.float64), torch.zeros(1 << 18)]
    b = Buckets(params, first_bytes=1 << 20, bytes_each=1 << 21)
    # reverse order; the 1 MiB float32 tensor fills the first bucket; dtypes never mix
    assert b.members == [[2], [1], [0]]
    assert [f.dtype for f in b.flat] == [torch.float32, torch.float64, torch.float32]
    b.fill(0, torch.ones(1 << 17))
    b.fill(1, torch.sparse_coo_tensor([[1, 1, 5]], [1.0, 2.0, 4.0], (8,)))
    assert b.flat[2].sum() == 1 << 17
    assert b.flat[1].tolist() == [0, 3, 0, 0, 0, 4, 0, 0]
    b.fill(1, None)
    assert not b.flat[1].any()


@pytest.mark.slow
def test_default_allreduce_exchange_names_a_lost_peer():
    out = run_ranks(exchange_ranks.lost_peer, 2, timeout=90, kill_on={1: "die"})
    assert out[1] == RankKilled(1)
    assert out[0].startswith("RuntimeError") and "did not join the all-reduce" in out[0], out[0]


def test_only_a_link_error_is_reported_as_a_missing_peer():
    """A collective's gloo error (a plain RuntimeError from gloo's transport) or NCCL's
    (torch's ``DistBackendError``) becomes the error that names a missing peer; a bug in the
    call (a TypeError, torch's RuntimeError for a shape mismatch) is raised as itself, not
    disguised as a lost peer."""
    exchange = AllReduceExchange.__new__(AllReduceExchange)  # only its error handling
    exchange.world, exchange.rank, exchange.max_losses = 2, 0, 0

    def lost() -> None:
        raise torch.distributed.DistBackendError("Connection closed by peer [10.0.0.2]:4242")

    def bug() -> None:
        raise TypeError("all_reduce() got an unexpected keyword argument 'opp'")

    def gloo_lost() -> None:  # gloo's own: a plain RuntimeError, as torch 2.13 raises it
        raise RuntimeError(
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [10.0.0.2]:4242. This is typically caused by a remote worker crashing."
        )

    def shapes() -> None:  # torch's shape mismatch: a RuntimeError too, and a bug
        torch.ones(3).add_(torch.ones(4))

    with pytest.raises(RuntimeError, match="rank 0: a peer did not join the all-reduce"):
        exchange._collective(lost)
    with pytest.raises(RuntimeError, match="did not join.*gloo_lost failed: .*Connection closed"):
        exchange._collective(gloo_lost)
    with pytest.raises(TypeError, match="unexpected keyword argument 'opp'"):
        exchange._collective(bug)
    with pytest.raises(RuntimeError, match=r"size of tensor a \(3\) must match") as raised:
        exchange._collective(shapes)
    assert "did not join" not in str(raised.value)


def test_layout_for_the_job():
    from torch import nn

    from gradfleet import GradientDescentOptimizer, NormalizedSGD
    from gradfleet.distributed import ExponentialMovingAverage
    from gradfleet.distributed.sync.layout.shard_layout import choose_layout

    big = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))  # 8 MiB
    opt = GradientDescentOptimizer(big.parameters(), 0.1)
    # 8 MiB over 2 ranks: 2 shards of >= 2 MiB each per rank, in backward's order
    assert choose_layout(opt, [0, 1], big, None) == ("backward_order", [0, 1, 0, 1])
    assert choose_layout(opt, [0, 1, 2, 3], big, None) == ("backward_order", [0, 1, 2, 3])
    assert choose_layout(opt, [0, 1], None, None) == ("bytes", [0, 1])  # no model
    # one server: its shards in backward's order, values out while gradients come in
    assert choose_layout(opt, [0], big, None) == ("backward_order", [0, 0, 0, 0])
    assert choose_layout(opt, [0, 1, 0, 1], big, None) == ("bytes", [0, 1, 0, 1])  # by hand
    ema = ExponentialMovingAverage(0.9)
    assert choose_layout(opt, [0, 1], big, ema) == ("bytes", [0, 1])
    norm = NormalizedSGD(big.parameters(), 0.1)  # a per-tensor norm: no cut
    assert choose_layout(norm, [0, 1], big, None) == ("bytes", [0, 1])
    sparse = nn.Sequential(nn.Embedding(100000, 32, sparse=True), nn.Linear(32, 1))
    opt = GradientDescentOptimizer(sparse.parameters(), 0.1)
    assert choose_layout(opt, [0, 1], sparse, None) == ("bytes", [0, 1])
    small = nn.Linear(8, 1)
    opt = GradientDescentOptimizer(small.parameters(), 0.1)
    assert choose_layout(opt, [0, 1], small, None) == ("backward_order", [0, 1])
    assert choose_layout(opt, [0], small, None) == ("bytes", [0])  # too small to cut


def _same_variables(a: list[dict], b: list[dict]) -> None:
    """Every worker of two runs ends on the very same variables."""
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x["params"], y["params"], strict=True):
            torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.slow
def test_layout_for_the_job_gives_the_numbers_of_whole_parameters():
    """Named shards with the model given (backward order, 2 shards per rank; reads streamed
    either way) end on the very variables of whole parameters by bytes."""
    auto = run_ranks(exchange_ranks.laid_out, 2, args=(None,))
    whole = run_ranks(exchange_ranks.laid_out, 2, args=("bytes",))
    assert auto[0]["assignment"] == "backward_order" and auto[0]["streaming"]
    assert whole[0]["assignment"] == "bytes" and whole[0]["streaming"]
    _same_variables(auto, whole)


@pytest.mark.slow
@pytest.mark.parametrize("server", [0, 2], ids=["on-a-worker", "dedicated"])
def test_one_server_laid_out_for_the_job_gives_the_numbers_of_one_whole_server(server):
    """One server (on rank 0, or a dedicated rank 2) with the model given: 4 shards on that
    rank in backward order (reads streamed), the very variables of the one whole server."""
    world = 3 if server == 2 else 2
    auto = run_ranks(exchange_ranks.laid_out, world, args=(None, [server]), timeout=120)
    whole = run_ranks(exchange_ranks.laid_out, world, args=("bytes", [server]), timeout=120)
    assert auto[0]["assignment"] == "backward_order" and auto[0]["shards"] == [server] * 4
    assert auto[0]["streaming"]
    assert whole[0]["assignment"] == "bytes" and whole[0]["shards"] == [server]
    assert auto[2:] == whole[2:] == [{"served": "SyncReplicasOptimizer"}] * (world - 2)
    _same_variables(auto[:2], whole[:2])


def test_backup_workers_with_no_server_named_run_without_one_and_lose_any_host():
    """R = 2 of 3, no server named, CPU parameters on gloo: the first R ready all-reduce,
    every rank keeps the state and the job goes on without N - R = 1 lost worker, any rank."""
    backups = run_ranks(exchange_ranks.backups_layout, 3, args=(None,))
    assert all(b["exchange"] == "FirstArrivalsExchange" for b in backups), backups
    assert all(b["max_losses"] == 1 for b in backups), backups


def test_backup_workers_on_a_server_with_no_rank_named_lay_out_rank_0():
    """R = 2 of 3, ``transport="server"``, no server rank named, the model given: the chief on
    rank 0 keeps a standby (on rank 1) and its variables whole, one shard; without a standby,
    4 shards on rank 0 (no variables on the other workers), reads streamed."""
    backups = run_ranks(exchange_ranks.backups_layout, 3, args=("server",))
    for b in backups:
        assert b["exchange"] == "ServerExchange", backups
        assert b["shards"] == [0] and b["standby"] == 1 and not b["streaming"], backups
    backups = run_ranks(exchange_ranks.backups_layout, 3, args=("server", False))
    for b in backups:
        assert b["shards"] == [0, 0, 0, 0] and b["streaming"], backups
        assert b["standby"] is None, backups


@pytest.mark.slow
def test_default_allreduce_exchange_refuses_a_nonfinite_gradient_on_every_rank():
    out = run_ranks(exchange_ranks.nonfinite_once, 2)
    for o in out:
        ((step, message),) = o["errors"]
        assert step == 1 and "non-finite gradient from rank(s) [1]" in message
        assert o["global_step"] == 3  # three updates made, the refused one not
    for a, b in zip(out[0]["params"], out[1]["params"], strict=True):
        assert torch.equal(a, b) and torch.isfinite(a).all()
    # the last update took rank 0's 1e200 (halved, times the learning rate 0.05)
    assert out[0]["params"][0][0, 0] < -1e198


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_nonfinite_screen_never_misses_and_the_exact_check_clears_overflow(dtype):
    """The screen (one Euclidean norm per tensor) is 1 for every NaN or infinity, in dense,
    sparse and complex gradients; it may be 1 for finite values whose squares overflow, and
    the exact check (the infinity-norm) then says 0.  16-bit norms accumulate in float32: a
    float16 gradient of many large elements (norm 1.9e7, beyond float16's 65504) passes."""
    cpu = torch.device("cpu")
    big = torch.finfo(dtype).max
    finite = [torch.full((4, 3), 2.0, dtype=dtype), None, torch.full((9000,), 200.0, dtype=dtype)]
    assert nonfinite_screen(finite, cpu) == 0 and any_nonfinite(finite, cpu) == 0
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = torch.ones(5, dtype=dtype)
        g[3] = bad
        sparse = torch.sparse_coo_tensor([[0, 2]], torch.tensor([1.0, bad], dtype=dtype), (4,))
        for grads in ([None, g], [sparse]):
            assert nonfinite_screen(grads, cpu) == 1 and any_nonfinite(grads, cpu) == 1
    overflow = [torch.tensor([big, 1.0], dtype=dtype)]  # finite: its square is not
    assert any_nonfinite(overflow, cpu) == 0
    if dtype in (torch.float32, torch.float64):  # 16-bit: the float32 norm holds it
        assert nonfinite_screen(overflow, cpu) == 1
    if dtype == torch.float32:
        z = torch.ones(3, dtype=torch.complex64)
        z[1] = complex(0.0, float("nan"))
        assert nonfinite_screen([z], cpu) == 1 and any_nonfinite([z], cpu) == 1
