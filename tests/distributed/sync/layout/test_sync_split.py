"""``shard_assignment="split"``: large parameters cut into pieces over the SyncReplicas shards.

The reference is the single server of test_sync_shards.py (itself checked against TF's oracles
and the float64 simulation): in process, the same scripted arrival order (backup workers,
stale drops, N < R) must give bit-identical variables, steps and counters when the pieces of
the parameters are spread over 2-3 shards, for elementwise optimizers in float64 and float32
and with optimizer state that existed before the split (sliced into the pieces).  Over real
processes: split vs whole-parameter sharding (colocated and on dedicated server ranks) and a
checkpoint round trip with split shards.
"""

from __future__ import annotations

import io
import math
import random
import shutil
import tempfile

import pytest
import torch

import gradfleet
from gradfleet.distributed import ExponentialMovingAverage, SyncReplicasOptimizer
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.common.tokens import init_tokens
from gradfleet.distributed.sync.layout.assignment import assign
from gradfleet.distributed.sync.layout.pieces import (
    ELEMENTWISE_TORCH,
    check_dense,
    check_elementwise,
    in_backward_order,
    plan,
    split_optimizer,
    view,
)
from gradfleet.distributed.sync.server.chief import SyncChief
from gradfleet.distributed.sync.server.shards import Shard, ShardServer
from gradfleet.distributed.testing import run_ranks
from tests.distributed import dedicated_ranks, sync_ranks
from tests.distributed.sync import overlap_ranks
from tests.distributed.sync.server.test_sync_shards import Cluster, _drive
from tests.distributed.sync.test_sync_replicas import FakeReply, serve

SHAPES = [(33, 17), (3,), (1, 300), (400,), ()]  # rows, a bias, one row (flat cut), 1-D, ()


def _optimizer(kind, dtype):
    """A factory of the wrapped optimizer over fresh parameters; every factory call gives the
    same values and the same state: one local step was taken first, so the copies' state
    (slots, beta powers, step counts) must be sliced into the pieces."""

    def make():
        gen = torch.Generator().manual_seed(5)
        params = [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in SHAPES]
        groups = [{"params": params[:3]}, {"params": params[3:], "lr": 0.02}]
        if kind == "adam":
            opt = gradfleet.AdamOptimizer(groups, 0.05)
        elif kind == "ftrl":
            opt = gradfleet.FtrlOptimizer(groups, 0.1, l1_regularization_strength=0.01)
        elif kind == "momentum":
            opt = gradfleet.MomentumOptimizer(groups, 0.1, 0.9, use_nesterov=True)
        elif kind == "rmsprop":
            opt = gradfleet.RMSPropOptimizer(groups, 0.01, momentum=0.5, centered=True)
        else:
            opt = torch.optim.Adam(groups, lr=0.05)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
        return opt

    return make


class SplitCluster(Cluster):
    """``Cluster`` whose shards hold the pieces of :func:`plan` (parts index the pieces)."""

    def __init__(self, make_opt, R, N, num_tokens, shards, last_step=None, how="split"):
        opt = make_opt()
        params = [p for g in opt.param_groups for p in g["params"]]
        self.pieces = plan(params, shards)
        self.parts = assign([view(params[pc.index], pc) for pc in self.pieces], shards, how)
        tokens = init_tokens(num_tokens, R, N)
        job = Job(R, N, "shared", tokens, timeout=10, last_step=last_step)
        self.chief = SyncChief(
            opt, job, indices=self.parts[0], num_shards=shards, pieces=self.pieces
        )
        self.shards = [
            ShardServer(k, Shard(make_opt(), self.parts[k], job, self.pieces), job)
            for k in range(1, shards)
        ]
        self.local = [0] * N
        self.shapes = [p.shape for p in params]

    def _part(self, grads, k):
        return [view(grads[self.pieces[j].index], self.pieces[j]) for j in self.parts[k]]

    def step(self, k, grads):
        accepted = True
        for server in self.shards:
            r = FakeReply()
            msg = {"op": "push", "worker": k, "tag": self.local[k],
                   "grads": self._part(grads, server.k)}  # fmt: skip
            serve(server, msg, r, perform=self._applied)
            accepted = accepted and r.payload["accepted"]
        reply = FakeReply()
        msg = {"op": "step", "worker": k, "tag": self.local[k], "grads": self._part(grads, 0),
               "version": -1}  # fmt: skip
        serve(self.chief, msg, reply)
        reply.all_accepted = accepted
        return reply

    def values(self):
        """The whole variables, assembled from the pieces every shard holds."""
        out = [torch.full(s, math.nan, dtype=self.chief.params[0].dtype) for s in self.shapes]
        held = [(self.chief.shard.indices, self.chief.params)]
        held += [(s.shard.indices, s.shard.params) for s in self.shards]
        for indices, params in held:
            for j, p in zip(indices, params, strict=True):
                view(out[self.pieces[j].index], self.pieces[j]).copy_(p)
        return out


def test_plan_cuts_rows_or_flat_and_balances():
    params = [torch.zeros(s) for s in SHAPES]
    total = sum(p.numel() * 4 for p in params)
    for S in (2, 3, 4):
        pieces = plan(params, S)
        covered = [torch.zeros(s) for s in SHAPES]
        for pc in pieces:
            v = view(covered[pc.index], pc)
            assert v.is_contiguous() and v.numel() * 4 <= math.ceil(total / (2 * S)) + 4 * 17
            v += 1
        assert all(bool((c == 1).all()) for c in covered)  # every element exactly once
        loads = [0] * S
        for k, idx in enumerate(assign([view(params[pc.index], pc) for pc in pieces], S, "split")):
            loads[k] = sum(view(params[pieces[j].index], pieces[j]).numel() * 4 for j in idx)
        # LPT over pieces of at most P / (2S) (+ one row): no shard above P/S + the largest piece
        largest = max(view(params[pc.index], pc).numel() * 4 for pc in pieces)
        assert max(loads) <= total / S + largest
    three = plan(params, 3)  # limit 1265 * 4 / 6 bytes: 3 row blocks, 2 flat chunks, 2 blocks
    assert [(pc.index, pc.flat) for pc in three if pc.stop is not None] == [
        (0, False),
        (0, False),
        (0, False),
        (2, True),
        (2, True),
        (3, False),
        (3, False),
    ]


@pytest.mark.parametrize(
    ("ranks", "runs"),
    [
        ([4, 5, 6, 7] * 2, [0, 1, 2, 3, 4, 5, 6, 7]),  # each rank's first shard, then second
        ([4, 4, 5, 5], [0, 2, 1, 3]),  # consecutive runs on different ranks
        ([0, 1, 2], [0, 1, 2]),
    ],
)
def test_backward_order_cuts_runs_last_parameter_first(ranks, runs):
    """Runs of pieces contiguous in reverse parameter order, about P / S bytes each, handed to
    the shards so that runs completing one after another sit on different ranks."""
    params = [torch.zeros(s) for s in [(40, 10), (10,), (40, 40), (40,), (40, 4), (4,)]]
    S = len(ranks)
    pieces = plan(params, S)
    sizes = [view(params[pc.index], pc).numel() * 4 for pc in pieces]
    parts = in_backward_order(sizes, ranks)
    assert sorted(j for p in parts for j in p) == list(range(len(pieces)))  # each piece once
    run_of = {j: runs.index(k) for k, p in enumerate(parts) for j in p}
    backward = list(reversed(range(len(pieces))))
    assert [run_of[j] for j in backward] == sorted(run_of[j] for j in backward)  # contiguous
    assert run_of[backward[0]] == 0 and run_of[backward[-1]] == S - 1
    total, largest = sum(sizes), max(sizes)
    for p in parts:  # no run further than a piece from its share
        assert p and abs(sum(sizes[j] for j in p) - total / S) <= largest
    # the same through assign(), which takes the pieces' tensors
    views = [view(params[pc.index], pc) for pc in pieces]
    assert assign(views, S, "backward_order", ranks) == parts


def test_backward_order_keeps_every_run_non_empty():
    """A piece larger than several runs' share (a parameter that could not be cut) must not
    leave a run empty: the pieces after it fill the runs left."""
    parts = in_backward_order([1, 1, 1, 100], [0, 1, 2, 3])
    assert parts == [[3], [2], [1], [0]]
    with pytest.raises(ValueError, match="4 shards for 3 pieces"):
        in_backward_order([1, 1, 1], [0, 1, 2, 3])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["adam", "ftrl", "momentum", "rmsprop", "torch_adam"])
def test_split_is_bit_identical_to_single_server(kind, dtype):
    """Random arrival orders with backup workers (R < N) and N < R: every piece's update is
    the slice of the whole update, so the variables are bit-identical to the single server."""
    make = _optimizer(kind, dtype)
    for seed in range(3):
        rnd = random.Random(seed)
        N, R = [(3, 2), (4, 3), (2, 3)][seed]
        schedule = [rnd.randrange(N) for _ in range(120)]

        def grads_of(k, tag):
            gen = torch.Generator().manual_seed(100 * k + tag)
            return [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]

        ref = Cluster(make, R, N, -1, 0)
        ref_accepted = _drive(ref, schedule, grads_of, N)
        assert ref.chief.global_step > 5
        for shards, how in ((2, "split"), (3, "split"), (3, "backward_order")):
            cluster = SplitCluster(make, R, N, -1, shards, how=how)
            assert len(cluster.pieces) > len(SHAPES)  # something was cut
            accepted = _drive(cluster, schedule, grads_of, N)
            assert accepted == ref_accepted and cluster.local == ref.local
            assert cluster.chief.global_step == ref.chief.global_step
            assert cluster.chief.aggregator.stats == ref.chief.aggregator.stats
            for got, want in zip(cluster.values(), ref.values(), strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_split_state_dict_round_trip_in_process():
    """A split shard's checkpoint loads into a fresh shard of the same plan and continues
    identically; a shard of another plan refuses it."""
    make = _optimizer("adam", torch.float64)
    params = [p for g in make().param_groups for p in g["params"]]
    pieces = plan(params, 2)
    parts = assign([view(params[pc.index], pc) for pc in pieces], 2, "split")
    a = Shard(make(), parts[1], Job(1, 1), pieces=pieces)
    grads = [torch.ones_like(a_p) for a_p in a.params]
    a.push(0, 0, [g.clone() for g in grads])  # the accumulators may take the tensors over
    buffer = io.BytesIO()  # saved and loaded as a checkpoint is (it must not share tensors)
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    b = Shard(make(), parts[1], Job(1, 1), pieces=pieces)
    b.load_state_dict(saved)
    for shard in (a, b):
        shard.push(0, 1, [g.clone() for g in grads])
    for x, y in zip(a.params, b.params, strict=True):
        assert torch.equal(x, y)
    other = Shard(make(), parts[0], Job(1, 1), pieces=pieces)
    with pytest.raises(ValueError, match="checkpoint shard holds parameters"):
        other.load_state_dict(saved)


class NotKnown(torch.optim.Adam):
    pass


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda p: gradfleet.NormalizedSGD(p, 0.1), "NormalizedSGD"),
        (lambda p: NotKnown(p), "NotKnown"),
        (lambda p: torch.optim.LBFGS(p), "LBFGS"),
    ],
)
@pytest.mark.parametrize("how", ["split", "backward_order"])
def test_split_refuses_non_elementwise_optimizers(make, name, how):
    params = [torch.zeros(8, 4, requires_grad=True), torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match=f"shard_assignment='split' or 'backward_order'.*{name}"):
        SyncReplicasOptimizer(make(params), 1, server_ranks=[0, 0], shard_assignment=how)


def test_split_accepts_the_known_elementwise_ones():
    p = [torch.zeros(2, requires_grad=True)]
    for opt in (
        gradfleet.AdamOptimizer(p, 0.1),
        gradfleet.GradVarianceScaledOptimizer(p, 0.1),
        gradfleet.NeuralOptimizer1(p, 0.1),
        torch.optim.AdamW(p),
        torch.optim.SGD(p, lr=0.1),
    ):
        check_elementwise(opt)


def test_split_refuses_moving_averages_and_sparse_gradients():
    params = [torch.zeros(8, 4, requires_grad=True), torch.zeros(2, requires_grad=True)]
    for how in ("split", "backward_order"):
        with pytest.raises(ValueError, match=f"shard_assignment='{how}' does not support var"):
            SyncReplicasOptimizer(
                gradfleet.AdamOptimizer(params, 0.1), 1, server_ranks=[0, 0],
                shard_assignment=how, variable_averages=ExponentialMovingAverage(0.9),
            )  # fmt: skip
    pieces = plan(params, 2)
    sparse = torch.sparse_coo_tensor([[1]], torch.ones(1, 4), (8, 4), check_invariants=True)
    with pytest.raises(ValueError, match="parameter 0 of shape \\(8, 4\\) got a torch.sparse_coo"):
        check_dense([sparse, None], pieces)
    check_dense([sparse.to_dense(), None], pieces)


# --------------------------------------------------------------------- real processes
@pytest.mark.timeout(120)
def test_split_over_processes_equals_whole_parameter_shards():
    """R = N = 2 in lockstep (no initial tokens, so every update holds one gradient of each
    worker, and a two-term sum does not depend on the arrival order), Adam, shards on ranks 0
    and 1: whole-parameter and split shards end on bit-identical variables on every rank."""
    args = (2, 2, 8, "server", None, 0.0, 16, None, 20.0, [0, 1], 0, True, False)
    whole = run_ranks(sync_ranks.sync_train, 2, args=args, timeout=90)
    split = run_ranks(sync_ranks.sync_train, 2, args=(*args, "split"), timeout=90)
    for r in range(2):
        assert whole[r]["global_step"] == split[r]["global_step"] == 8
        for a, b in zip(whole[r]["params"], split[r]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.timeout(240)
def test_split_on_dedicated_servers_and_checkpoint_resume():
    """Two workers, two dedicated server ranks, split shards: the same trajectory as whole
    parameters on the same servers; each server's checkpoint resumes it."""
    steps, path = 6, tempfile.mkdtemp()
    try:
        run = dedicated_ranks.sync_train
        whole = run_ranks(run, 4, args=(2, [2, 3], steps), timeout=120)
        full = run_ranks(run, 4, args=(2, [2, 3], steps, 0, None, "split"), timeout=120)
        first = run_ranks(run, 4, args=(2, [2, 3], 3, 0, path, "split"), timeout=120)
        second = run_ranks(run, 4, args=(2, [2, 3], steps, 3, path, "split"), timeout=120)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    assert whole[0]["pieces"] == 4 and full[0]["pieces"] > 4  # the (4, 3) weight was cut
    for w in range(2):
        resumed = first[w]["trace"] + second[w]["trace"]
        for trace in (full[w]["trace"], resumed):
            assert [s for s, _ in trace] == [s for s, _ in whole[w]["trace"]]
            for (_, got), (_, want) in zip(trace, whole[w]["trace"], strict=True):
                for g, x in zip(got, want, strict=True):
                    assert torch.equal(g, x)


def _elementwise_classes():
    from gradfleet import optimizers

    out = [c for c in optimizers.ALL if c is not optimizers.BaseCustomOptimizer]
    out += [getattr(torch.optim, n) for n in ELEMENTWISE_TORCH]
    return out


EXTRA = {  # arguments that switch on more of the maths
    "MomentumOptimizer": {"momentum": 0.9, "use_nesterov": True},
    "RMSPropOptimizer": {"momentum": 0.5, "centered": True},
    "FtrlOptimizer": {"l1_regularization_strength": 0.01, "l2_regularization_strength": 0.1},
    "AdagradDAOptimizer": {"l1_regularization_strength": 0.01},
    "ProximalAdagradOptimizer": {"l1_regularization_strength": 0.01},
    "ProximalGradientDescentOptimizer": {"l1_regularization_strength": 0.01},
}


def _make(cls, params):
    if cls.__module__.startswith("torch.optim"):
        return cls(params, lr=0.05)
    return cls(params, 0.05, **EXTRA.get(cls.__name__, {}))


@pytest.mark.parametrize("cls", _elementwise_classes(), ids=lambda c: c.__name__)
def test_every_class_the_rule_accepts_updates_pieces_as_slices(cls):
    """Three steps of the whole optimizer vs its split copy (:func:`split_optimizer`) started
    from the same state: accepted classes give bit-identical pieces; NormalizedSGD, which
    the rule refuses, does not (its per-tensor norm differs per piece)."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]
    opt = _make(cls, params)
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(4)]
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    opt.step()  # state exists before the split: it is sliced
    pieces = plan(params, 3)
    copy_, values = split_optimizer(opt, pieces)
    for step in grads[1:]:
        for p, g in zip(params, step, strict=True):
            p.grad = g
        for v, pc in zip(values, pieces, strict=True):
            v.grad = view(step[pc.index], pc).clone()
        opt.step()
        copy_.step()
    same = all(
        torch.equal(v, view(params[pc.index].detach(), pc))
        for v, pc in zip(values, pieces, strict=True)
    )
    try:
        check_elementwise(opt)
    except ValueError:
        assert cls is gradfleet.NormalizedSGD and not same
    else:
        assert same


@pytest.mark.timeout(240)
def test_split_with_overlap_on_dedicated_servers():
    """Overlap pushes a shard once every parameter with a piece in it has its gradient (a cut
    parameter feeds several shards): with and without overlap, split shards on dedicated
    ranks give the whole-parameter trajectory bit for bit (two workers in lockstep)."""
    whole = run_ranks(overlap_ranks.dedicated_lockstep, 4, args=(2, [2, 3], 5), timeout=100)
    split = run_ranks(
        overlap_ranks.dedicated_lockstep, 4, args=(2, [2, 3], 5, "split"), timeout=100
    )
    # backward order, two shards per server rank: overlap pushes runs as backward ends them
    ordered = run_ranks(
        overlap_ranks.dedicated_lockstep, 4, args=(2, [2, 3] * 2, 5, "backward_order"),
        timeout=100,
    )  # fmt: skip
    for rank in (0, 1):
        want = whole[rank][False]
        runs = (split[rank][False], split[rank][True], ordered[rank][False], ordered[rank][True])
        for got in runs:
            assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4, 5]
            for (_, a), (_, b) in zip(got, want, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(120)
def test_split_checkpoint_resume_on_worker_ranks():
    """One worker hosting two split shards (rank 0 twice), Adam: the optimizer's state_dict
    after 4 updates, saved and loaded in fresh processes, continues the uninterrupted split
    run and the whole-parameter run bit for bit; so do 6 split shards for 4 parameters."""
    path = tempfile.mkdtemp()
    run = sync_ranks.sync_checkpoint
    try:
        plain = run_ranks(run, 1, args=("server", 99, 8, path + "/p", [0, 0]))
        full = run_ranks(run, 1, args=("server", 99, 8, path + "/x", [0, 0], "split"))
        # 6 shards for the model's 4 parameters: the pieces serve them all
        six = run_ranks(run, 1, args=("server", 99, 8, path + "/6", [0] * 6, "split"))
        first = run_ranks(run, 1, args=("server", 4, 8, path, [0, 0], "split"))
        resumed = run_ranks(run, 1, args=("server", 4, 8, path, [0, 0], "split"))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    steps = first[0] + resumed[0]
    assert [s for s, _ in steps] == [s for s, _ in full[0]] == [s for s, _ in plain[0]]
    assert steps[-1][0] == 8
    assert [s for s, _ in six[0]] == [s for s, _ in plain[0]]
    for run_ in (steps, full[0], six[0]):
        for (_, got), (_, ref) in zip(run_, plain[0], strict=True):
            assert all(torch.equal(g, p) for g, p in zip(got, ref, strict=True))
