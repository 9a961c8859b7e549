"""What a replicated shard adds to its state machine, in one process (the forwarding done by
hand, as :class:`~gradfleet.distributed.hosting.standby.Forwarder` does it): a push's copy
carries the primary's verdict and, with the push that made an update, its averages -- never
the gradients -- and the copy stays bit-identical; a copy that takes over withdraws the
pending gradients it only counted, offers each again when its push is sent again, and the
chief tells each of their workers that waits for its token to send its step again."""

from __future__ import annotations

import torch

import gradfleet
from gradfleet.distributed.common.replies import DROPPED, Answer
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.server.chief import SyncChief
from gradfleet.distributed.sync.server.shards import Applied, Shard, ShardServer

F64 = torch.float64
LR = 0.5
START = [1.0, -2.0, 0.5]


class Reply:
    def __init__(self) -> None:
        self.payloads: list = []

    def send(self, payload, share=None, fresh=False):
        self.payloads.append(payload)


def _server() -> ShardServer:
    x = torch.tensor(START, dtype=F64, requires_grad=True)
    job = Job(2, 3, timeout=10)
    return ShardServer(1, Shard(gradfleet.GradientDescentOptimizer([x], LR), [0], job), job)


def _send(server, msg: dict, reply=None) -> tuple[Reply, list]:
    reply = Reply() if reply is None else reply
    effects = []
    for out in server.handle(msg, reply):
        if isinstance(out, Answer):
            out.ticket.send(out.payload, out.share)
        else:
            effects.append(out)
    return reply, effects


def _copy_of(primary: ShardServer, msg: dict) -> dict:
    """The copy the primary's forwarder sends after handling ``msg``: without the gradients
    (``standby_replaced``), with what the primary decided from them."""
    left_out = primary.standby_replaced.get(msg["op"], ())
    return {
        **{k: v for k, v in msg.items() if k not in left_out},
        **primary.copy_fields(),
    }


def _push(worker: int, number: int, tag: int, g: float) -> dict:
    return {"op": "push", "worker": worker, "number": number, "tag": tag,
            "grads": [torch.full((3,), g, dtype=F64)]}  # fmt: skip


def _hello(server) -> None:
    for w in range(3):
        _send(server, {"op": "hello", "worker": w, "shapes": [[3]], "dtypes": ["torch.float64"]})


def test_a_copy_from_verdicts_and_averages_stays_bit_identical():
    """R = 2 of 3: five pushes, one of them stale.  The copy gets no gradient, only the
    primary's verdicts and each update's averages, and after every copy it has the primary's
    variables, step and counters; the variables are the float64 SGD steps of the means."""
    primary, copy = _server(), _server()
    primary.standby, primary.standby_rank = "standby:1", 0
    _hello(primary)
    _hello(copy)
    hello, _ = _send(_server(), {"op": "hello", "worker": 0, "shapes": [[3]],
                                 "dtypes": ["torch.float64"]})  # fmt: skip
    assert hello.payloads[0]["standby_data"] is False  # workers send the standby nothing
    pushes = [_push(0, 1, 0, 1.0), _push(1, 1, 0, 3.0), _push(2, 1, 0, 7.0),
              _push(2, 2, 1, -1.0), _push(0, 2, 1, 2.0)]  # fmt: skip
    for msg in pushes:
        _send(primary, msg)
        copied = _copy_of(primary, msg)
        assert "grads" not in copied
        _send(copy, copied, DROPPED)
        assert torch.equal(primary.shard.params[0], copy.shard.params[0])
        assert primary.shard.step == copy.shard.step
        assert primary.shard.aggregator.stats == copy.shard.aggregator.stats
    want = torch.tensor(START, dtype=F64) - LR * 2.0 - LR * 0.5  # means 2.0, then 0.5
    assert torch.equal(copy.shard.params[0], want) and copy.shard.given_updates == 2
    assert copy.shard.aggregator.stats[2]["dropped"] == 1  # worker 2's late one, as decided


def test_a_copy_that_takes_over_offers_the_withdrawn_gradients_again():
    """Worker 0's push is in the pending update (counted on the copy, its sum with the
    primary); the primary is lost.  The copy takes over: worker 0's gradient is withdrawn and
    named with its push number for the chief.  Worker 1's push alone does not make the update;
    worker 0's push sent again is offered again and makes it, from both gradients; sent a
    third time, it gets its answer and nothing is added."""
    primary, copy = _server(), _server()
    primary.standby, primary.standby_rank = "standby:1", 0
    _hello(primary)
    _hello(copy)
    first = _push(0, 1, 0, 1.0)
    _send(primary, first)
    _send(copy, _copy_of(primary, first), DROPPED)
    copy.take_over()
    assert copy.withdrawn_pushes() == ((0, 1),) and copy.shard.aggregator.counter == 0
    assert copy.shard.aggregator.stats[0]["accepted"] == 0
    _, effects = _send(copy, _push(1, 1, 0, 3.0))
    assert effects == [] and copy.shard.step == 0
    again, effects = _send(copy, first)
    assert effects == [Applied(1, 1)] and again.payloads[0]["accepted"] is True
    want = torch.tensor(START, dtype=F64) - LR * 2.0
    assert torch.equal(copy.shard.params[0], want) and copy.withdrawn_pushes() == ()
    third, effects = _send(copy, first)
    assert effects == [] and third.payloads[0]["accepted"] is True
    assert copy.shard.step == 1 and copy.shard.aggregator.stats[0]["accepted"] == 1


def _chief() -> SyncChief:
    x = torch.tensor(START, dtype=F64, requires_grad=True)
    return SyncChief(gradfleet.GradientDescentOptimizer([x], LR), Job(2, 3, timeout=10),
                     [0], num_shards=2)  # fmt: skip


def _step(worker: int, number: int, tag: int, g: float) -> dict:
    return {"op": "step", "worker": worker, "number": number, "tag": tag, "version": 0,
            "grads": [torch.full((3,), g, dtype=F64)]}  # fmt: skip


def test_the_chief_tells_a_waiting_worker_to_send_its_step_again():
    """Shard 1's copy took over and withdrew worker 0's gradient of step number 1 (worker 0
    waits in line for its token) and worker 1's (its step request is not in yet).  Worker 0 is
    told at once to send its step again, to shard 1 where the copy is, and its step sent again
    waits in its place, shard 0's gradient not added twice; worker 1 is told when its step
    request comes."""
    chief = _chief()
    for w in range(3):
        _send(chief, {"op": "hello", "worker": w, "shapes": [[3]], "dtypes": ["torch.float64"]})
    waiting, _ = _send(chief, _step(0, 1, 0, 1.0))
    assert waiting.payloads == [] and chief.aggregator.counter == 1
    report = {"op": "applied", "worker": -1, "shard": 1, "step": 0,
              "withdrawn": [[0, 1], [1, 1]], "at": "copy:1"}  # fmt: skip
    answer, _ = _send(chief, report)
    assert waiting.payloads == [{"send_again": 1, "at": "copy:1"}]
    assert "standby" not in answer.payloads[0] or answer.payloads[0]["standby"] is None
    again, _ = _send(chief, _step(0, 1, 0, 1.0))
    assert again.payloads == [] and chief.aggregator.counter == 1  # its place, nothing added
    late, _ = _send(chief, _step(1, 1, 0, 3.0))
    assert late.payloads == [{"send_again": 1, "at": "copy:1"}]
    # shard 0 made its update from both; the token waits for shard 1's
    assert chief.shard.step == 1 and chief.global_step == 0
    assert [e.worker for e in chief.line] == [0, 1]
    assert chief.told_again == {}


def test_a_worker_told_to_send_again_whose_token_came_meanwhile_gets_it():
    """Worker 0 is told to send its step again; before it does, the update is made without it
    (shard 0 from workers 0 and 1, shard 1 reports it): its place is served while its request
    is on its way.  The step sent again gets that token (it used to be refused as neither
    waiting nor answered), and nothing is added twice."""
    chief = _chief()
    for w in range(3):
        _send(chief, {"op": "hello", "worker": w, "shapes": [[3]], "dtypes": ["torch.float64"]})
    waiting, _ = _send(chief, _step(0, 1, 0, 1.0))
    report = {"op": "applied", "worker": -1, "shard": 1, "step": 0,
              "withdrawn": [[0, 1]], "at": "copy:1"}  # fmt: skip
    _send(chief, report)
    assert waiting.payloads == [{"send_again": 1, "at": "copy:1"}]
    other, _ = _send(chief, _step(1, 1, 0, 3.0))  # shard 0's update, from workers 0 and 1
    _send(chief, {**report, "step": 1, "withdrawn": []})  # shard 1 made its update
    assert chief.global_step == 1 and other.payloads[0]["token"] == 1
    again, _ = _send(chief, _step(0, 1, 0, 1.0))
    (token,) = again.payloads
    assert token["token"] == 1 and token["accepted"] is True
    assert chief.shard.step == 1 and chief.aggregator.stats[0]["accepted"] == 1
