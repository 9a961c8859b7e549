"""Read-ahead (``sync/read_ahead.py``) on the state machines, without transport.

A sharded worker pushes every shard with ``ahead`` (shard 0 to the chief), then asks the chief
for a token naming its push to shard 0; a shard answers a push once it applied the update the
push could join; when the token comes, the shards still holding the push are released, and a
shard whose answer is older than the token is read again.  Checked against the single server
(TF's protocol, push and token in one request) on the same arrival order, and every value a
worker loads against the shard's own history: it must be the shard's variables at some step at
or after the worker's token, as a TF worker's read after its token sees.
"""

from __future__ import annotations

import time

import pytest
import torch

from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.common.tokens import init_tokens
from gradfleet.distributed.sync.layout.assignment import round_robin
from gradfleet.distributed.sync.server.chief import SyncChief
from gradfleet.distributed.sync.server.read_ahead import Held, HeldPushes
from gradfleet.distributed.sync.server.shards import Shard, ShardServer
from gradfleet.distributed.sync.worker.shard_clients import push_data
from tests.distributed.sync.test_sync_replicas import FakeReply, serve

from .test_sync_shards import F64, Cluster, _model_opt, random_job
from .test_sync_shards import _drive as _ref_drive


class CopyingReply(FakeReply):
    """Keeps copies of the tensors it is sent, as the transport copies them before sending."""

    def send(self, payload, share=None):
        self.payload = {
            k: [t.detach().clone() for t in v] if k == "params" else v for k, v in payload.items()
        }


class AheadCluster:
    """Workers driving a chief + shard servers with read-ahead, in script order."""

    def __init__(self, make_opt, R, N, num_tokens, shards, last_step=None, withhold=False):
        opt = make_opt()
        params = [p for g in opt.param_groups for p in g["params"]]
        self.count = len(params)
        self.parts = round_robin(self.count, shards)
        # ``withhold``: a push its shard is known to drop goes without gradients (push_data)
        self.withhold, self.withheld = withhold, 0
        self.shapes = [[tuple(params[i].shape) for i in part] for part in self.parts]
        tokens = init_tokens(num_tokens, R, N)
        job = Job(R, N, "shared", tokens, timeout=10, last_step=last_step)
        self.chief = SyncChief(opt, job, indices=self.parts[0], num_shards=shards)
        self.shards = [
            ShardServer(k, Shard(make_opt(), self.parts[k], job), job) for k in range(1, shards)
        ]
        self.local = [0] * N
        self.versions = [[0] * shards for _ in range(N)]
        self.seq = [0] * N
        self.pending: list[dict | None] = [None] * N
        self.seen: list[tuple[int, int, int]] = []  # (worker's token, shard, version loaded)
        self.history = [{0: self._params(k)} for k in range(shards)]
        self.releases = 0

    def _server(self, k):
        return self.chief if k == 0 else self.shards[k - 1]

    def _params(self, k):
        server = self._server(k)
        params = server.params if k == 0 else server.shard.params
        return [p.detach().clone() for p in params]

    def _step_of(self, k):
        return self.chief.shard.step if k == 0 else self.shards[k - 1].shard.step

    def _serve(self, k, msg, reply=None):
        reply = CopyingReply() if reply is None else reply
        serve(self._server(k), msg, reply, perform=self._applied)
        self._record()
        return reply

    def _applied(self, effect):
        serve(self.chief, {"op": "applied", "shard": effect.shard, "step": effect.step})

    def _record(self):
        for k, hist in enumerate(self.history):
            hist.setdefault(self._step_of(k), self._params(k))

    def step(self, w, grads):
        """Push to shard 0, ask for the token, push to the other shards (as ``ReadAheadLinks``)."""
        pushes, token = {}, CopyingReply()
        for k in range(len(self.history)):
            self.seq[w] += 1
            part = [grads[i] for i in self.parts[k]]
            data = {"grads": part}
            if self.withhold:
                data = push_data(self.local[w], self.versions[w][k], part, self.shapes[k])
                self.withheld += "withheld" in data
            msg = {
                "op": "push", "worker": w, "tag": self.local[w], "inc": "i", "seq": self.seq[w],
                **data, "ahead": self.versions[w][k],
            }  # fmt: skip
            pushes[k] = (self.seq[w], self._serve(k, msg))
            if k == 0:
                ask = {
                    "op": "step", "worker": w, "tag": self.local[w], "version": -1,
                    "values": False, "after_inc": "i", "after_seq": self.seq[w],
                }  # fmt: skip
                self._serve(0, ask, token)
        self.pending[w] = {"pushes": pushes, "token": token, "tag": self.local[w]}

    def ready(self, w):
        return self.pending[w] is not None and self.pending[w]["token"].payload is not None

    def finish(self, w):
        """Release what is still held, read again what is older than the token."""
        pending, self.pending[w] = self.pending[w], None
        token = pending["token"].payload
        for k, (seq, reply) in pending["pushes"].items():
            if reply.payload is None:
                # ReadAheadLinks releases only on a surplus token: a later token means every
                # shard applied the update this push could join, and so answered it
                assert token["token"] <= pending["tag"], "a push held past its update"
                self.releases += 1
                msg = {"op": "release", "worker": w, "of_inc": "i", "of_seq": seq}
                self._serve(k, msg)  # answers the held push
        answers = {k: reply.payload for k, (_, reply) in pending["pushes"].items()}
        assert all(a is not None for a in answers.values()), "a released push stays held"
        for k, a in answers.items():
            version = int(a["version"])
            if version < token["token"]:
                a = self._serve(k, {"op": "read", "worker": w, "version": -1}).payload
                version = int(a["version"])
            if "params" in a:
                self.seen.append((token["token"], k, version))
                for got, want in zip(a["params"], self.history[k][version], strict=True):
                    assert torch.equal(got, want), "values are not the shard's at that step"
            self.versions[w][k] = version
        self.local[w] = token["token"]
        return bool(token["accepted"]) and all(bool(a["accepted"]) for a in answers.values())

    def values(self):
        out = [None] * self.count
        for k in range(len(self.history)):
            for i, p in zip(self.parts[k], self._params(k), strict=True):
                out[i] = p
        return out


def _drive(cluster, schedule, grads_of, N):
    accepted = []
    for w in schedule:
        if cluster.pending[w] is None:
            cluster.step(w, grads_of(w, cluster.local[w]))
        elif cluster.ready(w):
            accepted.append((w, cluster.finish(w)))
    return accepted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("withhold", [False, True])
@pytest.mark.parametrize("seed", range(16))
def test_random_schedules_equal_the_single_server(seed, withhold):
    """Same arrival order (backups, N < R, initial and surplus tokens, stale drops,
    last_step): the same updates, acceptances, local steps, counters and variables, bit for
    bit, as one server; every value a worker loads is its shard's at a step no older than its
    token.  ``withhold``: pushes a worker knows stale go without their gradients."""
    N, R, tokens, kind, schedule, last_step, grads_of = random_job(seed, 240)
    ref = Cluster(_model_opt(kind), R, N, tokens, 0, last_step)
    ref_accepted = _ref_drive(ref, schedule, grads_of, N)
    for shards in (2, 3):
        ahead = AheadCluster(_model_opt(kind), R, N, tokens, shards, last_step, withhold)
        accepted = _drive(ahead, schedule, grads_of, N)
        assert ahead.chief.global_step == ref.chief.global_step
        assert accepted == ref_accepted and ahead.local == ref.local
        for got, want in zip(ahead.values(), ref.values(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert all(version >= token for token, _, version in ahead.seen)
        stats = [ahead.chief.aggregator.stats] + [s.shard.aggregator.stats for s in ahead.shards]
        assert all(st == ref.chief.aggregator.stats for st in stats)


def test_the_random_schedules_withhold_pushes():
    """The schedules above do exercise withholding: with backup workers and surplus tokens,
    workers see shards past their tag before they push (the count is deterministic)."""
    withheld = 0
    for seed in range(16):
        N, R, tokens, kind, schedule, last_step, grads_of = random_job(seed, 240)
        ahead = AheadCluster(_model_opt(kind), R, N, tokens, 3, last_step, withhold=True)
        _drive(ahead, schedule, grads_of, N)
        withheld += ahead.withheld
    assert withheld > 20


def test_release_lets_a_lone_worker_give_two_gradients_to_one_update():
    """R = N = 2 with TF's initial tokens and worker 1 never pushing: a TF worker takes an
    initial token, reads, and pushes a second gradient to the same update.  Holding its push
    until that update would wait for itself; the release answers it with the current values."""
    make = _model_opt("sgd")
    shapes = [tuple(p.shape) for g in make().param_groups for p in g["params"]]

    def grads_of(k, tag):
        gen = torch.Generator().manual_seed(7 + tag)
        return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]

    ahead, ref = AheadCluster(make, 2, 2, -1, 2), Cluster(make, 2, 2, -1, 0)
    ahead.step(0, grads_of(0, 0))
    assert ahead.ready(0)  # an initial token at once
    assert all(r.payload is None for _, r in ahead.pending[0]["pushes"].values())  # held
    ahead.finish(0)
    assert ahead.releases == 2 and ahead.chief.global_step == 0
    schedule = [0] * 12
    _drive(ahead, schedule, grads_of, 2)
    _ref_drive(ref, [0] * 2 + schedule, grads_of, 2)
    assert ahead.chief.global_step == ref.chief.global_step >= 3
    for got, want in zip(ahead.values(), ref.values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_token_request_waits_for_the_push_it_names():
    """The token request overtook its push (control travels apart from tensors): the chief
    answers it only once that push is in, as TF dequeues a token after its push."""
    make = _model_opt("sgd")
    chief = SyncChief(make(), Job(1, 1, "shared", 1, timeout=10), indices=[0, 1], num_shards=2)
    ask = {"op": "step", "worker": 0, "tag": 0, "version": -1, "values": False,
           "after_inc": "i", "after_seq": 5}  # fmt: skip
    token = serve(chief, ask)
    assert token.payload is None
    grads = [torch.ones(2, dtype=F64), torch.ones(3, 2, dtype=F64)]
    push = {"op": "push", "worker": 0, "tag": 0, "inc": "i", "seq": 4, "grads": grads, "ahead": 0}
    serve(chief, push)
    assert token.payload is None  # an earlier push of that worker is not the one named
    serve(chief, dict(push, seq=5))
    assert token.payload is not None and token.payload["token"] == 0
    assert "params" not in token.payload  # values=False: the push's answer brings them


def test_a_token_request_waiting_for_its_push_fails_when_the_chief_stops():
    """The chief stops on a bug (its probe's) while a token request waits for the push it
    names: the request is answered with the bug, at once (it waited for the job's timeout)."""
    make = _model_opt("sgd")
    chief = SyncChief(make(), Job(1, 1, "shared", 1, timeout=10), indices=[0, 1], num_shards=2)
    ask = {"op": "step", "worker": 0, "tag": 0, "version": -1, "values": False,
           "after_inc": "i", "after_seq": 5}  # fmt: skip
    token = serve(chief, ask)
    assert token.payload is None  # parked: its push is on its way
    answers = chief.fail("KeyError", "the chief's probe raised KeyError: 'bug'")
    assert [a.payload for a in answers] == [
        {"error": "KeyError", "message": "the chief's probe raised KeyError: 'bug'"}
    ]
    assert chief.fail("KeyError", "again") == []  # answered once


def test_a_push_that_a_token_request_follows_keeps_its_workers_place_in_line():
    """R = N = 2, no initial tokens, two shards.  Worker 1's push to shard 0 is in, its token
    request not yet, when the update completes: one of its 2 tokens is kept for worker 1, and
    worker 0's next request (its next step, as fast as it likes) waits for the next update
    instead of taking it.  Without the place in line the run leaves lockstep: worker 0 takes
    both tokens, and worker 1 waits for an update that needs its own next gradient."""
    make = _model_opt("sgd")
    chief = SyncChief(make(), Job(2, 2, "shared", 0, timeout=10), indices=[0, 1], num_shards=2)
    grads = [torch.ones(2, dtype=F64), torch.ones(3, 2, dtype=F64)]

    def push(w, seq, tag):
        msg = {"op": "push", "worker": w, "tag": tag, "inc": f"i{w}", "seq": seq,
               "grads": grads, "ahead": 0, "token_follows": True}  # fmt: skip
        return serve(chief, msg)

    def ask(w, seq, tag):
        msg = {"op": "step", "worker": w, "tag": tag, "version": -1, "values": False,
               "after_inc": f"i{w}", "after_seq": seq}  # fmt: skip
        return serve(chief, msg)

    push(0, 1, 0)
    first = ask(0, 1, 0)
    push(1, 1, 0)  # worker 1's token request is still on its way
    assert first.payload is None  # shard 1 has not applied yet
    serve(chief, {"op": "applied", "shard": 1, "step": 1})
    assert chief.global_step == 1 and first.payload["token"] == 1
    push(0, 2, 1)
    second = ask(0, 2, 1)  # worker 0 at once again: no token left for it
    assert second.payload is None
    late = ask(1, 1, 0)  # worker 1's request: the token kept for it
    assert late.payload is not None and late.payload["token"] == 1
    push(1, 2, 1)
    serve(chief, {"op": "applied", "shard": 1, "step": 2})
    assert second.payload["token"] == 2


def test_a_place_in_line_never_asked_for_times_out_or_goes_back():
    """A placeholder whose worker's request never comes: past ``timeout`` its error waits for
    that request; a worker that leaves gives back a token it never asked for."""
    make = _model_opt("sgd")
    chief = SyncChief(make(), Job(1, 2, "shared", 0, timeout=10), indices=[0, 1], num_shards=2)
    grads = [torch.ones(2, dtype=F64), torch.ones(3, 2, dtype=F64)]
    push = {"op": "push", "worker": 1, "tag": 0, "inc": "i", "seq": 1, "grads": grads,
            "ahead": 0, "token_follows": True}  # fmt: skip
    serve(chief, push)
    assert chief.tick(now=time.monotonic() + 11) == []  # nobody to tell yet
    ask = {"op": "step", "worker": 1, "tag": 0, "version": -1, "values": False,
           "after_inc": "i", "after_seq": 1}  # fmt: skip
    late = serve(chief, ask)
    assert late.payload["error"] == "TimeoutError"
    assert "worker rank 1 waited" in late.payload["message"]

    chief = SyncChief(make(), Job(1, 2, "shared", 0, timeout=10), indices=[0, 1], num_shards=2)
    serve(chief, push)
    serve(chief, {"op": "applied", "shard": 1, "step": 1})  # 2 tokens: one kept for worker 1
    assert len(chief.tokens) == 1
    serve(chief, {"op": "done", "worker": 1})
    assert len(chief.tokens) == 2  # it left without asking: its token is back in the queue


def _held(worker, seq, tag, accepted=True):
    return Held(worker, ("i", seq), f"ticket {worker}/{seq}", tag, 0, accepted)


def test_held_pushes_bookkeeping():
    held = HeldPushes()
    assert held.hold(_held(0, 1, tag=3), step=3)
    assert not held.hold(_held(1, 1, tag=2), step=3)  # stale: answered at once
    assert not held.hold(_held(2, 1, tag=3, accepted=False), step=3)  # dropped: at once
    assert held.hold(_held(2, 2, tag=3), step=3) and len(held) == 2
    assert held.due(3) == []
    assert held.release(0, ("i", 9)) is None and len(held) == 2  # not its push: kept
    assert [h.worker for h in held.due(4)] == [0, 2] and len(held) == 0
    # a release that overtakes its push: the push is answered on arrival, the next one held
    assert held.release(1, ("i", 7)) is None
    assert not held.hold(_held(1, 7, tag=5), step=5)
    assert held.hold(_held(1, 8, tag=5), step=5)
    assert held.drop(1) is not None and len(held) == 0


def test_push_order_takes_each_ranks_shards_in_turn_rotated_per_worker():
    from gradfleet.distributed.sync.worker.shard_clients import push_order

    assert push_order([0, 1, 2, 3], 0) == [0, 1, 2, 3]
    assert push_order([4, 5, 6, 7] * 2, 2) == [2, 3, 0, 1, 6, 7, 4, 5]
    assert push_order([4, 5, 4, 5], 1) == [1, 0, 3, 2]
    assert push_order([0, 0, 1], 0) == [0, 2, 1]
    # shard 0 (the token request follows its push) is never last
    assert push_order([2, 3], 1) == [0, 1]
    assert push_order([0, 1, 2, 3], 1) == [1, 2, 0, 3]
    # at every position of the order the workers push to different server ranks
    ranks = [4, 5, 6, 7] * 3
    orders = [push_order(ranks, w) for w in range(4)]
    for i in range(len(ranks)):
        assert len({ranks[o[i]] for o in orders}) == 4


class _RecordingClient:
    """Stands in for a :class:`MailboxClient`: records requests and receipt waits in one log."""

    log: list[tuple[str, int]] = []

    def __init__(self, address, client, timeout, name, data=True):
        self.shard, self.seq, self.inc = int(address.rsplit(":", 1)[1]), 0, "i"
        self.receipts = data

    def open_notes(self):
        pass

    def request(self, op, **fields):
        self.seq += 1
        if op == "push":
            self.log.append(("push" if fields.get("receipt") else "unpaced push", self.shard))
        elif op == "step":
            self.log.append(("token", self.shard))

    @property
    def last_request(self):
        return self.inc, self.seq

    def wait_receipt(self, seq, timeout):
        assert seq <= self.seq
        self.log.append(("receipt", self.shard))

    def begin_response(self, receive_into=None):
        return {}, dict


def _read_ahead_links(monkeypatch, ranks, worker):
    """``ReadAheadLinks`` of ``worker`` over recording clients of shards on ``ranks``."""
    from gradfleet.distributed.sync.worker import shard_clients
    from gradfleet.distributed.sync.worker.ahead_links import ReadAheadLinks
    from gradfleet.distributed.sync.worker.error_latch import ErrorLatch

    monkeypatch.setattr(shard_clients, "MailboxClient", _RecordingClient)
    _RecordingClient.log = []
    clients = shard_clients.ShardClients(
        [f"h:{k}" for k in range(len(ranks))], ranks, worker, 10.0, 4
    )
    return ReadAheadLinks(clients, lambda k: [], lambda k, v: None, ErrorLatch(worker))


def test_a_worker_keeps_one_push_per_server_rank_unconfirmed_in_push_order(monkeypatch):
    """Pacing (``pacing.Pacing``): every push goes out in ``push_order``; with several server
    ranks, before each the worker has waited for the receipts of its earlier pushes to the
    same rank, oldest first, and for no other.  Pushes under ``PACED_BYTES`` ask for no
    receipt and wait for none."""
    from gradfleet.distributed.sync.worker.pacing import PACED_BYTES
    from gradfleet.distributed.sync.worker.shard_clients import push_order

    ranks = [4, 5, 6, 7] * 3
    sync = _read_ahead_links(monkeypatch, ranks, 2)
    small = [torch.zeros(PACED_BYTES // 4 - 1)]
    sync.push(0, [small] * len(ranks), {})
    expected = [("unpaced push", k) for k in push_order(ranks, 2)]
    expected.insert(expected.index(("unpaced push", 0)) + 1, ("token", 0))
    assert _RecordingClient.log == expected
    _RecordingClient.log = []
    sync.push(1, [[torch.zeros(PACED_BYTES // 4), None]] * len(ranks), {})
    _RecordingClient.log = [e for e in _RecordingClient.log if e[0] != "token"]
    pushes = [k for what, k in _RecordingClient.log if what == "push"]
    assert pushes == push_order(ranks, 2)
    sent: list[int] = []
    confirmed: list[int] = []
    for what, k in _RecordingClient.log:
        if what == "push":
            # confirmed: exactly the earlier pushes to a rank pushed to again since (this one
            # included), so every earlier push to this shard's rank, and no other
            due = [
                j for i, j in enumerate(sent) if ranks[j] in {ranks[x] for x in [*sent[i + 1 :], k]}
            ]
            assert sorted(confirmed) == sorted(due)
            sent.append(k)
        else:
            confirmed.append(k)
    assert confirmed == [j for j in sent if j in confirmed]  # in push order, oldest first
    # the last push to each rank is not waited for
    assert len(confirmed) == len(sent) - len(set(ranks))


@pytest.mark.parametrize("worker", range(4))
def test_the_token_request_goes_out_before_a_workers_last_push(monkeypatch, worker):
    """One shard per rank: whatever the worker's turn, its token request precedes its last
    push, which the update needs, so no faster worker can take this worker's token."""
    sync = _read_ahead_links(monkeypatch, [0, 1, 2, 3], worker)
    sync.push(0, [[torch.zeros(3)]] * 4, {})
    what = [w for w, _ in _RecordingClient.log]
    assert what.count("token") == 1 and what.index("token") < len(what) - 1


# --------------------------------------------------------------------- real processes
def paced_sync_train(ctx, *args):
    """``sync_ranks.sync_train`` with every push paced (receipts over the real pairs), however
    small: the test models' pushes are far under ``PACED_BYTES``."""
    from gradfleet.distributed.sync.worker import pacing
    from tests.distributed import sync_ranks

    pacing.PACED_BYTES = 0
    return sync_ranks.sync_train(ctx, *args)


@pytest.mark.timeout(120)
def test_two_shards_per_rank_over_processes_match_the_single_server():
    """Two shards on each of ranks 0 and 1 (read-ahead, paced pushes): R = N = 3 with no initial
    tokens runs in lockstep, so Adam's 12 updates equal rank 0 alone serving (up to the order
    of the 3-term sums)."""
    from gradfleet.distributed.testing import run_ranks
    from tests.distributed import sync_ranks

    args = (3, 3, 12, "server", None, 0.0, 4, None, 20.0)
    one = run_ranks(sync_ranks.sync_train, 3, args=(*args, None, 0, True), timeout=90)
    paced = run_ranks(paced_sync_train, 3, args=(*args, [0, 1, 0, 1], 0, True), timeout=90)
    for r in range(3):
        assert one[r]["global_step"] == paced[r]["global_step"] == 12
        assert paced[r]["counters"] == {"accepted": 12, "dropped": 0}
        for a, b in zip(one[r]["params"], paced[r]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(120)
def test_two_shards_per_rank_with_a_backup_worker_train_to_the_same_variables():
    """R = 3 of N = 4, two shards on each of ranks 1 and 3, pushes paced: stale pushes, surplus
    tokens and re-reads over real links; everyone reaches the step and ends on the same
    variables."""
    from gradfleet.distributed.testing import run_ranks

    args = (3, 4, 15, "server", None, 0.0, 4, None, 20.0, [1, 3, 1, 3])
    out = run_ranks(paced_sync_train, 4, args=args, timeout=90)
    for r in range(4):
        assert out[r]["global_step"] == 15
        for a, b in zip(out[r]["params"], out[0]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
