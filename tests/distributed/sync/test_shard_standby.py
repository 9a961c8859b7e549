"""A standby per shard: with the variables in two shards on dedicated ranks, each server (the
chief, shard 1) keeps a live copy on a worker rank; when either server's rank is killed
mid-update the workers move to its copy, every update is applied exactly once, and the
variables are the float64 replay of the updates made (:func:`.standby_ranks.shard_lost`)."""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed.testing import RankKilled, run_ranks
from tests.distributed.sync import standby_ranks

pytestmark = [pytest.mark.timeout(180)]

N, LAST = 3, 10


def _check_trajectory(out: list) -> list[torch.Tensor]:
    """Every worker reached ``LAST`` with the float64 replay's variables (R = N: each update
    the mean of every worker's gradient of its step), and each accepted every push."""
    records = {r: out[r]["records"] for r in range(N)}
    want, accepted = standby_ranks.replay(out[0]["initial"], records, N, LAST)
    assert accepted == dict.fromkeys(range(N), LAST)
    for r in range(N):
        assert out[r]["global_step"] == LAST
        for got, w in zip(out[r]["final"], want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
        for a, b in zip(out[r]["final"], out[0]["final"], strict=True):
            assert torch.equal(a, b)
    return out[0]["final"]


def test_each_shard_has_a_bit_identical_standby(tmp_path):
    """No loss: the standbys are spread over the workers (the chief's on rank 0, shard 1's on
    rank 1), each holds its server's variables and counters bit for bit; no worker sent shard
    1's copy a gradient, and its server's link carried one average per update to it."""
    out = run_ranks(standby_ranks.shard_lost, N + 2, args=(LAST, 4, 0, "", str(tmp_path)),
                    timeout=150)  # fmt: skip
    assert all(out[r]["standbys"] == {0: 0, 1: 1} for r in range(N))
    final = _check_trajectory(out)
    copy = out[1]["shard1"]
    assert not copy["promoted"] and copy["step"] == LAST
    assert copy["paired"] == 0  # no gradient from a worker
    assert copy["given_updates"] == LAST  # each update its server's averages
    for i, p in zip(copy["indices"], copy["params"], strict=True):
        assert torch.equal(p, final[i])
    assert {w: s["accepted"] for w, s in copy["stats"].items()} == dict.fromkeys(range(N), LAST)
    chief = out[0]["chief"]
    assert not chief["promoted"] and chief["global_step"] == LAST


@pytest.mark.faults
@pytest.mark.parametrize(
    ("lost", "cut"), [(4, "applied"), (4, "unsent"), (3, "applied")],
    ids=["shard-after-its-standby", "shard-alone", "chief-after-its-standby"],
)  # fmt: skip
def test_a_server_killed_mid_update_every_update_counts_once(tmp_path, lost, cut):
    """Shard 1's rank (4), or the chief's (3), is SIGKILLed during worker 2's fourth push to
    it: after its standby handled the push and before any answer left, or after the server
    alone handled it.  Every worker moves to the copy and sends the step again (never applied
    twice); the job reaches ``last_step`` on the replay's trajectory, and the copy that took
    over counts each worker's every push once.  The chief lost: shard 1 reports its updates
    to the chief's copy."""
    out = run_ranks(
        standby_ranks.shard_lost, N + 2, args=(LAST, lost, 4, cut, str(tmp_path)),
        timeout=150, kill_on={lost: "die"},
    )  # fmt: skip
    assert out[lost] == RankKilled(lost)
    shard = 1 if lost == 4 else 0
    assert all(out[r]["moved"] == {shard: lost} for r in range(N))
    final = _check_trajectory(out)
    if shard == 1:
        copy = out[1]["shard1"]
        assert copy["promoted"] and copy["step"] == LAST
        for i, p in zip(copy["indices"], copy["params"], strict=True):
            assert torch.equal(p, final[i])
        stats = copy["stats"]
    else:
        copy = out[0]["chief"]
        assert copy["promoted"] and copy["global_step"] == LAST
        stats = copy["stats"]
    # each push counted once: none added twice, none dropped as stale when sent again
    every = {"accepted": LAST, "dropped": 0, "nonfinite": 0}
    assert stats == {w: every for w in range(N)}


@pytest.mark.faults
@pytest.mark.parametrize("replicas", [2, "auto"])
@pytest.mark.parametrize("cut", ["applied", "unsent"])
def test_a_worker_holding_a_shard_killed_mid_update_the_others_go_on(cut, replicas):
    """Rank 1, a worker that also serves shard 1 (R = 2 of 3, or chosen per update: its
    standbys then follow the chief's choices; shards over the workers), is
    SIGKILLed in its own fourth push to its shard: once shard 1's standby has the push, or
    before it does.  Its gradient of that step may then be in one shard's update and not the
    other's; the survivors move shard 1 to its standby and reach ``last_step``, equal, each
    shard having made every update once from R gradients."""
    out = run_ranks(
        standby_ranks.worker_with_a_shard_lost, N, args=(LAST, 4, cut, replicas), timeout=150,
        kill_on={1: "die"},
    )  # fmt: skip
    assert out[1] == RankKilled(1)
    for r in (0, 2):
        assert out[r]["global_step"] == LAST
        assert out[r]["moved"] == {1: 1}
        for a, b in zip(out[r]["final"], out[0]["final"], strict=True):
            assert torch.equal(a, b)
    copy, chief = out[2]["shard1"], out[0]["chief"]
    assert copy["promoted"] and copy["step"] == LAST and chief["global_step"] == LAST
    # each update's R: the chief's choice under "auto" (the same for the shard's copy, which
    # the chief tells when it lowers one)
    assert len(chief["history"]) == LAST and set(chief["history"]) <= {1, 2, 3}
    want = 2 * LAST if replicas == 2 else sum(chief["history"])
    for stats in (copy["stats"], chief["stats"]):
        assert sum(s["accepted"] for s in stats.values()) == want, (stats, chief["history"])


@pytest.mark.faults
@pytest.mark.parametrize("cut", ["applied", "unsent"])
def test_the_chiefs_host_lost_under_auto_with_shards_its_copy_tells_the_shards(cut):
    """``replicas_to_aggregate="auto"`` with a standby per shard: rank 0 -- a worker and the
    chief -- is SIGKILLed in its second step request, during the warm-up at R = N.  The
    chief's copy takes over and lowers the pending update's R to the two live workers; shard
    1's server (alive) is told so by the copy, not left waiting for a third gradient.  Both
    survivors reach ``last_step`` equal, and each shard made every update from the R the
    chief chose for it."""
    out = run_ranks(
        standby_ranks.worker_with_a_shard_lost, N, args=(LAST, 2, cut, "auto", 0),
        timeout=150, kill_on={0: "die"},
    )  # fmt: skip
    assert out[0] == RankKilled(0)
    for r in (1, 2):
        assert out[r]["global_step"] == LAST
        assert out[r]["moved"] == {0: 0}
        for a, b in zip(out[r]["final"], out[1]["final"], strict=True):
            assert torch.equal(a, b)
    chief, shard = out[2]["chief copy"], out[1]["shard1 server"]
    assert chief["promoted"] and chief["global_step"] == LAST
    history = chief["history"]
    assert len(history) == LAST and set(history) <= {1, 2, 3}, history
    # the copy lowered an R and told shard 1 (its primary is dead: only the copy could)
    assert shard["lowered"] is not None and shard["lowered"][1] <= 2, (shard, history)
    accepted = {w: s["accepted"] for w, s in chief["stats"].items()}
    assert sum(accepted.values()) == sum(history), (chief["stats"], history)
    # shard 1 may have made the update pending at the loss from all three gradients before
    # the lowered R reached it (rank 0's push to shard 1 came before the step request it died
    # in, which the copy withdrew): TF's per-variable race, one gradient at most
    theirs = sum(s["accepted"] for s in shard["stats"].values())
    assert theirs - sum(history) in (0, 1), (shard["stats"], history)
