"""The all-reduce exchange with losses allowed: survivors go on, a restarted rank heals from
live state, a second loss after the rejoin is survived; checked against a float64 replay of
the updates made by the members that made them."""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.testing import RankKilled, free_port, run_ranks

from . import elastic_ranks as er


def replay(plan: list[list[int]]) -> torch.Tensor:
    """Adam over float64 variables: update ``k`` (from 1) averages the gradients of the ranks
    ``plan[k - 1]`` computed at step ``k - 1``."""
    w = torch.nn.Parameter(er.start_w())
    opt = torch.optim.Adam([w], lr=er.LR)
    for step, ranks in enumerate(plan):
        w.grad = sum(er.gradient(r, step, w.detach()) for r in ranks) / len(ranks)
        opt.step()
    return w.detach()


@pytest.mark.faults
def test_survivors_go_on_a_restarted_rank_heals_and_a_second_loss_is_survived():
    out = run_ranks(
        er.lose_and_rejoin, 4, args=(free_port(),), timeout=240, init_process_group=False,
        kill_on={2: "die", 1: "die"},
    )  # fmt: skip
    assert out[1] == RankKilled(1) and out[2] == RankKilled(2)
    zero, back = out[0], out[3]
    events = [(c["event"], c["ranks"], c["members"]) for c in zero["changes"]]
    assert events == [
        ("lost", [2], [0, 1]),
        ("joined", [2], [0, 1, 2]),
        ("lost", [1], [0, 2]),
    ], events
    lost2, joined, lost1 = (c["global_step"] for c in zero["changes"])
    assert lost2 == er.FIRST_LOSS and lost1 == joined + er.AFTER_JOIN
    assert back["start"] == joined  # healed to the step the members had made
    assert back["opened"] == [] and zero["opened"] == []  # no checkpoint file read
    # every update from 1 to the end made once, in order, on both survivors
    end = joined + er.END_AFTER_JOIN
    assert zero["steps"] == list(range(1, end + 1))
    assert back["steps"] == list(range(joined + 1, end + 1))
    # the same variables, bit for bit, and those of the updates the members made
    assert zero["w"] == back["w"]
    plan = (
        [[0, 1, 2]] * er.FIRST_LOSS
        + [[0, 1]] * (joined - er.FIRST_LOSS)
        + [[0, 1, 2]] * er.AFTER_JOIN
        + [[0, 2]] * (er.END_AFTER_JOIN - er.AFTER_JOIN)
    )
    expected = replay(plan)
    # float64: a sum of at most 3 gradients per update, in another order, over `end` updates
    tol = 3 * end * torch.finfo(torch.float64).eps * 10
    torch.testing.assert_close(
        torch.tensor(zero["w"], dtype=torch.float64), expected, rtol=tol, atol=tol
    )
    # the books travelled with the state: rank 2 is counted for the updates it joined
    assert zero["counters"] == back["counters"]
    accepted = {r: zero["counters"][str(r)]["accepted"] for r in range(3)}
    assert accepted == {
        0: end,
        1: joined + er.AFTER_JOIN,
        2: er.FIRST_LOSS + er.END_AFTER_JOIN,
    }


@pytest.mark.faults
def test_a_member_that_hangs_is_left_out_at_once_and_takes_its_place_again():
    """A stopped process closes no socket: without the heartbeat watch the survivors would wait
    for it until the collectives' timeout (60 s)."""
    out = run_ranks(er.hang_and_return, 3, args=(free_port(),), timeout=240,
                    init_process_group=False)  # fmt: skip
    zero, one, two = out
    events = [(c["event"], c["ranks"], c["members"]) for c in zero["changes"]]
    assert events == [("lost", [2], [0, 1]), ("joined", [2], [0, 1, 2])], events
    assert one["changes"] == zero["changes"] or [
        (c["event"], c["ranks"]) for c in one["changes"]
    ] == [(e, r) for e, r, _ in events]
    lost, joined = (c["global_step"] for c in zero["changes"])
    assert lost == er.HANG_AT and joined >= lost + er.HANG_ALONE
    # the survivors' longest step() held the loss: seconds, far under the timeout
    assert zero["longest"] < er.HANG_TIMEOUT / 4 and one["longest"] < er.HANG_TIMEOUT / 4
    # every update once, in order, on the survivors; the rank that came back healed to the
    # members' step (it never made the updates it missed) and went on with them
    end = joined + er.HANG_AFTER
    assert zero["steps"] == one["steps"] == list(range(1, end + 1))
    assert two["steps"] == [*range(1, er.HANG_AT + 1), *range(joined, end + 1)]
    assert zero["w"] == one["w"] == two["w"]
    plan = [[0, 1, 2]] * er.HANG_AT + [[0, 1]] * (joined - er.HANG_AT) + [[0, 1, 2]] * er.HANG_AFTER
    tol = 3 * end * torch.finfo(torch.float64).eps * 10
    torch.testing.assert_close(
        torch.tensor(zero["w"], dtype=torch.float64), replay(plan), rtol=tol, atol=tol
    )


@pytest.mark.faults
def test_more_losses_than_allowed_end_the_job_naming_them():
    out = run_ranks(er.two_lost, 3, timeout=120, kill_on={1: "die", 2: "die"})
    took, message = out[0].split(" ", 1)
    assert "ranks [1, 2] are gone, more than max_losses=1" in message, message
    assert float(took) < 10  # the heartbeats stood still: seconds, not the timeout


ALLREDUCE = "needs transport='allreduce'"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicas_to_aggregate": 2, "total_num_replicas": 2, "max_losses": 2}, "fewer losses"),
        ({"replicas_to_aggregate": 1, "total_num_replicas": 2, "max_losses": 1}, ALLREDUCE),
        ({"replicas_to_aggregate": 2, "total_num_replicas": 2, "max_losses": -1}, "max_losses"),
        ({"replicas_to_aggregate": 2, "total_num_replicas": 2, "max_losses": 1,
          "transport": "server"}, ALLREDUCE),
    ],
)  # fmt: skip
def test_max_losses_refused_where_it_cannot_hold(kwargs, match):
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match=match):
        SyncReplicasOptimizer(opt, **kwargs)
    assert opt.state == {} and torch.equal(w, torch.zeros(2))
