"""What a replicated chief adds to its state machine, in one process: a step request sent again
under the same number is never applied twice (it takes over its place in line, or gets the
answer it was given), and a new standby's replica state makes a copy that then stays
bit-identical to the chief under the same requests."""

from __future__ import annotations

import torch

import gradfleet
from gradfleet.distributed.common.replies import DROPPED, Answer
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.server.chief import SyncChief

F64 = torch.float64
LR = 0.5


class Reply:
    def __init__(self) -> None:
        self.payloads: list = []

    def send(self, payload, share=None, fresh=False):
        self.payloads.append(payload)


def _chief() -> SyncChief:
    x = torch.tensor([1.0, -2.0, 0.5], dtype=F64, requires_grad=True)
    return SyncChief(gradfleet.GradientDescentOptimizer([x], LR), Job(2, 3, timeout=10))


def _send(chief: SyncChief, msg: dict, reply=None) -> Reply:
    reply = Reply() if reply is None else reply
    for out in chief.handle(msg, reply):
        assert isinstance(out, Answer)
        out.ticket.send(out.payload, out.share)
    return reply


def _step(worker: int, number: int, tag: int, g: float) -> dict:
    grads = [torch.full((3,), g, dtype=F64)]
    return {"op": "step", "worker": worker, "number": number, "tag": tag, "version": 0,
            "grads": grads}  # fmt: skip


def test_a_step_sent_again_is_applied_once():
    """Worker 0's step waits in line (R = 2): sent again, its place waits with the new ticket,
    nothing is added.  Worker 1's step makes the update (the mean of 1 and 3, one SGD step);
    worker 1's step sent again after its answer gets the same token and verdict, with the
    values as they are, and the update is not made again."""
    chief = _chief()
    for w in range(3):
        _send(chief, {"op": "hello", "worker": w, "shapes": [[3]], "dtypes": ["torch.float64"]})
    first = _send(chief, _step(0, 1, 0, 1.0))
    assert first.payloads == [] and chief.aggregator.counter == 1
    again = _send(chief, _step(0, 1, 0, 1.0))  # worker 0 moved here: the same request
    assert again.payloads == [] and chief.aggregator.counter == 1  # not added twice
    made = _send(chief, _step(1, 1, 0, 3.0))
    want = torch.tensor([1.0, -2.0, 0.5], dtype=F64) - LR * 2.0
    assert torch.equal(chief.params[0], want) and chief.global_step == 1
    assert first.payloads == []  # the first ticket was replaced by the second
    (token,) = again.payloads
    assert token["token"] == 1 and token["accepted"] is True
    (answer,) = made.payloads
    repeated = _send(chief, _step(1, 1, 0, 3.0))
    (same,) = repeated.payloads
    assert {k: same[k] for k in ("token", "accepted", "global_step")} == {
        k: answer[k] for k in ("token", "accepted", "global_step")
    }
    assert torch.equal(same["params"][0], want)  # the values as they are now
    assert torch.equal(chief.params[0], want) and chief.global_step == 1  # not made again
    assert chief.resent == {0: 1, 1: 1}
    # a new number is a new step: worker 1's next gradient counts
    _send(chief, _step(1, 2, 1, 5.0))
    assert chief.aggregator.counter == 1


def test_a_new_standby_from_the_replica_state_stays_bit_identical():
    """A copy loaded from the chief's replica state mid-update (worker 0 waiting in line with
    its gradient in) then handles the same requests as the chief, answers dropped: equal
    variables, slots, counters and line after every one."""
    chief, copy = _chief(), _chief()
    for w in range(3):
        _send(chief, {"op": "hello", "worker": w, "shapes": [[3]], "dtypes": ["torch.float64"]})
    _send(chief, _step(0, 1, 0, 1.0))
    copy.handle({"op": "load_replica", "worker": -1, **chief.replica_state()}, DROPPED)
    requests = [_step(1, 1, 0, 3.0), _step(2, 1, 0, -1.0), _step(0, 2, 1, 2.0),
                _step(2, 2, 1, 4.0), _step(1, 2, 1, 0.5)]  # fmt: skip
    for msg in requests:
        _send(chief, msg)
        copy.handle(msg, DROPPED)
        assert torch.equal(chief.params[0], copy.params[0])
        assert chief.global_step == copy.global_step
        assert chief.aggregator.state_dict()["counter"] == copy.aggregator.state_dict()["counter"]
        assert [e.worker for e in chief.line] == [e.worker for e in copy.line]
    assert chief.global_step == 2
    assert chief.aggregator.stats == copy.aggregator.stats
    # every worker's last step and its answer are recorded alike: one sent again to the copy
    # gets that answer, not a second update
    assert copy.answered == chief.answered and copy.answered[0][:2] == (2, "token")


def test_a_late_report_of_a_lost_chiefs_worker_spares_its_restarted_self():
    """Worker 0 lived on the chief's host at A0, which was lost; its restarted process says
    hello to the chief now at A1 and its step waits in line.  A survivor's late failover then
    reports worker 0 gone with the chief at A0: the report is about the earlier self, so the
    step keeps its place (sent again, it rebinds; before, it was dropped and the step sent
    again was refused).  A report about a worker whose hello went to A0 still removes it."""
    chief = _chief()
    hello = {"op": "hello", "shapes": [[3]], "dtypes": ["torch.float64"]}
    _send(chief, {**hello, "worker": 0, "to": "A1"})
    _send(chief, {**hello, "worker": 2, "to": "A0"})
    assert _send(chief, _step(0, 1, 0, 1.0)).payloads == []
    late = {"op": "done", "forgotten": True, "lost_server": "A0"}
    _send(chief, {**late, "worker": 0})
    assert [e.worker for e in chief.line] == [0] and 0 not in chief.left_at
    assert _send(chief, _step(0, 1, 0, 1.0)).payloads == []  # its place, with this ticket
    _send(chief, {**late, "worker": 2})  # worker 2 did go with the chief at A0
    assert chief.left_at[2] == (0, True)
    made = _send(chief, _step(1, 1, 0, 3.0))  # R = 2: the update, worker 1 answered
    assert chief.global_step == 1 and made.payloads[0]["accepted"]
    assert chief.replica_state()["hello_to"] == {0: "A1", 2: "A0"}


# ---------------------------------------------------------------- copies without the gradients
def _primary_and_copy(
    optimizer=gradfleet.AdamOptimizer, nonfinite: str = "raise"
) -> tuple[SyncChief, SyncChief]:
    """A chief with a standby (as :meth:`HostedServer.forward_to` makes it) and its copy, the
    same ``optimizer`` over the same float64 variable."""

    def make() -> SyncChief:
        x = torch.tensor([1.0, -2.0, 0.5], dtype=F64, requires_grad=True)
        job = Job(2, 3, timeout=10, nonfinite=nonfinite)
        return SyncChief(optimizer([x], LR), job)

    primary, copy = make(), make()
    primary.standby, primary.standby_rank = "standby:1", 1
    return primary, copy


def _forwarded(primary: SyncChief, msg: dict) -> dict:
    """The copy the forwarder queues for ``msg`` just handled: its fields less the replaced
    ones, plus what the primary decided (:meth:`SyncChief.copy_fields`)."""
    left_out = primary.standby_replaced.get(msg["op"], ())
    return {**{k: v for k, v in msg.items() if k not in left_out}, **primary.copy_fields()}


def _tensors(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensors(v) for v in value)
    return 0


def test_a_copy_given_the_primarys_verdicts_and_averages_stays_bit_identical():
    """The step copies carry no gradients: a verdict each, and the copy of the step that made
    an update carries its averages (one tensor set per update).  The copy counts the verdicts
    (accepted, stale, non-finite under ``nonfinite="drop"``) and applies the averages: equal
    Adam variables and slots, stats, step and line after every request."""
    primary, copy = _primary_and_copy(nonfinite="drop")
    hello = {"op": "hello", "shapes": [[3]], "dtypes": ["torch.float64"]}
    for w in range(3):
        msg = {**hello, "worker": w}
        _send(primary, msg)
        copy.handle(_forwarded(primary, msg), DROPPED)
    numbers = dict.fromkeys(range(3), 0)
    carried = 0
    # (worker, tag, gradient): R = 2, so the third of each round is stale; one is non-finite
    plan = [(0, 0, 1.0), (1, 0, 3.0), (2, 0, -1.0), (2, 1, float("nan")), (0, 1, 2.0),
            (1, 1, 0.5), (2, 2, 4.0), (0, 2, -3.0)]  # fmt: skip
    for worker, tag, g in plan:
        numbers[worker] += 1
        msg = {**_step(worker, numbers[worker], tag, g), "version": -1}
        _send(primary, msg)
        forwarded = _forwarded(primary, msg)
        assert "grads" not in forwarded and "verdict" in forwarded
        carried += _tensors(forwarded)
        copy.handle(forwarded, DROPPED)
        assert torch.equal(primary.params[0], copy.params[0])
        assert primary.global_step == copy.global_step
        assert str(primary.opt.state_dict()) == str(copy.opt.state_dict())
        assert primary.aggregator.stats == copy.aggregator.stats
        assert [e.worker for e in primary.line] == [e.worker for e in copy.line]
    assert primary.global_step == 3 and carried == 3  # one average per update, nothing else
    assert primary.aggregator.stats[2] == {"accepted": 1, "dropped": 1, "nonfinite": 1}


def test_a_standby_that_takes_over_counts_each_pending_gradient_once():
    """Worker 0's gradient is pending (R = 2) on the primary and counted on the copy; worker 1's
    then makes the update on the primary, whose copy never leaves (the primary's host is
    lost).  The copy takes over: worker 0's counted gradient is withdrawn, and the steps both
    send again are offered once each -- the update equals the float64 SGD step of their mean,
    each worker counted accepted once, and a step sent once more is not offered again."""
    primary, copy = _primary_and_copy(gradfleet.GradientDescentOptimizer)
    hello = {"op": "hello", "shapes": [[3]], "dtypes": ["torch.float64"]}
    for w in range(3):
        msg = {**hello, "worker": w}
        _send(primary, msg)
        copy.handle(_forwarded(primary, msg), DROPPED)
    first, second = _step(0, 1, 0, 1.0), _step(1, 1, 0, 3.0)
    _send(primary, first)
    copy.handle(_forwarded(primary, first), DROPPED)
    _send(primary, second)  # the update, on the primary only
    assert primary.global_step == 1 and copy.global_step == 0 and copy.aggregator.counter == 1

    copy.take_over()
    assert copy.aggregator.counter == 0 and copy.withdrawn == {0}
    assert copy.aggregator.stats[0]["accepted"] == 0
    waiting = _send(copy, first)  # sent again: its place in line, its gradient offered again
    assert waiting.payloads == [] and copy.aggregator.counter == 1
    assert _send(copy, first).payloads == [] and copy.aggregator.counter == 1  # once only
    made = _send(copy, second)
    assert copy.global_step == 1 and made.payloads[0]["accepted"] is True

    want = torch.tensor([1.0, -2.0, 0.5], dtype=F64) - LR * 2.0  # the mean of 1 and 3
    assert torch.equal(copy.params[0], want)  # exact: every value is a dyadic fraction
    assert torch.equal(copy.params[0], primary.params[0])  # the same gradients, the same update
    assert {w: s["accepted"] for w, s in copy.aggregator.stats.items()} == {0: 1, 1: 1}
