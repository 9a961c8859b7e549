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
