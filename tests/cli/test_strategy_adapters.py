"""The strategy adapters as the CLI and the cluster benchmark build them (the table's ``adapter``):
torch DDP (the benchmark's reference, in the table but not offered by ``--strategy``), the
transfer-only step on zero gradients, and sync-replicas' benchmark arguments.

The reference for training is a float64 simulation in this process: Adam on the mean of the
ranks' gradients (a synchronous step of every replica), after as many Adam steps on zero
gradients as transfer-only steps ran.  Two gloo ranks (``run_ranks``, never hanging)."""

from __future__ import annotations

import pytest
import torch

from gradfleet.cli.strategy_table import STRATEGIES, TABLE, validate_strategy
from gradfleet.distributed.testing import run_ranks

from . import adapter_ranks as ar

WORLD, TRANSFERS, STEPS = 2, 2, 3
# mean-gradient strategies: (name, args) -> the simulation applies
MEAN = [
    ("ddp", {}),
    ("allreduce", {}),
    ("sync-replicas", {"replicas_to_aggregate": 2, "server_ranks": [0], "with_model": False}),
]
# transfer-only steps on zero gradients move no parameter, whatever the exchange
STILL = [
    ("none", {}),
    ("model-average", {"interval": 2}),
    ("easgd", {"period": 2}),
    ("easgd", {"mode": "async", "period": 2}),
]
# sync-replicas sharded over both ranks: what the benchmark's arguments build
SHARDED = {"replicas_to_aggregate": 2, "server_ranks": [0, 1], "shard_assignment": "bytes"}
FLAGS = [
    dict(SHARDED, with_model=False),
    dict(SHARDED, with_model=False, stream_reads=True),
    dict(SHARDED, with_model=False, overlap=True, nonfinite="apply"),
]


def simulate() -> list[torch.Tensor]:
    m = ar.model()
    opt = torch.optim.Adam(m.parameters(), lr=ar.LR)
    for _ in range(TRANSFERS):
        opt.zero_grad(set_to_none=False)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD):
            m.zero_grad()
            ar.loss_fn(m, *ar.batch(rank, step)).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        for p, *gs in zip(m.parameters(), *grads, strict=True):
            p.grad = sum(gs) / WORLD
        opt.step()
    return [p.detach() for p in m.parameters()]


@pytest.fixture(scope="module")
def driven() -> list[list[dict]]:
    configs = [(n, a, TRANSFERS, STEPS) for n, a in MEAN]
    configs += [(n, a, 4, 0) for n, a in STILL] + [("sync-replicas", a, 2, 1) for a in FLAGS]
    return run_ranks(ar.drive, WORLD, args=(configs,), timeout=240, pg_timeout=60)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(MEAN)), ids=[n for n, _ in MEAN])
def test_mean_gradient_strategies_train_as_adam_on_the_mean(driven, index):
    want = simulate()
    for rank in range(WORLD):
        got = driven[rank][index]
        _equal(got["after_transfer"], got["start"])  # zero gradients: Adam moves nothing
        for g, w in zip(got["final"], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        # every step, transfer-only or not, is one update of the model
        assert got["updates"] == list(range(1, TRANSFERS + STEPS + 1))
    _equal(driven[0][index]["final"], driven[1][index]["final"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(STILL)), ids=[f"{n}{a}" for n, a in STILL])
def test_transfer_steps_move_no_parameter_and_count_as_updates(driven, index):
    for rank in range(WORLD):
        got = driven[rank][len(MEAN) + index]
        _equal(got["final"], got["start"])
        assert got["updates"] == [1, 2, 3, 4]


@pytest.mark.timeout(300)
def test_sync_replicas_builds_what_the_benchmark_asks(driven):
    first = len(MEAN) + len(STILL)
    plain, streamed, overlapped = (driven[0][first + i] for i in range(len(FLAGS)))
    # the model left out: whole parameters on the ranks as named, read in step()
    assert plain["server_ranks"] == [0, 1] and not plain["streaming"] and not plain["overlap"]
    assert streamed["streaming"] and not streamed["overlap"]
    assert overlapped["overlap"] and not overlapped["streaming"]
    for rank in range(WORLD):
        for got in driven[rank][first:]:
            _equal(got["after_transfer"], got["start"])
            assert got["updates"] == [1, 2, 3]


@pytest.mark.timeout(120)
def test_sync_replicas_nonfinite_reaches_the_wrapper():
    """Sharded overlap needs nonfinite="apply": left at "raise", the wrapper refuses it."""
    errors = run_ranks(ar.build_error, WORLD, args=(dict(SHARDED, overlap=True),), timeout=90)
    assert all("overlap" in e and "nonfinite" in e for e in errors), errors


def test_ddp_is_in_the_table_but_not_offered_by_strategy():
    assert "ddp" in TABLE and "ddp" not in STRATEGIES
    assert {n for n, s in TABLE.items() if s.cli} == set(STRATEGIES)
    with pytest.raises(ValueError, match="unknown strategy 'ddp'; valid: none, allreduce"):
        validate_strategy("ddp", {}, 2)
    validate_strategy("ddp", {}, 2, TABLE)
    with pytest.raises(ValueError, match=r"strategy ddp does not take \['x'\]"):
        validate_strategy("ddp", {"x": 1}, 2, TABLE)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"replicas_to_aggregate": 2, "transport": "server", "max_losses": 1}, "needs no server"),
        ({"replicas_to_aggregate": 2, "shards": 2, "max_losses": 1}, "needs no server"),
        ({"replicas_to_aggregate": 2, "max_losses": 2}, "at most total_num_replicas - "),
        ({"replicas_to_aggregate": 3, "max_losses": 3}, "fewer losses than the workers"),
        (
            {"replicas_to_aggregate": 2, "transport": "allreduce", "max_losses": 2},
            "at most total_num_replicas - replicas_to_aggregate",
        ),
        ({"replicas_to_aggregate": 3, "max_losses": "one"}, "max_losses must be an integer"),
    ],
)
def test_max_losses_refused_before_launch(args, match):
    with pytest.raises(ValueError, match=match):
        validate_strategy("sync-replicas", args, 3)
    validate_strategy("sync-replicas", {"replicas_to_aggregate": 3, "max_losses": 2}, 3)
    allowed = {"replicas_to_aggregate": 2, "transport": "allreduce", "max_losses": 1}
    validate_strategy("sync-replicas", allowed, 3)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"replicas_to_aggregate": 2, "hear_every_worker": False}, "backups without a server"),
        (
            {"replicas_to_aggregate": 3, "transport": "allreduce", "hear_every_worker": False},
            "replicas_to_aggregate=3 of 3",
        ),  # fmt: skip
        (
            {"replicas_to_aggregate": 2, "transport": "allreduce", "hear_every_worker": "no"},
            "hear_every_worker must be one of true, false",
        ),  # fmt: skip
    ],
)
def test_hear_every_worker_refused_where_it_does_not_apply(args, match):
    with pytest.raises(ValueError, match=match):
        validate_strategy("sync-replicas", args, 3)
    for value in (True, False):
        ok = {"replicas_to_aggregate": 2, "transport": "allreduce", "hear_every_worker": value}
        validate_strategy("sync-replicas", ok, 3)


def test_auto_without_a_server_is_accepted_and_checked_like_backups():
    """``replicas_to_aggregate=auto,transport=allreduce``: every rank chooses alike (no
    server); hear_every_worker applies there, and losses up to workers - 1."""
    auto = {"replicas_to_aggregate": "auto", "transport": "allreduce"}
    validate_strategy("sync-replicas", auto, 3)
    validate_strategy("sync-replicas", {**auto, "hear_every_worker": False, "max_losses": 2}, 3)
    with pytest.raises(ValueError, match="fewer losses than the workers"):
        validate_strategy("sync-replicas", {**auto, "max_losses": 3}, 3)
