"""A SyncReplicas worker's parts alone: pacing, TF's protocol (``PlainLinks``) on recording
clients, and the exchange's choice of links and its pending step.

The references: pacing against a credit simulation written here; ``PlainLinks`` against TF's
worker train op (push, then the token request carrying shard 0's gradients, then the reads);
the pending step against the same job reading in ``step()``."""

from __future__ import annotations

import random

import pytest
import torch

from gradfleet.distributed.sync.worker import shard_clients
from gradfleet.distributed.sync.worker.ahead_links import ReadAheadLinks
from gradfleet.distributed.sync.worker.pacing import IN_FLIGHT, PACED_BYTES, Pacing
from gradfleet.distributed.sync.worker.pending_step import FinishedStep, PendingStep
from gradfleet.distributed.sync.worker.plain_links import PlainLinks
from gradfleet.distributed.transport.errors import ServerUnreachable

from .test_sync_overlap import _equal, _loss, _model, _sync


class _ReceiptClient:
    def __init__(self, k: int, log: list, receipts: bool = True) -> None:
        self.k, self.log, self.receipts = k, log, receipts

    def wait_receipt(self, seq: int, timeout: float) -> None:
        self.log.append((self.k, seq))


@pytest.mark.parametrize(
    ("ranks", "local", "per_rank"),
    [
        ([4, 5, 6, 7, 4, 5, 6, 7], set(), 1),  # several server ranks: one push each
        ([0, 1, 2, 3], {0}, 1),  # over the workers, the own rank's shard in-process
        ([0, 0, 0, 0], set(), IN_FLIGHT),  # one rank holds every shard
        ([0, 1, 0, 1], {0, 2}, IN_FLIGHT),  # one rank confirms: the other is in-process
    ],
    ids=["dedicated", "over-workers", "one-rank", "one-remote-rank"],
)
@pytest.mark.parametrize("seed", range(3))
def test_pacing_keeps_fewer_than_per_rank_receipted_pushes_unconfirmed_per_server_rank(
    ranks, local, per_rank, seed
):
    """Random pushes, each asking for a receipt or not: before a push to a shard, every
    receipted push to the same server rank but the last ``per_rank - 1`` is confirmed,
    oldest first; pushes to other ranks are not waited for.  ``per_rank`` is 1 where pushes
    are confirmed by several ranks, ``IN_FLIGHT`` where by one (a simulation per rank)."""
    rng = random.Random(seed)
    waited: list[tuple[int, int]] = []
    clients = {k: _ReceiptClient(k, waited, k not in local) for k in range(len(ranks))}
    pacing = Pacing(clients, ranks, 1.0)
    assert pacing.per_rank == per_rank
    receipted: dict[int, list[tuple[int, int]]] = {r: [] for r in ranks}  # per rank, in order
    confirmed: list[tuple[int, int]] = []
    for seq in range(1, 40):
        k = rng.randrange(len(ranks))
        pacing.wait_turn(k)
        mine = receipted[ranks[k]]
        while len(mine) >= per_rank:  # the simulation: the oldest of this rank's
            confirmed.append(mine.pop(0))
        assert waited == confirmed
        if k not in local and rng.random() < 0.6:
            pacing.sent(k, seq)
            mine.append((k, seq))
    pacing.clear()  # the step is over: its receipts are not waited for
    before = list(waited)
    for k in range(len(ranks)):
        pacing.wait_turn(k)
    assert waited == before


def test_pacing_asks_a_receipt_for_large_pushes_only():
    """``PACED_BYTES`` of gradients or more, on a link that confirms arrivals, with gradients
    (a withheld push carries none)."""
    clients = {0: _ReceiptClient(0, []), 1: _ReceiptClient(1, [], receipts=False)}
    pacing = Pacing(clients, [4, 5], 1.0)
    big = [torch.zeros(PACED_BYTES // 8, dtype=torch.float64), None]
    small = [torch.zeros(PACED_BYTES // 4 - 1)]
    assert pacing.wants_receipt(0, {"grads": big})
    assert not pacing.wants_receipt(0, {"grads": small})
    assert pacing.wants_receipt(0, {"grads": small + [torch.zeros(1)]})
    assert not pacing.wants_receipt(0, {"withheld": True})
    assert not pacing.wants_receipt(1, {"grads": big})


class _Client:
    """A ``MailboxClient`` of shard ``k`` (from its address ``h:k``): records every request
    in one log and answers from a script."""

    log: list[tuple[int, str, dict]] = []
    script: dict[int, list[dict]] = {}

    def __init__(self, address, client, timeout, name, data=True):
        self.k, self.bytes_out = int(address.rsplit(":", 1)[1]), 0

    def request(self, op, **fields):
        self.log.append((self.k, op, fields))

    def response(self):
        return self.script[self.k].pop(0)

    def begin_response(self, receive_into=None):
        reply = self.script[self.k].pop(0)
        control = {key: v for key, v in reply.items() if key != "params"}
        return control, lambda: reply


def _plain(monkeypatch, shards: int, script: dict[int, list[dict]]):
    monkeypatch.setattr(shard_clients, "MailboxClient", _Client)
    _Client.log, _Client.script = [], script
    clients = shard_clients.ShardClients([f"h:{k}" for k in range(shards)], [0] * shards, 0, 5.0, 2)
    clients.versions = dict.fromkeys(range(shards), 2)
    loaded: dict[int, list] = {}
    links = PlainLinks(clients, lambda k: [], lambda k, values: loaded.__setitem__(k, values))
    return links, loaded


def test_plain_links_push_then_ask_for_the_token_with_shard_0s_gradients(monkeypatch):
    """TF's worker train op, one server: the token request carries the gradients, tagged
    with ``local_step``, and the version held; its answer's values are loaded."""
    new = [torch.ones(2)]
    script = {0: [{"token": 3, "accepted": True, "global_step": 3, "version": 3, "params": new}]}
    links, loaded = _plain(monkeypatch, 1, script)
    grads = [torch.full((2,), 0.5)]
    assert links.push(2, [grads], {"r": 1}) is True
    ((k, op, fields),) = _Client.log
    assert (k, op, fields["tag"], fields["version"], fields["r"]) == (0, "step", 2, 2, 1)
    assert fields["grads"] == grads
    step = links.token_and_reads(2)
    assert isinstance(step, FinishedStep) and step.left == []
    assert step.finish()["token"] == 3 and step.finish()["accepted"] is True
    assert loaded == {0: new} and links.clients.versions[0] == 3
    assert len(_Client.log) == 1  # nothing more on the wire
    links.check_idle("stats")  # every answer read


def test_plain_links_chief_lost_while_its_values_travel_is_the_chiefs_loss(monkeypatch):
    """The token's control part came, and the chief was lost while the values it sent with it
    were on the wire: the step raises the chief's ``ServerUnreachable`` (the exchange then
    moves to its standby and sends the step again), not an error of its own bookkeeping."""
    lost = ServerUnreachable("server rank 0 at h:0 closed the connection during 'step'")

    def cut():
        raise lost

    links, loaded = _plain(monkeypatch, 1, {0: []})
    links.push(2, [[torch.ones(2)]], {})
    control = {"token": 3, "accepted": True, "global_step": 3, "version": 3}
    monkeypatch.setattr(_Client, "begin_response", lambda self, receive_into=None: (control, cut))
    with pytest.raises(ServerUnreachable) as raised:
        links.token_and_reads(2)
    assert raised.value is lost and loaded == {}


def test_plain_links_bad_input_goes_to_every_shard_then_the_token_without_gradients(monkeypatch):
    """Sharded, a non-finite gradient is pushed tagged -1 to the shards 1.. and to the
    chief (each reports its own); the token request carries no gradients, and the step seen
    is the chief's unless every shard had applied a later one."""
    script = {
        0: [{"accepted": False}, {"token": 5, "accepted": False, "global_step": 4, "version": 5}],
        1: [{"accepted": False, "step": 6}, {"version": 6, "params": [torch.zeros(1)]}],
        2: [{"accepted": False, "step": 5}, {"version": 2}],
    }
    links, loaded = _plain(monkeypatch, 3, script)
    parts = [[torch.tensor([float("nan")])], [torch.zeros(1)], [torch.zeros(1)]]
    assert links.push(-1, parts, {}) is False
    assert [(k, op, f["tag"]) for k, op, f in _Client.log] == [
        (1, "push", -1), (2, "push", -1), (0, "push", -1),
    ]  # fmt: skip
    result = links.token_and_reads(-1).finish()
    k, op, fields = _Client.log[3]
    assert (k, op, "grads" in fields) == (0, "step", False)
    assert [(k, op) for k, op, _ in _Client.log[4:]] == [(1, "read"), (2, "read")]
    assert result["accepted"] is False
    assert result["global_step"] == max(4, min(5, 6, 5))
    assert set(loaded) == {1} and links.clients.versions == {0: 5, 1: 6, 2: 2}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shards", [1, 2])
def test_the_exchange_chooses_its_links_once(shards):
    """One server: TF's protocol; several shards: reading ahead (then reads may stream)."""
    opt = _sync(_model(), False, shards)
    try:
        kind = PlainLinks if shards == 1 else ReadAheadLinks
        assert type(opt.exchange.links) is kind
        assert opt.exchange.reads_ahead is (shards > 1)
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_a_streamed_step_is_held_by_the_exchange_and_waited_on_per_shard():
    """The exchange holds the step's ``PendingStep``; waiting for one shard leaves the other
    pending and the verdict open; once both are in, the books hold what a read in ``step()``
    gives (same values, same verdict)."""
    reference = _model()
    ref = _sync(reference, False, 2, shard_assignment="round_robin")
    model = _model()
    opt = _sync(model, False, 2, shard_assignment="round_robin")
    try:
        opt.stream_reads(model)
        for m, o in ((reference, ref), (model, opt)):
            _loss(m, 0).backward()
            o.step()
        step = opt.exchange._pending
        assert isinstance(step, PendingStep) and sorted(step.left) == [0, 1]
        assert opt.reads_pending and opt.counters == {"accepted": 0, "dropped": 0}
        opt.exchange.wait_reads([1])
        assert step.left == [0] and opt.reads_pending
        assert opt.counters == {"accepted": 0, "dropped": 0}
        opt.exchange.wait_reads([0])
        assert not opt.reads_pending and opt.exchange._pending is None
        assert (opt.counters, opt.global_step) == (ref.counters, ref.global_step)
        assert opt.last_gradient_accepted is ref.last_gradient_accepted is True
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            _equal(a.detach(), b.detach())
    finally:
        opt.close()
        ref.close()
