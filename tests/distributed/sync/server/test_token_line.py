"""The chief's token line (``tokens="distinct"`` / ``"shared"``) and its check that the live
workers can still make the pending update, driven in one process against float64 references
written from the rule: one gradient per worker per update, each computed on the variables of
the step before."""

from __future__ import annotations

import pytest
import torch

import gradfleet
from gradfleet.distributed.common.replies import Answer
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.common.tokens import init_tokens
from gradfleet.distributed.sync.server.chief import SyncChief
from gradfleet.distributed.sync.server.token_line import TokenLine, unfillable

F64 = torch.float64
LR = 0.5


class Reply:
    def __init__(self) -> None:
        self.payload = None

    def send(self, payload, share=None):
        self.payload = payload


class Workers:
    """Workers driving a SyncChief over ``x`` (3 float64 values) with gradient ``grad(k,
    values)``: each worker's gradient depends on the variables it read, so a gradient
    computed on old variables shows in the result."""

    def __init__(self, R, N, tokens, num_tokens=-1, last_step=None):
        self.x = torch.tensor([1.0, -2.0, 0.5], dtype=F64, requires_grad=True)
        self.chief = SyncChief(
            gradfleet.GradientDescentOptimizer([self.x], LR),
            Job(R, N, tokens, init_tokens(num_tokens, R, N), timeout=10, last_step=last_step),
        )
        self.local = [0] * N
        self.read = [self.values() for _ in range(N)]  # what each worker computed on

    def values(self):
        """The chief's variables (its own copy: the workers' ``x`` stays as it was)."""
        return self.chief.params[0].detach().clone()

    @staticmethod
    def grad(k, values):
        return (k + 1.0) * values + torch.tensor([0.1, 0.2, 0.3], dtype=F64) * k

    def handle(self, msg):
        reply = Reply()
        for out in self.chief.handle(msg, reply):
            assert isinstance(out, Answer)
            out.ticket.send(out.payload, out.share)
        return reply

    def step(self, k):
        g = self.grad(k, self.read[k])
        return self.handle(
            {"op": "step", "worker": k, "tag": self.local[k], "grads": [g], "version": -1}
        )

    def finish(self, k, reply):
        assert reply.payload is not None, f"worker {k} is blocked"
        assert "error" not in reply.payload, reply.payload
        self.local[k] = reply.payload["token"]
        self.read[k] = self.values()
        return reply.payload["accepted"]


def test_distinct_has_no_wasted_round_and_waits_for_the_update():
    w = Workers(2, 2, "distinct")
    first = w.step(0)
    assert first.payload is None  # TF's shared queue would hand it an initial token now
    second = w.step(1)
    assert w.finish(0, first) and w.finish(1, second)
    assert w.local == [1, 1] and w.chief.global_step == 1
    x0 = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    want = x0 - LR * (w.grad(0, x0) + w.grad(1, x0)) / 2
    torch.testing.assert_close(w.values(), want, rtol=0, atol=0)
    # the next round is computed on the new variables: no stale gradient is ever pushed
    r0, r1 = w.step(0), w.step(1)
    assert w.finish(0, r0) and w.finish(1, r1) and w.chief.global_step == 2
    want = want - LR * (w.grad(0, want) + w.grad(1, want)) / 2
    torch.testing.assert_close(w.values(), want, rtol=0, atol=0)
    assert w.chief.aggregator.stats[0] == {"accepted": 2, "dropped": 0, "nonfinite": 0}


def test_distinct_a_worker_that_asks_first_cannot_fill_an_update_alone():
    """The worker beside the chief (rank 0) asks first every time: each update still takes one
    gradient from each of the R = N workers."""
    w = Workers(3, 3, "distinct")
    for _ in range(4):
        early = w.step(0)
        assert early.payload is None
        late = [w.step(1), w.step(2)]
        assert all(w.finish(k, r) for k, r in zip((0, 1, 2), [early, *late], strict=True))
    stats = w.chief.aggregator.stats
    assert {k: stats[k]["accepted"] for k in range(3)} == {0: 4, 1: 4, 2: 4}
    assert w.chief.global_step == 4


def test_shared_tokens_let_the_first_worker_fill_an_update():
    """The contrast: TF's queue hands the initial tokens to whoever asks first."""
    w = Workers(2, 2, "shared")
    assert w.finish(0, w.step(0))
    assert w.finish(0, w.step(0))  # its second gradient completes the update
    assert w.chief.global_step == 1 and w.chief.aggregator.stats[0]["accepted"] == 2
    assert 1 not in w.chief.aggregator.stats


def test_distinct_backup_worker_gets_the_next_step_at_once():
    w = Workers(2, 3, "distinct")
    r0 = w.step(0)
    r2 = w.step(2)
    assert w.finish(0, r0) and w.finish(2, r2) and w.chief.global_step == 1
    late = w.step(1)  # computed at step 0, which is made: dropped, and it goes on at once
    assert not w.finish(1, late) and w.local[1] == 1


def test_a_worker_that_left_makes_the_update_unfillable_at_once():
    w = Workers(2, 2, "distinct")
    r0, r1 = w.step(0), w.step(1)
    assert w.finish(0, r0) and w.finish(1, r1) and w.chief.global_step == 1
    done = w.handle({"op": "done", "worker": 1})
    assert done.payload == {"global_step": 1}
    reply = w.step(0)  # worker 0's loop is longer: its gradient can never be joined by one
    assert reply.payload["error"] == "RuntimeError"
    message = reply.payload["message"]
    assert "update at global step 1 can never be made" in message
    assert "worker rank 1 left at global step 1" in message
    assert "global_step reaches" in message and "replicas_to_aggregate" in message


def test_a_worker_that_left_for_a_lost_server_lets_the_others_hear_that_loss():
    """Worker 1 lost a shard server and left saying so: worker 0, waiting, is not told that its
    update can never be made (worker 1 left) but the server's loss, once the chief knows it."""
    w = Workers(2, 2, "distinct")
    r0, r1 = w.step(0), w.step(1)
    assert w.finish(0, r0) and w.finish(1, r1) and w.chief.global_step == 1
    lost = "server rank 3 (shard 1) at 127.0.0.1:5000 is unreachable"
    done = w.handle({"op": "done", "worker": 1, "unreachable": lost})
    assert done.payload == {"global_step": 1}
    reply = w.step(0)
    assert reply.payload is None  # waits: the cause is not "worker 1 left"
    for out in w.chief.unreachable(lost):  # the chief's probe finds the shard gone
        out.ticket.send(out.payload, out.share)
    assert reply.payload["error"] == "ServerUnreachable" and reply.payload["message"] == lost


def test_waiting_workers_hear_at_once_when_the_last_helper_leaves():
    """R = 2 of N = 3: two workers wait in line with one gradient in; once both others have
    left, nobody can give the second one."""
    w = Workers(2, 3, "distinct")
    waiting = w.step(0)
    assert waiting.payload is None
    w.handle({"op": "done", "worker": 1})
    assert waiting.payload is None  # worker 2 can still give one
    w.handle({"op": "done", "worker": 2, "forgotten": True})
    assert waiting.payload["error"] == "RuntimeError"
    assert "worker rank 2 was reported dead at global step 0" in waiting.payload["message"]


def test_shared_tokens_deadlock_is_reported_at_once():
    """TF's queue with no initial token: worker 0 waits for the update, worker 1 leaves."""
    w = Workers(2, 2, "shared", num_tokens=0)
    waiting = w.step(0)
    assert waiting.payload is None
    w.handle({"op": "done", "worker": 1})
    assert waiting.payload["error"] == "RuntimeError"
    assert "none is left" in waiting.payload["message"]


def test_last_step_releases_instead_of_failing():
    w = Workers(2, 2, "distinct", last_step=1)
    r = [w.step(0), w.step(1)]
    assert all(w.finish(k, r[k]) for k in (0, 1))
    w.handle({"op": "done", "worker": 1})
    assert w.finish(0, w.step(0)) is False  # past last_step: released, nothing applied


@pytest.mark.parametrize("rule", ["distinct", "shared"])
def test_random_schedules_against_a_float64_reference(rule):
    """Workers push in random orders (R = 2 of N = 3); the chief's variables equal a float64
    replay of the rule on the same schedule: each update averages the first R accepted
    gradients, each computed on the variables the worker last read."""
    gen = torch.Generator().manual_seed(3)
    w = Workers(2, 3, rule)
    ref = w.values().clone()
    ref_read = [ref.clone() for _ in range(3)]
    ref_step, ref_tags, acc = 0, [0, 0, 0], []
    pending: dict[int, Reply] = {}
    for _ in range(60):
        idle = [k for k in range(3) if k not in pending]
        if not idle:
            break
        k = idle[int(torch.randint(len(idle), (1,), generator=gen))]
        if ref_tags[k] >= ref_step:  # the reference accumulator's rule
            acc.append(w.grad(k, ref_read[k]))
        pending[k] = w.step(k)
        if len(acc) == 2:
            ref = ref - LR * (acc[0] + acc[1]) / 2
            ref_step, acc = ref_step + 1, []
        for j, reply in list(pending.items()):
            if reply.payload is not None:
                w.finish(j, pending.pop(j))
                ref_tags[j], ref_read[j] = w.local[j], ref.clone()
        torch.testing.assert_close(w.values(), ref, rtol=0, atol=0)
        if rule == "distinct":  # nobody gave two gradients to one update
            assert len(w.chief.contributors) == w.chief.aggregator.counter
    assert w.chief.global_step == ref_step >= 10


def test_unfillable_rule():
    base = dict(
        replicas_to_aggregate=3,
        total_num_replicas=4,
        gradients_in=1,
        contributors={0},
        waiting={0},
        tokens_left=0,
        others_pending=False,
        global_step=5,
    )
    assert unfillable(rule="distinct", left={}, **base) is None
    assert unfillable(rule="distinct", left={3: (4, False)}, **base) is None  # 1, 2 remain
    why = unfillable(rule="distinct", left={3: (4, False), 2: (5, True)}, **base)
    assert "worker rank 2 was reported dead at global step 5" in why
    assert "worker rank 3 left at global step 4" in why
    assert unfillable(rule="shared", left={3: (4, False)}, **base) is None  # 1, 2 compute
    shared = dict(base, waiting={0, 1, 2})
    assert unfillable(rule="shared", left={3: (4, False)}, **shared) is not None
    assert unfillable(rule="shared", left={3: (4, False)}, **dict(shared, tokens_left=1)) is None


def test_token_line_rejects_an_unknown_rule():
    with pytest.raises(ValueError, match="tokens must be one of"):
        TokenLine("fifo", 0, 1, 1)
