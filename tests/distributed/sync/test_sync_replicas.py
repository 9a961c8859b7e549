"""SyncReplicasOptimizer: TF's oracles (in process and over real ranks), the accumulator/token
state machine against an independent float64 simulation, argument errors, bad input."""

from __future__ import annotations

import random

import pytest
import torch

import gradfleet
from gradfleet.distributed import ExponentialMovingAverage, SyncReplicasOptimizer
from gradfleet.distributed.common.replies import Answer
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.common.tokens import init_tokens
from gradfleet.distributed.sync.server.aggregator import GradientAggregator
from gradfleet.distributed.sync.server.chief import SyncChief
from gradfleet.distributed.testing import run_ranks
from tests.distributed import sync_ranks

pytestmark = pytest.mark.timeout(120)


class FakeReply:
    def __init__(self) -> None:
        self.payload = None

    def send(self, payload, share=None):
        self.payload = payload


def serve(machine, msg, reply=None, perform=None):
    """Do what the hosting code does with a state machine's outputs: send the answers to
    their tickets (``FakeReply``), hand effects to ``perform``."""
    reply = FakeReply() if reply is None else reply
    for out in machine.handle(msg, reply):
        if isinstance(out, Answer):
            out.ticket.send(out.payload, out.share)
        else:
            perform(out)
    return reply


def tf_vars():
    return [
        torch.tensor(0.0, requires_grad=True),
        torch.tensor(1.0, requires_grad=True),
        torch.tensor([[3.0], [4.0]], requires_grad=True),
    ]


def tf_grads(k):
    return [
        torch.tensor(0.1 + 0.2 * k),
        torch.tensor(0.9 + 0.2 * k),
        torch.sparse_coo_tensor([[1]], [[0.1 + 0.2 * k]], (2, 1)),
    ]


class Sim:
    """Workers driving a SyncChief in one process, in a scripted order."""

    def __init__(self, R, N, num_tokens):
        self.server = SyncChief(
            gradfleet.GradientDescentOptimizer(tf_vars(), 2.0),
            Job(R, N, "shared", init_tokens(num_tokens, R, N), timeout=10),
        )
        self.local = [0] * N

    def step(self, k):
        reply = FakeReply()
        serve(
            self.server,
            {"op": "step", "worker": k, "tag": self.local[k], "grads": tf_grads(k), "version": -1},
            reply,
        )
        return reply

    def finish(self, k, reply):
        assert reply.payload is not None, f"worker {k} is blocked"
        self.local[k] = reply.payload["token"]
        return reply.payload["accepted"]

    def values(self):
        return [p.detach().reshape(-1).tolist() for p in self.server.params]


def close(got, want):
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float32), torch.tensor(want, dtype=torch.float32)
    )


def test_tf_oracle_two_workers_in_process():
    sim = Sim(2, 2, 2)
    assert [sim.finish(k, sim.step(k)) for k in (0, 1)] == [True, True]
    assert sim.server.global_step == 1 and sim.local == [0, 0]
    close(sum(sim.values(), []), [-0.4, -1.0, 3.0, 3.6])
    assert [sim.finish(k, sim.step(k)) for k in (0, 1)] == [False, False]  # the wasted round
    assert sim.server.global_step == 1 and sim.local == [1, 1]
    r0 = sim.step(0)
    assert r0.payload is None  # worker 0 blocks until worker 1 pushes
    r1 = sim.step(1)
    assert sim.finish(0, r0) and sim.finish(1, r1) and sim.server.global_step == 2
    close(sum(sim.values(), [])[:2], [-0.8, -3.0])


def test_tf_oracle_three_workers_one_backup_in_process():
    sim = Sim(2, 3, 3)
    assert sim.finish(0, sim.step(0)) and sim.finish(2, sim.step(2))
    assert sim.server.global_step == 1
    close(sum(sim.values(), [])[:2], [-0.6, -1.2])
    assert not sim.finish(1, sim.step(1))  # worker 1 is late: dropped
    assert [sim.finish(k, sim.step(k)) for k in (0, 1, 2)] == [False] * 3
    assert sim.local == [1, 1, 1] and sim.server.global_step == 1
    r0 = sim.step(0)
    assert r0.payload is None and sim.server.global_step == 1
    r1 = sim.step(1)
    assert sim.finish(0, r0) and sim.finish(1, r1) and sim.server.global_step == 2
    close(sum(sim.values(), [])[:2], [-1.0, -3.2])
    counters = sim.server.aggregator.stats
    assert counters[1] == {"accepted": 1, "dropped": 2, "nonfinite": 0}


@pytest.mark.parametrize(("world", "R"), [(2, 2), (3, 2)])
def test_tf_oracles_over_processes(world, R):
    out = run_ranks(sync_ranks.sync_oracle, world, args=(world, R), timeout=60)
    last = {k: t[-1] for k, t in enumerate(out)}
    if world == 2:
        assert [t[1:4] for t in out[0]] == [(0, 0, True), (1, 1, False), (2, 2, True)]
        close(list(out[0][0][4:6]), [0.0, 1.0])  # worker 0 ran first: nothing applied yet
        close([out[1][0][4], out[1][0][5], *out[1][0][6]], [-0.4, -1.0, 3.0, 3.6])
        for k in (0, 1):
            close(list(last[k][4:6]), [-0.8, -3.0])
    else:
        assert out[1][0][3] is False  # the late gradient of round one was dropped
        for k in (0, 1, 2):
            close(list(out[k][1][4:6]), [-0.6, -1.2])
        for k in (0, 1):
            assert last[k][1] == 2
            close(list(last[k][4:6]), [-1.0, -3.2])


# --------------------------------------------------------------------- state machine
def test_stale_dropped_and_dense_divisor_is_accepted_count():
    agg = GradientAggregator([torch.zeros(2)], 2)
    assert agg.push(0, 0, [torch.tensor([1.0, 2.0])])
    agg.set_global_step(1)  # a chief restart moved the step: tag 0 is now stale
    assert not agg.push(1, 0, [torch.tensor([5.0, 5.0])])
    assert agg.push(1, 1, [torch.tensor([3.0, 4.0])])
    (avg,) = agg.take_average()
    torch.testing.assert_close(avg, torch.tensor([2.0, 3.0]))
    assert agg.global_step == 2 and agg.stats[1] == {"accepted": 1, "dropped": 1, "nonfinite": 0}


def test_sparse_rows_averaged_per_row_duplicates_summed():
    agg = GradientAggregator([torch.zeros(3, 2)], 2)
    agg.push(0, 0, [torch.sparse_coo_tensor([[0, 2, 2]], torch.ones(3, 2), (3, 2))])
    agg.push(1, 0, [torch.sparse_coo_tensor([[0]], torch.full((1, 2), 3.0), (3, 2))])
    (avg,) = agg.take_average()
    # row 0: (1 + 3) / 2; row 2: only worker 0 (duplicates summed, counted once) -> 2
    torch.testing.assert_close(avg.to_dense(), torch.tensor([[2.0, 2.0], [0, 0], [2.0, 2.0]]))


def test_rounds_start_from_zero_and_gradients_of_another_dtype_are_rounded_first():
    """Dense sums, sparse row counts and dtype conversion across two rounds: each round's
    average is that round's alone (float64 reference), a float64 gradient for a float32
    variable rounded before it is added, as TF's accumulator does."""
    params = [torch.zeros(3), torch.zeros(3, 2)]
    agg = GradientAggregator(params, 2)
    rounds = [
        ([torch.tensor([1e-8, 2.0, 3.0], dtype=torch.float64), [0, 2]], [torch.ones(3), [0]]),
        (
            [torch.full((3,), 0.5), [0, 1]],
            [torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64), [1]],
        ),
    ]
    for step, pushes in enumerate(rounds):
        for worker, (dense, rows) in enumerate(pushes):
            sparse = torch.sparse_coo_tensor(
                [rows], torch.full((len(rows), 2), worker + 1.0), (3, 2)
            )
            assert agg.push(worker, step, [dense, sparse])
        dense_avg, sparse_avg = agg.take_average()
        want = sum(d.to(torch.float32).double() for d, _ in pushes) / 2
        torch.testing.assert_close(dense_avg.double(), want, rtol=0, atol=1e-7)
        counts = torch.zeros(3, dtype=torch.float64)
        total = torch.zeros(3, 2, dtype=torch.float64)
        for worker, (_, rows) in enumerate(pushes):
            counts[rows] += 1
            total[rows] += worker + 1.0
        seen = counts > 0
        expected = torch.zeros(3, 2, dtype=torch.float64)
        expected[seen] = total[seen] / counts[seen].unsqueeze(1)
        torch.testing.assert_close(sparse_avg.to_dense().double(), expected)


def test_none_gradient_counts_as_zero_and_all_none_stays_none():
    agg = GradientAggregator([torch.zeros(1), torch.zeros(1)], 2)
    agg.push(0, 0, [torch.tensor([4.0]), None])
    agg.push(1, 0, [None, None])
    avg = agg.take_average()
    torch.testing.assert_close(avg[0], torch.tensor([2.0]))
    assert avg[1] is None


def test_init_tokens_rule_and_error():
    assert init_tokens(-1, 3, 4) == 3 and init_tokens(0, 2, 2) == 0 and init_tokens(5, 2, 1) == 5
    with pytest.raises(
        ValueError, match=r"Too few tokens to finish the first step: 1 \(given\) vs 2"
    ):
        init_tokens(1, 3, 1)


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_match_reference(seed):
    rnd = random.Random(seed)
    N = rnd.randint(1, 4)
    R = rnd.randint(1, 5)
    num_tokens = rnd.choice([-1, max(R - N, 0) + rnd.randint(0, 3)])
    tokens = init_tokens(num_tokens, R, N)
    grads = {k: [[rnd.uniform(-1, 1), rnd.uniform(-1, 1)]] for k in range(N)}
    schedule = [rnd.randrange(N) for _ in range(200)]
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    server = SyncChief(
        gradfleet.GradientDescentOptimizer([x], 0.3), Job(R, N, "shared", tokens, timeout=10)
    )
    local, pending = [0] * N, [None] * N
    for k in schedule:
        if pending[k] is None:
            pending[k] = FakeReply()
            g = torch.tensor(grads[k][0], dtype=torch.float64)
            serve(
                server,
                {"op": "step", "worker": k, "tag": local[k], "grads": [g], "version": -1},
                pending[k],
            )
        elif pending[k].payload is not None:
            local[k], pending[k] = pending[k].payload["token"], None
    want_x, want_step, _ = reference_fifo(R, N, tokens, schedule, grads, 0.3)
    torch.testing.assert_close(server.params[0], torch.tensor(want_x, dtype=torch.float64))
    assert server.global_step == want_step


def reference_fifo(R, N, num_tokens, schedule, grads, lr):
    """``reference_run`` with TF's blocking dequeue: a waiting worker gets the next token in
    the order it started waiting."""
    x = [0.5, -1.0]
    acc, acc_step, gstep = [], 0, 0
    queue, waiters = [0] * num_tokens, []
    local, state = [0] * N, ["ready"] * N
    for k in schedule:
        if state[k] == "ready":
            if local[k] >= acc_step:
                acc.append(grads[k][0])
                if len(acc) >= R:
                    avg = [sum(g[i] for g in acc) / len(acc) for i in range(2)]
                    x = [xi - lr * a for xi, a in zip(x, avg)]
                    acc, acc_step, gstep = [], acc_step + 1, gstep + 1
                    queue += [gstep] * max(N, R)
            state[k] = "waiting"
            waiters.append(k)
            while waiters and queue:
                w = waiters.pop(0)
                local[w] = queue.pop(0)
                state[w] = "served"
        elif state[k] == "served":
            state[k] = "ready"
    return x, gstep, local


def test_several_batches_per_update_when_n_below_r():
    x = torch.tensor([1.0], requires_grad=True)
    server = SyncChief(
        gradfleet.GradientDescentOptimizer([x], 1.0),
        Job(2, 1, "shared", init_tokens(-1, 2, 1), timeout=10),
    )
    local = 0
    for g in (1.0, 3.0):  # one worker, two batches, one update averaging both
        r = FakeReply()
        serve(
            server,
            {"op": "step", "worker": 0, "tag": local, "grads": [torch.tensor([g])], "version": -1},
            r,
        )
        local = r.payload["token"]
    assert server.global_step == 1
    torch.testing.assert_close(x.detach() - 2.0, server.params[0])


def test_moving_average_after_each_update():
    x = torch.tensor([0.0], requires_grad=True)
    ema = ExponentialMovingAverage(0.5)
    server = SyncChief(
        gradfleet.GradientDescentOptimizer([x], 1.0),
        Job(1, 1, "shared", 1, timeout=10, ema=ema, averaged=(0,)),
    )
    for _ in range(2):
        serve(
            server,
            {
                "op": "step",
                "worker": 0,
                "tag": server.global_step,
                "grads": [torch.tensor([-1.0])],
                "version": -1,
            },
            FakeReply(),
        )
    # x: 1 then 2; shadow starts at x after update 1 (1.0), then 0.5*1 + 0.5*2
    torch.testing.assert_close(ema.shadows[0], torch.tensor([1.5]))


# --------------------------------------------------------------------- errors / bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicas_to_aggregate": 0}, "replicas_to_aggregate must be an integer >= 1"),
        ({"replicas_to_aggregate": 3, "total_num_replicas": 1, "num_tokens": 1}, "Too few tokens"),
        (
            {
                "replicas_to_aggregate": 4,
                "total_num_replicas": 3,
                "transport": "allreduce",
                "tokens": "shared",
            },
            "needs replicas_to_aggregate <= total_num_replicas",
        ),
        ({"replicas_to_aggregate": 1, "nonfinite": "ignore"}, "nonfinite must be one of"),
    ],
)
def test_constructor_errors(kwargs, match):
    x = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        SyncReplicasOptimizer(gradfleet.GradientDescentOptimizer([x], 1.0), **kwargs)


def test_single_worker_needs_global_step_and_reports_acceptance():
    x = torch.zeros(2, requires_grad=True)
    inner = gradfleet.GradientDescentOptimizer([x], 1.0)
    with SyncReplicasOptimizer(inner, 1, tokens="shared") as opt:
        with pytest.raises(ValueError, match="Global step is required"):
            opt.apply_gradients([(torch.ones(2), x)])
        gs = torch.zeros((), dtype=torch.int64)
        opt.apply_gradients([(torch.ones(2), x)], gs)
        assert int(gs) == 1 and opt.last_gradient_accepted
        opt.apply_gradients([(torch.ones(2), x)], gs)  # TF's wasted round (initial token 0)
        assert int(gs) == 1 and not opt.last_gradient_accepted
        torch.testing.assert_close(x.detach(), -torch.ones(2))
        assert opt.worker_counters() == {0: {"accepted": 1, "dropped": 1, "nonfinite": 0}}


def test_a_checkpoint_of_one_token_rule_is_refused_by_the_other():
    x = torch.zeros(2, requires_grad=True)
    with SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer([x], 1.0), 1, tokens="shared"
    ) as a:
        a.apply_gradients([(torch.ones(2), x)], torch.zeros((), dtype=torch.int64))
        state = a.state_dict()
    y = torch.zeros(2, requires_grad=True)
    inner = gradfleet.GradientDescentOptimizer([y], 1.0)
    with SyncReplicasOptimizer(inner, 1, tokens="distinct", transport="server") as b:
        with pytest.raises(ValueError, match=r"checkpoint has tokens='shared', this optimizer "):
            b.load_state_dict(state)
        assert b.global_step == 0 and torch.equal(y.detach(), torch.zeros(2))  # nothing changed
    with SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer([y], 1.0), 1, tokens="shared"
    ) as c:
        c.load_state_dict(state)  # the same rule resumes
        assert c.global_step == 1


def test_mismatched_shapes_rejected_by_server_and_nothing_applied():
    agg = GradientAggregator([torch.zeros(2), torch.zeros(3)], 1)
    with pytest.raises(ValueError, match="pushed 1 gradients, the server holds 2"):
        agg.push(4, 0, [torch.zeros(2)])
    with pytest.raises(ValueError, match=r"gradient 1 has shape \(4,\)"):
        agg.push(4, 0, [torch.zeros(2), torch.zeros(4)])
    assert agg.counter == 0 and agg.stats == {}


def test_mismatched_models_across_processes():
    out = run_ranks(sync_ranks.sync_bad_shapes, 2, timeout=60)
    assert out[0] == "ok"
    assert "worker rank 1 has parameter shapes" in out[1] and "every worker must build" in out[1]


def test_nonfinite_policies():
    agg = GradientAggregator([torch.zeros(1)], 1)
    with pytest.raises(FloatingPointError, match="worker 3: non-finite gradient for variable 0"):
        agg.push(3, 0, [torch.tensor([float("nan")])])
    assert agg.counter == 0 and agg.stats[3]["nonfinite"] == 1
    drop = GradientAggregator([torch.zeros(1)], 1, nonfinite="drop")
    assert not drop.push(3, 0, [torch.tensor([float("inf")])]) and drop.counter == 0
    keep = GradientAggregator([torch.zeros(1)], 1, nonfinite="apply")
    assert keep.push(3, 0, [torch.tensor([float("nan")])])


def test_nonfinite_gradient_from_one_worker_over_processes():
    out = run_ranks(sync_ranks.sync_nonfinite, 3, timeout=60)
    assert len(out[2]["errors"]) == 1 and "worker 2: non-finite gradient" in out[2]["errors"][0]
    assert out[0]["errors"] == [] and out[1]["errors"] == []
    assert all(o["finite"] for o in out)
    assert out[0]["server"][2]["nonfinite"] == 1


@pytest.mark.parametrize("transport", ["server", "allreduce"])
def test_starts_from_a_restored_global_step(transport):
    x = torch.zeros(2, requires_grad=True)
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer([x], 1.0),
        1,
        global_step=5,
        transport=transport,
        tokens="shared",
    )
    with opt:
        assert (opt.local_step, opt.global_step) == (5, 5)
        gs = torch.zeros((), dtype=torch.int64)
        accepted = []
        for _ in range(3):  # the first update, TF's wasted round (initial token 5), the next
            opt.apply_gradients([(torch.ones(2), x)], gs)
            accepted.append((opt.last_gradient_accepted, int(gs)))
        assert accepted == [(True, 6), (False, 6), (True, 7)]
        torch.testing.assert_close(x.detach(), -2 * torch.ones(2))


def test_restored_global_step_errors():
    x = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="global_step must be an integer >= 0"):
        SyncReplicasOptimizer(gradfleet.GradientDescentOptimizer([x], 1.0), 1, global_step=-1)
    with pytest.raises(ValueError, match="global_step=3 with dedicated server ranks"):
        SyncReplicasOptimizer(
            gradfleet.GradientDescentOptimizer([x], 1.0), 1, 1, global_step=3,
            server_ranks=[1], server_address="127.0.0.1:1", worker=0,
        )  # fmt: skip
