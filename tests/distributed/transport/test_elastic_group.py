"""The elastic group: a rank restarted before its old process counts as gone is a member of
the next generation again, told apart by its new incarnation; one restarted after the job
ended is told so."""

from __future__ import annotations

import pytest

from gradfleet.distributed.testing import RankKilled, free_port, run_ranks
from gradfleet.distributed.transport.elastic_group import _FORM_S

from . import elastic_group_ranks as egr


@pytest.mark.faults
def test_a_fast_restart_is_a_member_again_as_a_new_process():
    out = run_ranks(
        egr.fast_restart, 4, args=(free_port(),), timeout=120, init_process_group=False,
        kill_on={2: "die"},
    )  # fmt: skip
    assert out[2] == RankKilled(2)
    for rank in (0, 1):
        (change,) = out[rank]["changes"]
        gone, came, generation, took = change
        assert (gone, came, generation) == ([2], [2], 1), change
        assert took < 20  # it arrived: nobody waited for the old process's silence
        assert out[rank]["sums"] == [6.0] * 10  # 1 + 2 + 3, before and after
    assert out[3]["generation"] == 1 and out[3]["members"] == [0, 1, 2]
    assert out[3]["sums"] == [6.0] * 5


@pytest.mark.faults
def test_a_member_that_dies_before_connecting_is_left_out_of_the_next():
    """Decided into generation 1, rank 2 dies before it connects: the others give up on
    generation 1 after ``_FORM_S`` (not the group's 60 s timeout) and form generation 2
    without it, holding their state."""
    out = run_ranks(
        egr.dies_before_connecting, 3, args=(free_port(),), timeout=120,
        init_process_group=False, kill_on={2: "die"},
    )  # fmt: skip
    assert out[2] == RankKilled(2)
    for rank in (0, 1):
        (change,) = out[rank]["changes"]
        gone, came, generation, members, took = change
        assert (gone, came, generation, members) == ([2], [], 2, [0, 1]), change
        # one forming timeout, then one dead_after of silence, and the polling
        assert took < _FORM_S + 10, change
        assert out[rank]["sums"] == [6.0] * 3 + [3.0] * 3  # 1 + 2 + 3, then 1 + 2
        assert out[rank]["continuing"]


@pytest.mark.faults
def test_a_process_restarted_after_the_job_ended_is_told_at_once():
    """Rank 1 dies; rank 0 goes on alone and ends (closes the group).  Rank 1 restarted after
    that asks to join: it gets ``JobEnded`` within seconds, not the group's 60 s timeout, so a
    late restart exits instead of waiting for a job that is over (and failing when its store
    goes)."""
    out = run_ranks(
        egr.joins_after_the_end, 3, args=(free_port(),), timeout=150,
        init_process_group=False, kill_on={1: "die"},
    )  # fmt: skip
    assert out[1] == RankKilled(1)
    assert out[0]["sums"] == [3.0] * 3 + [1.0] * 3  # 1 + 2, then 1 alone
    assert out[0]["members"] == [0]
    assert out[2]["error"] is not None, "the late joiner was taken in by a closed group"
    assert "the job ended" in out[2]["error"], out[2]["error"]
    assert out[2]["took"] < 10, out[2]  # polled every 50 ms: not the 60 s timeout


@pytest.mark.faults
def test_a_member_waiting_in_a_sum_leaves_it_when_another_begins_the_next_generation():
    """Rank 1 begins generation 1 while rank 0 waits for it in a sum of generation 0 (what a
    member does that took another for lost on a loaded machine's late heartbeat): rank 0
    leaves the sum, naming rank 1's re-forming, instead of waiting for gloo's 60 s timeout
    while rank 1 waits for it, beating, to arrive (the project's CI met that stall under the
    torchrun recipe).  Both then sum in generation 1, neither lost."""
    out = run_ranks(
        egr.one_leaves_for_the_next, 2, args=(free_port(),), timeout=45,
        init_process_group=False,
    )  # fmt: skip
    assert "rank 1 is forming generation 1" in out[0]["left"], out[0]
    for rank in (0, 1):
        assert out[rank]["changed"] == [[], []]  # nobody gone, nobody new
        assert out[rank]["generation"] == 1
        assert out[rank]["sums"] == [3.0] * 4
