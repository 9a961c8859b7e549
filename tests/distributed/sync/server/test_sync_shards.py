"""SyncReplicasOptimizer with parameters sharded over several server ranks (``server_ranks``).

The single-server path is the reference (itself checked against TF's oracles and the float64
simulation in test_sync_replicas.py): in process, the same scripted arrival order must give
bit-identical variables, steps and counters with 1 server and with 2-3 shard servers; over
real processes, TF's oracles with two shard servers, a world of 3 with lockstep R = N,
shard-server death, and checkpoint/resume with two shards.
"""

from __future__ import annotations

import random
import shutil
import tempfile

import pytest
import torch

import gradfleet
from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.common.tokens import init_tokens
from gradfleet.distributed.sync.layout.assignment import assign, by_bytes, round_robin
from gradfleet.distributed.sync.server.chief import SyncChief
from gradfleet.distributed.sync.server.shards import Shard, ShardServer
from gradfleet.distributed.testing import RankKilled, run_ranks
from tests.distributed import sync_ranks
from tests.distributed.sync.test_sync_replicas import FakeReply, close, serve, tf_grads, tf_vars

F64 = torch.float64


class Cluster:
    """Workers driving a chief + shard servers in one process (no sockets), in script order.

    ``shards == 0`` is the plain single server.  A worker's step pushes to shards 1.. and then
    the chief, exactly as ``PlainLinks.push`` does."""

    def __init__(self, make_opt, R, N, num_tokens, shards, last_step=None):
        opt = make_opt()
        count = len([p for g in opt.param_groups for p in g["params"]])
        S = max(shards, 1)
        self.parts = round_robin(count, S)
        tokens = init_tokens(num_tokens, R, N)
        job = Job(R, N, "shared", tokens, timeout=10, last_step=last_step)
        if shards == 0:
            self.chief = SyncChief(opt, job)
        else:
            self.chief = SyncChief(opt, job, indices=self.parts[0], num_shards=S)
        self.shards = []
        for k in range(1, S):
            self.shards.append(ShardServer(k, Shard(make_opt(), self.parts[k], job), job))
        self.local = [0] * N
        self.count = count

    def _applied(self, effect):
        serve(self.chief, {"op": "applied", "shard": effect.shard, "step": effect.step})

    def step(self, k, grads):
        """Push worker k's gradients; returns the (possibly pending) token reply."""
        accepted = True
        for server in self.shards:
            r = FakeReply()
            part = [grads[i] for i in self.parts[server.k]]
            msg = {"op": "push", "worker": k, "tag": self.local[k], "grads": part}
            serve(server, msg, r, perform=self._applied)
            accepted = accepted and r.payload["accepted"]
        reply = FakeReply()
        part = [grads[i] for i in self.parts[0]]
        serve(
            self.chief,
            {"op": "step", "worker": k, "tag": self.local[k], "grads": part, "version": -1},
            reply,
        )
        reply.all_accepted = accepted
        return reply

    def finish(self, k, reply):
        assert reply.payload is not None, f"worker {k} is blocked"
        self.local[k] = reply.payload["token"]
        return reply.payload["accepted"] and reply.all_accepted

    def values(self):
        out = [None] * self.count
        for i, p in zip(self.parts[0], self.chief.params, strict=True):
            out[i] = p.detach().clone()
        for server in self.shards:
            for i, p in zip(server.shard.indices, server.shard.params, strict=True):
                out[i] = p.detach().clone()
        return out


def sgd_tf():
    return gradfleet.GradientDescentOptimizer(tf_vars(), 2.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shards", [0, 2, 3])
def test_tf_oracles_in_process(shards):
    """Section 1.10's two scenarios; shards=0 is the single server (the reference)."""
    two = Cluster(sgd_tf, 2, 2, 2, shards)
    assert [two.finish(k, two.step(k, tf_grads(k))) for k in (0, 1)] == [True, True]
    assert two.chief.global_step == 1
    close([v.reshape(-1).tolist() for v in two.values()][2], [3.0, 3.6])
    assert [two.finish(k, two.step(k, tf_grads(k))) for k in (0, 1)] == [False, False]
    r0 = two.step(0, tf_grads(0))
    assert r0.payload is None  # blocks until worker 1 pushes
    r1 = two.step(1, tf_grads(1))
    assert two.finish(0, r0) and two.finish(1, r1) and two.chief.global_step == 2
    close([v.item() for v in two.values()[:2]], [-0.8, -3.0])

    three = Cluster(sgd_tf, 2, 3, 3, shards)
    assert three.finish(0, three.step(0, tf_grads(0)))
    assert three.finish(2, three.step(2, tf_grads(2)))
    close([v.item() for v in three.values()[:2]], [-0.6, -1.2])
    assert not three.finish(1, three.step(1, tf_grads(1)))
    assert [three.finish(k, three.step(k, tf_grads(k))) for k in (0, 1, 2)] == [False] * 3
    r0 = three.step(0, tf_grads(0))
    assert r0.payload is None and three.chief.global_step == 1
    r1 = three.step(1, tf_grads(1))
    assert three.finish(0, r0) and three.finish(1, r1) and three.chief.global_step == 2
    close([v.item() for v in three.values()[:2]], [-1.0, -3.2])


def _model_opt(kind):
    def make():
        torch.manual_seed(3)
        params = [
            torch.randn(2, dtype=F64),
            torch.randn(3, 2, dtype=F64),
            torch.randn(1, dtype=F64),
        ]
        params += [torch.randn(4, dtype=F64), torch.randn((), dtype=F64)]
        params = [p.requires_grad_() for p in params]
        if kind == "adam":  # two groups: beta powers are per group, kept on every shard
            return gradfleet.AdamOptimizer(
                [{"params": params[:3]}, {"params": params[3:], "lr": 0.05}], 0.1
            )
        return gradfleet.GradientDescentOptimizer(params, 0.3)

    return make


def _drive(cluster, schedule, grads_of, N):
    pending = [None] * N
    accepted = []
    for k in schedule:
        if pending[k] is None:
            pending[k] = cluster.step(k, grads_of(k, cluster.local[k]))
        elif pending[k].payload is not None:
            accepted.append((k, cluster.finish(k, pending[k])))
            pending[k] = None
    return accepted


def random_job(seed, length):
    """A random job: ``(N, R, num_tokens, optimizer kind, schedule of workers, last_step,
    grads_of(worker, tag))``; backups, ``N < R``, initial tokens and ``last_step`` included."""
    rnd = random.Random(seed)
    N, R = rnd.randint(1, 4), rnd.randint(1, 4)
    tokens = rnd.choice([-1, max(R - N, 0) + rnd.randint(0, 2)])
    kind = "adam" if seed % 2 else "sgd"
    schedule = [rnd.randrange(N) for _ in range(length)]
    last_step = rnd.choice([None, 15])
    shapes = [tuple(p.shape) for g in _model_opt(kind)().param_groups for p in g["params"]]

    def grads_of(k, tag):
        gen = torch.Generator().manual_seed(100 * k + tag)
        return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]

    return N, R, tokens, kind, schedule, last_step, grads_of


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(12))
def test_random_schedules_identical_to_single_server(seed):
    """Same arrival order (backups, N < R, stale drops, last_step included): bit-identical
    variables, steps, acceptance and shard-0 counters with 1, 2 and 3 servers."""
    N, R, tokens, kind, schedule, last_step, grads_of = random_job(seed, 200)
    runs = []
    for shards in (0, 2, 3):
        cluster = Cluster(_model_opt(kind), R, N, tokens, shards, last_step)
        accepted = _drive(cluster, schedule, grads_of, N)
        runs.append((cluster, accepted))
    ref, ref_accepted = runs[0]
    assert ref.chief.global_step > 0 or R > len(schedule)
    for cluster, accepted in runs[1:]:
        assert cluster.chief.global_step == ref.chief.global_step
        assert accepted == ref_accepted and cluster.local == ref.local
        assert cluster.chief.aggregator.stats == ref.chief.aggregator.stats
        for got, want in zip(cluster.values(), ref.values(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for server in cluster.shards:
            assert server.shard.step == ref.chief.global_step
            assert server.shard.aggregator.stats == ref.chief.aggregator.stats
    if kind == "adam":  # every shard's copy advanced its own beta powers once per global step
        want = ref.chief.opt.param_groups[1]["non_slot"]["beta1_power"]
        for cluster, _ in runs[1:]:
            for opt in [cluster.chief.opt] + [s.shard.opt for s in cluster.shards]:
                torch.testing.assert_close(opt.param_groups[1]["non_slot"]["beta1_power"], want)


# --------------------------------------------------------------------- real processes
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("world", "R"), [(2, 2), (3, 2)])
def test_tf_oracles_over_processes_two_shard_servers(world, R):
    out = run_ranks(sync_ranks.sync_oracle, world, args=(world, R, [0, 1]), timeout=60)
    last = {k: t[-1] for k, t in enumerate(out)}
    if world == 2:
        assert [t[1:4] for t in out[0]] == [(0, 0, True), (1, 1, False), (2, 2, True)]
        close([out[1][0][4], out[1][0][5], *out[1][0][6]], [-0.4, -1.0, 3.0, 3.6])
        for k in (0, 1):
            close(list(last[k][4:6]), [-0.8, -3.0])
    else:
        assert out[1][0][3] is False
        for k in (0, 1, 2):
            close(list(out[k][1][4:6]), [-0.6, -1.2])
        for k in (0, 1):
            assert last[k][1] == 2
            close(list(last[k][4:6]), [-1.0, -3.2])


@pytest.mark.timeout(120)
def test_world_of_three_two_shard_servers_matches_single_server():
    """R = N = 3 with no initial tokens runs in lockstep (each update holds one gradient of
    every worker), so the trajectory is fixed up to the order of the 3-term sums: Adam, 12
    updates, ranks 0 and 1 serve shards vs rank 0 alone."""
    args = (3, 3, 12, "server", None, 0.0, 4, None, 20.0)
    one = run_ranks(sync_ranks.sync_train, 3, args=(*args, None, 0, True), timeout=90)
    two = run_ranks(sync_ranks.sync_train, 3, args=(*args, [0, 1], 0, True), timeout=90)
    for r in range(3):
        assert one[r]["global_step"] == two[r]["global_step"] == 12
        assert one[r]["count"] == two[r]["count"] == 12  # lockstep: no dropped gradient
        assert two[r]["counters"] == {"accepted": 12, "dropped": 0}
        for a, b in zip(one[r]["params"], two[r]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert two[0]["server_counters"] == {
        r: {"accepted": 12, "dropped": 0, "nonfinite": 0} for r in range(3)
    }


@pytest.mark.timeout(90)
def test_world_of_four_backup_two_shard_servers_trains():
    """R = 3 of N = 4 (one backup), shards on ranks 1 and 3: everyone reaches the step and
    ends on the same variables."""
    out = run_ranks(
        sync_ranks.sync_train,
        4,
        args=(3, 4, 15, "server", None, 0.0, 4, None, 20.0, [1, 3]),
        timeout=90,
    )
    for r in range(4):
        assert out[r]["global_step"] == 15
        for a, b in zip(out[r]["params"], out[0]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("victim", "name"), [(1, "server rank 1 (shard 1)"), (0, "server rank 0")])
def test_shard_server_death_names_its_rank(victim, name):
    """Ranks 0 (chief, shard 0) and 1 (shard 1) serve; one of them is SIGKILLed after 5
    steps: the other workers raise ServerUnreachable naming it within the timeout (3 s)."""
    out = run_ranks(
        sync_ranks.sync_error,
        3,
        args=(3, 3, 5, False, [0, 1], victim),
        timeout=60,
        kill_on={victim: "die"},
    )
    assert out[victim] == RankKilled(victim)
    for r in {0, 1, 2} - {victim}:
        assert out[r].startswith("ServerUnreachable"), out[r]
        assert name in out[r]
        assert float(out[r].split(" after ")[1].split("s:")[0]) < 10


@pytest.mark.timeout(90)
def test_checkpoint_resume_with_two_shards_same_trajectory():
    """One worker, two shard servers (both on rank 0, Adam): checkpoint after 4 updates,
    resume in fresh processes; identical to the uninterrupted sharded run and to the
    unsharded one."""
    path = tempfile.mkdtemp()
    try:
        plain = run_ranks(sync_ranks.sync_checkpoint, 1, args=("server", 99, 8, path + "/p"))
        full = run_ranks(sync_ranks.sync_checkpoint, 1, args=("server", 99, 8, path + "/x", [0, 0]))
        first = run_ranks(sync_ranks.sync_checkpoint, 1, args=("server", 4, 8, path, [0, 0]))
        resumed = run_ranks(sync_ranks.sync_checkpoint, 1, args=("server", 4, 8, path, [0, 0]))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    steps = first[0] + resumed[0]
    assert [s for s, _ in steps] == [s for s, _ in full[0]] == [s for s, _ in plain[0]]
    for (_, got), (_, want), (_, ref) in zip(steps, full[0], plain[0], strict=True):
        for g, w, p in zip(got, want, ref, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
            torch.testing.assert_close(g, p, rtol=0, atol=0)


# --------------------------------------------------------------------- arguments
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"server_ranks": []}, "at least one rank"),
        ({"server_ranks": [0, 1]}, "server rank 1 is neither a worker rank"),
        ({"server_ranks": [0, 0, 0]}, "3 server shards for 2 parameters"),
        ({"server_ranks": [0, 0], "server_address": "h:1", "worker": 0}, "one address per"),
    ],
)
def test_server_ranks_errors(kwargs, match):
    params = [torch.zeros(1, requires_grad=True), torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match=match):
        SyncReplicasOptimizer(gradfleet.GradientDescentOptimizer(params, 1.0), 1, **kwargs)


@pytest.mark.timeout(30)
def test_sharded_allreduce_rejected():
    params = [torch.zeros(1, requires_grad=True), torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="sharding"):
        SyncReplicasOptimizer(
            gradfleet.GradientDescentOptimizer(params, 1.0),
            1,
            transport="allreduce",
            server_ranks=[0, 0],
        )


# --------------------------------------------------------------------- shard assignment
def test_byte_balanced_assignment_against_brute_force():
    """Greedy largest-first is within the largest tensor of the best split (checked by brute
    force over every assignment), keeps whole tensors, and beats round-robin on uneven sizes."""
    import itertools

    sizes = [30, 25, 15, 12, 8, 5, 3, 2, 1]  # the benchmark's 9 tensors, in percent
    for S in (2, 3, 4):
        parts = by_bytes(sizes, S)
        assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in p) for p in parts]
        best = min(
            max(sum(sizes[i] for i in range(len(sizes)) if a[i] == k) for k in range(S))
            for a in itertools.product(range(S), repeat=len(sizes))
        )
        assert max(loads) <= best + max(sizes) and max(loads) <= 4 / 3 * best  # LPT's bound
        robin = [sum(sizes[i] for i in p) for p in round_robin(len(sizes), S)]
        assert max(loads) <= max(robin)
    assert max(sum(sizes[i] for i in p) for p in by_bytes(sizes, 4)) == 30  # the optimum


def test_assignment_argument():
    params = [torch.zeros(n) for n in (1, 100, 10)]
    assert assign(params, 2, "bytes") == [[1], [0, 2]]
    assert assign(params, 2, "round_robin") == [[0, 2], [1]]
    with pytest.raises(ValueError, match="shard_assignment must be one of"):
        assign(params, 2, "random")
