"""Backup workers without a server (``transport="allreduce"``, R < N): the first R workers
ready make each update, the others receive it; checked against a float64 replay of the
updates as their leaders announced them."""

from __future__ import annotations

import pytest
import torch

from gradfleet import AdamOptimizer
from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.sync.arguments import check_overlap
from gradfleet.distributed.testing import RankKilled, free_port, run_ranks

from . import first_arrivals_ranks as fr


def replay(plan: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """TF's Adam over float64 variables: update ``k`` (from 1) takes the gradients the ranks
    ``plan[k - 1]`` computed at step ``k - 1``: the dense mean, and each sparse row's sum
    divided by the ranks that sent the row (TF's sparse accumulator)."""
    w, table = torch.nn.Parameter(fr.start_w()), torch.nn.Parameter(fr.start_table())
    opt = AdamOptimizer([w, table], fr.LR)
    for step, ranks in enumerate(plan):
        w.grad = sum(fr.gradient(r, step, w.detach()) for r in ranks) / len(ranks)
        sparse = [fr.table_gradient(r, step) for r in ranks]
        total = sum(g.to_dense() for g in sparse)
        count = sum((g.to_dense().abs().sum(1) > 0).double() for g in sparse)
        rows = count.nonzero().reshape(-1)
        values = total[rows] / count[rows].unsqueeze(1)
        table.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (4, 3)).coalesce()
        opt.step()
    return w.detach(), table.detach()


def _bit_identical_and_replayed(out: list[dict], plan: list[list[int]], most: int) -> None:
    """Every rank's variables are the same, bit for bit, and those of the float64 replay of
    ``plan`` (at most ``most`` gradients per update, summed in another order)."""
    assert out[0]["w"] == out[1]["w"] == out[2]["w"]
    assert out[0]["table"] == out[1]["table"] == out[2]["table"]
    tol = most * fr.LAST * torch.finfo(torch.float64).eps * 10
    w, table = replay(plan)
    for name, expected in (("w", w), ("table", table)):
        got = torch.tensor(out[0][name], dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.timeout(180)
def test_the_first_r_make_each_update_and_the_late_receive_it():
    out = run_ranks(fr.backups, fr.N, timeout=150)
    plan = out[0]["plan"]
    # every update of R distinct workers; every rank holds the same variables, bit for bit
    assert all(len(set(m)) == fr.R for m in plan), plan
    # ... those of the updates the members made (float64: R gradients summed in another order)
    _bit_identical_and_replayed(out, plan, fr.R)
    # the slow worker was left out while it was slow: the backups did their work
    for step in range(fr.ROTATE):
        assert step % fr.N not in plan[step], (step, plan)
    # a worker that came late dropped its gradient and received the update; one that found
    # more updates made meanwhile received them all in the same step() call, so that its next
    # gradient is of the newest step
    late = [c for o in out for c in o["calls"] if not c[1]]
    assert late and all(after > step for step, _, after in late), late
    assert any(after > step + 1 for step, _, after in late), late
    # the NaN raised on its own rank, changed nothing, and was never in an update
    nan = out[1]["nan"]
    assert isinstance(nan, dict) and nan["unchanged"] and "non-finite" in nan["error"], nan
    # the books agree with the plan on every rank
    for o in out:
        accepted = {r: o["counters"][str(r)]["accepted"] for r in range(fr.N)}
        assert accepted == {r: sum(r in m for m in plan) for r in range(fr.N)}
        assert o["history"][-1] == fr.R
    assert out[0]["counters"]["2"]["dropped"] >= 1


def test_backups_without_a_server_refuse_what_they_cannot_do():
    """Refused before any collective: the checks need no process group."""
    w = torch.nn.Parameter(torch.zeros(2))
    cases = {
        "tokens='distinct'": {"tokens": "shared"},
        "fewer than replicas_to_aggregate=2": {"max_losses": 2},
    }
    for extra, error, message in (
        ({"hear_every_worker": 0}, TypeError, "hear_every_worker must be True or False"),
        ({"transport": "server"}, ValueError, "applies to backup workers without a server"),
    ):
        with pytest.raises(error, match=message):
            SyncReplicasOptimizer(
                torch.optim.SGD([w], lr=0.1), 2, 3, worker=0,
                **{"transport": "allreduce", "hear_every_worker": False, **extra},
            )  # fmt: skip
    with pytest.raises(ValueError, match="replicas_to_aggregate=3 of 3"):
        SyncReplicasOptimizer(
            torch.optim.SGD([w], lr=0.1), 3, 3, transport="allreduce", hear_every_worker=False
        )
    for message, extra in cases.items():
        with pytest.raises(ValueError, match=message):
            SyncReplicasOptimizer(
                torch.optim.SGD([w], lr=0.1), 2, 3, transport="allreduce", worker=0, **extra
            )
    with pytest.raises(ValueError, match="known only when step"):
        check_overlap(True, "allreduce", 1, "raise", backups=True)
    assert check_overlap(None, "allreduce", 1, "raise", backups=True) is False
    with pytest.raises(ValueError, match="replicas_to_aggregate <= total_num_replicas"):
        SyncReplicasOptimizer(torch.optim.SGD([w], lr=0.1), 4, 3, transport="allreduce")


@pytest.mark.faults
@pytest.mark.timeout(180)
def test_a_lost_worker_ends_the_job_with_an_error_within_seconds():
    """Losses turned off (``max_losses=0``; by default N - R are allowed): the leaders' sends
    to the lost worker fail, and every survivor ends with an error that says a peer is gone,
    well within the 60 s timeout."""
    out = run_ranks(fr.lose_one, fr.N, timeout=150, kill_on={2: "die"})
    assert out[2] == RankKilled(2)
    for o in out[:2]:
        assert "a peer is gone" in o["error"] and "transport='allreduce'" in o["error"], o
        assert o["after_kill"] < 15, o


@pytest.mark.timeout(180)
def test_a_checkpoint_resumes_through_steps_the_store_has_seen():
    out = run_ranks(fr.resume, fr.N, timeout=150)
    first, second = out[0]["first"], out[0]["second"]
    tol = fr.R * fr.RESUME_END * torch.finfo(torch.float64).eps * 10
    for run, plan in (
        (first, first["plan"]),
        (second, first["plan"][: fr.RESUME_AT] + second["plan"]),
    ):
        assert all(len(set(m)) == fr.R for m in plan), plan
        w, _ = replay(plan)
        torch.testing.assert_close(
            torch.tensor(run["w"], dtype=torch.float64), w, rtol=tol, atol=tol
        )
    assert all(o["second"]["w"] == second["w"] for o in out)
    assert all(o["second"]["global_step"] == fr.RESUME_END for o in out)


@pytest.mark.faults
@pytest.mark.timeout(240)
@pytest.mark.parametrize("lost", [2, 1], ids=["the-backup", "a-member"])
def test_with_max_losses_the_others_go_on_and_every_update_is_made_once(lost):
    """Rank 2 is the usual backup (late, receiving); rank 1 is in most updates, so its loss
    may fall in an update's all-reduce or a send.  Either way the two left go on as 2 of 2,
    healed from the one holding the newest step: the same variables, those of the updates
    their record names (each made once, in order)."""
    out = run_ranks(
        fr.lose_and_go_on, fr.N, args=(free_port(), lost), timeout=200,
        init_process_group=False, kill_on={lost: "die"},
    )  # fmt: skip
    assert out[lost] == RankKilled(lost)
    a, b = (o for r, o in enumerate(out) if r != lost)
    assert a["w"] == b["w"] and a["table"] == b["table"]
    assert a["history"] == b["history"] and len(a["history"]) == fr.LOSS_LAST
    assert all(len(m) == fr.R for m in a["history"])
    tol = fr.R * fr.LOSS_LAST * torch.finfo(torch.float64).eps * 10
    w, table = replay(a["history"])
    torch.testing.assert_close(torch.tensor(a["w"], dtype=torch.float64), w, rtol=tol, atol=tol)
    torch.testing.assert_close(
        torch.tensor(a["table"], dtype=torch.float64), table, rtol=tol, atol=tol
    )
    for o in (a, b):
        assert [(c["event"], c["ranks"]) for c in o["changes"]] == [("lost", [lost])], o
        assert sorted(o["live"]) == [r for r in range(fr.N) if r != lost]
        assert o["longest"] < 10, o["longest"]  # a gap of a heartbeat's dead_after, not 60 s
    after = a["changes"][0]["global_step"]
    assert all(lost not in m for m in a["history"][after:])


@pytest.mark.faults
@pytest.mark.timeout(240)
def test_a_restarted_worker_rejoins_from_live_state():
    out = run_ranks(
        fr.lose_and_rejoin, fr.N + 1, args=(free_port(),), timeout=200,
        init_process_group=False, kill_on={2: "die"},
    )  # fmt: skip
    assert out[2] == RankKilled(2)
    zero, one, back = out[0], out[1], out[3]
    events = [(c["event"], c["ranks"], c["members"]) for c in zero["changes"]]
    assert events == [("lost", [2], [0, 1]), ("joined", [2], [0, 1, 2])], events
    joined = zero["changes"][1]["global_step"]
    assert back["start"] == joined and back["opened"] == []  # from a live member, no file
    assert zero["w"] == one["w"] == back["w"] and zero["table"] == back["table"]
    assert zero["history"] == back["history"] and len(zero["history"]) == fr.REJOIN_LAST
    tol = fr.R * fr.REJOIN_LAST * torch.finfo(torch.float64).eps * 10
    w, _ = replay(zero["history"])
    torch.testing.assert_close(torch.tensor(zero["w"], dtype=torch.float64), w, rtol=tol, atol=tol)
    assert sorted(back["live"]) == [0, 1, 2]


@pytest.mark.faults
@pytest.mark.timeout(240)
def test_a_worker_that_hangs_is_left_out_at_once_and_takes_its_place_again():
    """A stopped process closes no socket: without the watched waits the others would wait
    for it until the 60 s timeout."""
    out = run_ranks(fr.hang_and_return, fr.N, args=(free_port(),), timeout=200,
                    init_process_group=False)  # fmt: skip
    zero, one, two = out
    events = [(c["event"], c["ranks"]) for c in zero["changes"]]
    assert events == [("lost", [2]), ("joined", [2])], events
    assert zero["w"] == one["w"] == two["w"] and zero["history"] == two["history"]
    tol = fr.R * fr.REJOIN_LAST * torch.finfo(torch.float64).eps * 10
    w, _ = replay(zero["history"])
    torch.testing.assert_close(torch.tensor(zero["w"], dtype=torch.float64), w, rtol=tol, atol=tol)
    assert max(zero["longest"], one["longest"]) < 10, (zero["longest"], one["longest"])


@pytest.mark.timeout(180)
def test_every_worker_is_heard_and_a_recovered_one_at_once():
    """Equal ranks on loopback (one slower for the first updates): the late place rotates,
    so each rank's share of the last 50 updates is within 0.5x-1.5x of R / N, and the one
    that recovered is in at least half as many of the 10 updates after as the others."""
    out = run_ranks(fr.heard, fr.HEARD_N, timeout=150)
    n, r = fr.HEARD_N, fr.HEARD_N - 1
    history = out[0]["history"]
    assert all(o["history"] == history for o in out)  # every rank saw the same updates
    after = history[fr.SLOW_UNTIL + 1 : fr.SLOW_UNTIL + 11]
    others = sum(sum(k in m for m in after) for k in range(n - 1)) / (n - 1)
    assert sum(n - 1 in m for m in after) >= others / 2, after
    last = history[-50:]
    shares = [sum(k in m for m in last) / len(last) / (r / n) for k in range(n)]
    assert all(0.5 <= s <= 1.5 for s in shares), (shares, history)


@pytest.mark.timeout(180)
def test_auto_chooses_each_r_alike_on_every_rank_without_a_server():
    """``replicas_to_aggregate="auto"`` on the exchange without a server: every rank makes the
    same choices from the same measurements (the rounds its leader read, the noise of the
    update), so the variables stay bit-identical, and equal a float64 replay of the updates
    as made.  R = N until the rounds are measured, then fewer once rank 2 is much slower than
    the others."""
    out = run_ranks(fr.auto_backups, fr.N, timeout=150)
    plan, history = out[0]["plan"], out[0]["history"]
    assert all(o["history"] == history for o in out), [o["history"] for o in out]
    assert [len(m) for m in plan] == history
    _bit_identical_and_replayed(out, plan, fr.N)
    assert history[0] == fr.N  # no round measured yet: every worker
    assert 2 in history[fr.SLOW_FROM + 2 :], history
    left_out = [2 not in m for m, r in zip(plan, history, strict=True) if r == 2]
    assert sum(left_out) >= len(left_out) * 2 / 3, (plan, history)  # the slow one, mostly


@pytest.mark.timeout(180)
def test_close_after_a_late_worker_left_does_not_raise():
    """A member that steps and closes after the other worker closed and left (without
    receiving the update it is owed) ends without an error, its update applied."""
    out = run_ranks(fr.close_before_stepping, 2, timeout=150)
    assert all(o["exchange"] == "FirstArrivalsExchange" for o in out), out
    assert [o["raised"] for o in out] == [None, None], out
    assert out[1]["x"] == [-0.5, -0.5, -0.5], out
