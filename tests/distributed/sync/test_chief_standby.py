"""The SyncReplicas chief's live standby: bit-identical to the chief, and when the chief's host
is killed mid-update the workers move to it, every update is applied exactly once, and the
variables are the float64 replay of the updates made (:mod:`.standby_ranks`)."""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed.testing import RankKilled, run_ranks
from tests.distributed.sync import standby_ranks

pytestmark = [pytest.mark.timeout(180)]

R, LAST = 2, 12


def _records(out: list, tmp_path, lost: int | None) -> dict:
    records = {r: o["records"] for r, o in enumerate(out) if isinstance(o, dict) and "records" in o}
    if lost is not None:
        records[lost] = torch.load(tmp_path / f"rank{lost}.pt", weights_only=True)
    return records


@pytest.mark.parametrize("auto", [False, True], ids=["fixed-R", "auto"])
def test_the_standby_is_bit_identical_to_the_chief(tmp_path, auto):
    """No loss: the standby (rank 1, chosen: the next rank on one host) holds the chief's
    variables, hyperparameters and counters bit for bit, and both equal the float64 replay.
    No gradient reached it, from a worker or in the chief's copies: each update came as its
    averages, and its own rank's worker read its values there.  Under ``"auto"`` its R of
    every update is the chief's, chosen on the chief's clock."""
    out = run_ranks(
        standby_ranks.chief_lost, 3, args=(R, LAST, 0, "", str(tmp_path), False, auto),
        timeout=120,
    )  # fmt: skip
    assert out[0]["standby"] == 1
    chief, copy = out[0], out[1]["standby_state"]
    assert chief["global_step"] == copy["global_step"] == LAST
    assert chief["history"] == copy["history"] and len(copy["history"]) == LAST
    for a, b in zip(chief["params"], copy["params"], strict=True):
        assert torch.equal(a, b)
    assert chief["stats"] == copy["stats"]
    assert str(chief["slots"]) == str(copy["slots"])
    assert out[1]["paired"] == 0 and out[1]["given"] == LAST and not out[1]["promoted"]
    assert out[1]["local_reads"] == len(out[1]["records"])  # one per step of worker 1
    records = _records(out, tmp_path, None)
    want, accepted = standby_ranks.replay(out[0]["initial"], records, copy["history"], LAST)
    for g, w in zip(copy["params"], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert {w: s["accepted"] for w, s in copy["stats"].items()} == accepted


@pytest.mark.faults
@pytest.mark.parametrize(("cut", "dedicated"), [("applied", False), ("unsent", False),
                                                ("applied", True), ("unsent", True)])  # fmt: skip
def test_the_chief_killed_mid_update_every_update_counts_once(tmp_path, cut, dedicated):
    """The chief's rank (rank 0, with its worker; or a dedicated rank 3) is SIGKILLed during
    worker 2's fourth step: after its standby handled the step and before any answer left,
    or after the chief alone handled it.  Every live worker moves to the standby, sends the
    step it waited on again (never applied twice), and the job reaches ``last_step``; the
    standby's variables equal every worker's last read and the float64 replay of the updates
    made, and its accepted counts equal the workers' own verdicts."""
    world, chief = (4, 3) if dedicated else (3, 0)
    standby = 0 if dedicated else 1
    out = run_ranks(
        standby_ranks.chief_lost, world, args=(R, LAST, 4, cut, str(tmp_path), dedicated),
        timeout=150, kill_on={chief: "die"},
    )  # fmt: skip
    assert out[chief] == RankKilled(chief)
    live = [r for r in range(world) if r != chief]
    for r in live:
        assert out[r]["global_step"] == LAST
        assert out[r]["moved_from"] == chief  # every live worker moved (at the latest, leaving)
    state = out[standby]["standby_state"]
    assert out[standby]["promoted"] and state["global_step"] == LAST
    lost_worker = None if dedicated else chief
    want, accepted = standby_ranks.replay(
        out[live[0]]["initial"], _records(out, tmp_path, lost_worker), R, LAST
    )
    for g, w in zip(state["params"], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for r in live:  # each worker's last read is the standby's variables
        for a, b in zip(out[r]["final"], state["params"], strict=True):
            assert torch.equal(a, b)
    for r in live:  # each worker's own verdicts, against the standby's record
        own = sum(1 for _, _, ok in out[r]["records"] if ok)
        assert state["stats"][r]["accepted"] == own == accepted[r]
    # every update R gradients, each counted once (the lost worker's too, where it had one)
    assert sum(s["accepted"] for s in state["stats"].values()) == R * LAST
    if cut == "applied":  # worker 2's step had reached the standby: sent again, not re-applied
        assert state["resent"].get(2) == 1


@pytest.mark.faults
def test_under_auto_the_standby_takes_the_chiefs_choices_and_survives_its_loss(tmp_path):
    """``replicas_to_aggregate="auto"`` with ``standby=True``: the chief chooses each update's R
    from its own clock, and its standby (rank 1) takes each R from the chief's copies.  The
    chief's rank is SIGKILLed during worker 2's fourth step, after its standby handled it; the
    workers move to the standby, which chooses from then on, and the job reaches
    ``last_step``.  The standby's variables equal the float64 replay of the updates made with
    the R it records for each, and every worker's last read."""
    out = run_ranks(
        standby_ranks.chief_lost, 3, args=(R, LAST, 4, "applied", str(tmp_path), False, True),
        timeout=150, kill_on={0: "die"},
    )  # fmt: skip
    assert out[0] == RankKilled(0)
    state = out[1]["standby_state"]
    assert out[1]["promoted"] and state["global_step"] == LAST
    assert len(state["history"]) == LAST and all(1 <= r <= 3 for r in state["history"])
    for r in (1, 2):
        assert out[r]["global_step"] == LAST and out[r]["moved_from"] == 0
    records = _records(out, tmp_path, 0)
    want, accepted = standby_ranks.replay(out[1]["initial"], records, state["history"], LAST)
    for g, w in zip(state["params"], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for r in (1, 2):
        for a, b in zip(out[r]["final"], state["params"], strict=True):
            assert torch.equal(a, b)
        assert state["stats"][r]["accepted"] == accepted[r]
    assert sum(s["accepted"] for s in state["stats"].values()) == sum(state["history"])
    assert state["resent"].get(2) == 1  # sent again, not applied again


@pytest.mark.faults
@pytest.mark.parametrize("told", [True, False], ids=["named-in-an-answer", "by-the-directory"])
def test_a_restarted_process_becomes_the_standby_and_a_second_loss_is_survived(tmp_path, told):
    """Rank 0 (the chief and worker 0) is killed; its standby on rank 1 takes over.  A
    restarted worker 0 (rank 3) joins by address with ``standby=True`` and becomes the new
    chief's standby from its live state (no file opened).  Rank 1 is killed too; ranks 2 and
    3 finish on rank 3's copy, and its variables are the float64 replay of every update
    made, each gradient counted once.  ``by-the-directory``: rank 1 dies before any answer
    to worker 2 named rank 3's copy; worker 2 finds it in the job's directory."""
    out = run_ranks(
        standby_ranks.chief_second_loss, 4, args=(LAST + 8, str(tmp_path), told), timeout=150,
        kill_on={0: "die", 1: "die"}, init_process_group=False,
    )  # fmt: skip
    assert out[0] == RankKilled(0) and out[1] == RankKilled(1)
    restarted = out[3]
    assert restarted["serves"] and restarted["opened"] == []
    assert out[2]["moved_from"] == 1 == restarted["moved_from"]  # the second loss: rank 1
    state = restarted["state"]
    assert restarted["promoted"] and state["global_step"] == LAST + 8
    records = {r: out[r]["records"] for r in (2, 3)}
    for r in (0, 1):
        records[r] = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
    want, accepted = standby_ranks.replay(restarted["initial"], records, R, LAST + 8)
    for g, w in zip(state["params"], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for r in (2, 3):
        for a, b in zip(out[r]["final"], state["params"], strict=True):
            assert torch.equal(a, b)
    # worker 0's two lives (ranks 0 and 3) and worker 1 until its loss, each counted once
    assert state["stats"][0]["accepted"] == accepted[0] + accepted[3]
    assert state["stats"][1]["accepted"] == accepted[1]
    assert state["stats"][2]["accepted"] == accepted[2]
