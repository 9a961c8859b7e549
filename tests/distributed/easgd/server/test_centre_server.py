"""The asynchronous EASGD centre as a state machine, without transport: TF's read of the centre
and its ``assign_add`` are separate steps, so other workers' exchanges may fall between them
(reference 3.4: the read/modify is not atomic across workers)."""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed.easgd.server.centre_server import CentreServer


def hello(server: CentreServer, worker: int) -> list[torch.Tensor]:
    shapes = [list(c.shape) for c in server.centre]
    (answer,) = server.handle({"op": "hello", "worker": worker, "shapes": shapes}, worker)
    return [c.clone() for c in answer.payload["centre"]]


def read(server: CentreServer, worker: int) -> list[torch.Tensor]:
    (answer,) = server.handle({"op": "exchange_read", "worker": worker}, worker)
    assert answer.ticket == worker
    return [c.clone() for c in answer.payload["centre"]]


def add(server: CentreServer, worker: int, x: list[torch.Tensor], alpha: float) -> None:
    msg = {"op": "exchange_add", "worker": worker, "alpha": alpha, "params": x}
    (answer,) = server.handle(msg, worker)
    assert answer.payload == {}


def test_interleaved_exchanges_add_each_workers_pull_from_the_centre_it_read():
    torch.manual_seed(0)
    c0 = [torch.randn(3, 2, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    xs = [[torch.randn_like(c) for c in c0] for _ in range(3)]
    server = CentreServer(c0, num_worker=3, timeout=10.0)
    for w in range(3):
        hello(server, w)
    alpha = 0.3
    # workers 0 and 1 both read c0; worker 0 adds; worker 2 reads after that add; then 1, 2 add
    r0, r1 = read(server, 0), read(server, 1)
    add(server, 0, xs[0], alpha)
    r2 = read(server, 2)
    add(server, 1, xs[1], alpha)
    add(server, 2, xs[2], alpha)
    # float64 reference written from the spec: c += alpha (x_w - c_read_w), in add order
    after0 = [c + alpha * (x - c) for c, x in zip(c0, xs[0], strict=True)]
    want = [
        a + alpha * (x1 - c) + alpha * (x2 - a)
        for c, a, x1, x2 in zip(c0, after0, xs[1], xs[2], strict=True)
    ]
    eps = torch.finfo(torch.float64).eps  # one add and one multiply-add per element
    for got, c, a in zip(zip(r0, r1, r2, strict=True), c0, after0, strict=True):
        assert torch.equal(got[0], c) and torch.equal(got[1], c)
        torch.testing.assert_close(got[2], a, rtol=0, atol=4 * eps)
    for got, w in zip(server.centre, want, strict=True):
        torch.testing.assert_close(got, w, rtol=0, atol=8 * eps)
    assert server.exchanges == {0: 1, 1: 1, 2: 1}


def test_the_read_answered_is_not_moved_by_later_adds():
    server = CentreServer([torch.zeros(4)], num_worker=2, timeout=10.0)
    hello(server, 0)
    hello(server, 1)
    (answer,) = server.handle({"op": "exchange_read", "worker": 0}, 0)
    read(server, 1)
    add(server, 1, [torch.ones(4)], 0.5)
    # worker 0's answer still holds the centre it read (the hosting code may send it later)
    assert torch.equal(answer.payload["centre"][0], torch.zeros(4))
    assert torch.equal(server.centre[0], torch.full((4,), 0.5))


def test_an_add_without_a_read_is_refused_and_changes_nothing():
    server = CentreServer([torch.ones(2)], num_worker=1, timeout=10.0)
    hello(server, 0)
    with pytest.raises(ValueError, match="rank 0 sent exchange_add without an exchange_read"):
        add(server, 0, [torch.zeros(2)], 0.5)
    assert torch.equal(server.centre[0], torch.ones(2)) and server.exchanges == {}
    # a worker that restarts between its read and its add starts over
    read(server, 0)
    hello(server, 0)
    with pytest.raises(ValueError, match="without an exchange_read"):
        add(server, 0, [torch.zeros(2)], 0.5)
    assert torch.equal(server.centre[0], torch.ones(2))


# ---------------------------------------------------------------- exchanges sent again
def numbered(server: CentreServer, worker: int, number: int, x: list[torch.Tensor]):
    """One exchange of ``worker`` under ``number``: (the read it was answered, the add's answer)."""
    (r,) = server.handle({"op": "exchange_read", "worker": worker, "number": number}, worker)
    read_back = [c.clone() for c in r.payload["centre"]]
    msg = {"op": "exchange_add", "worker": worker, "alpha": 0.25, "params": x, "number": number}
    (a,) = server.handle(msg, worker)
    return read_back, a.payload


@pytest.mark.parametrize("cut", ["after_read", "after_add"])
def test_an_exchange_sent_again_is_applied_once(cut):
    """A replicated centre (keep_reads) applies a worker's exchange sent again under the same
    number once: after its add, the same read and no second add; after its read only, a
    fresh read and one add."""
    torch.manual_seed(1)
    c0 = [torch.randn(5, dtype=torch.float64)]
    x0, x1 = [torch.randn(5, dtype=torch.float64)], [torch.randn(5, dtype=torch.float64)]
    server = CentreServer(c0, num_worker=2, timeout=10.0, keep_reads=True)
    hello(server, 0), hello(server, 1)
    numbered(server, 1, 1, x1)
    (r,) = server.handle({"op": "exchange_read", "worker": 0, "number": 1}, 0)
    first_read = [c.clone() for c in r.payload["centre"]]
    if cut == "after_add":
        server.handle({"op": "exchange_add", "worker": 0, "alpha": 0.25, "params": x0,
                       "number": 1}, 0)  # fmt: skip
    before = [c.clone() for c in server.centre]
    read_again, answer = numbered(server, 0, 1, x0)  # the worker sends it again
    assert answer == {}
    assert server.exchanges == {0: 1, 1: 1}
    assert server.resent == ({0: 1} if cut == "after_add" else {})
    if cut == "after_add":  # applied already: the same read, the centre untouched
        assert torch.equal(read_again[0], first_read[0])
        assert torch.equal(server.centre[0], before[0])
    else:  # read only: redone from the centre as it is now, added once
        assert torch.equal(read_again[0], before[0])
        want = before[0] + 0.25 * (x0[0] - before[0])
        eps = torch.finfo(torch.float64).eps
        torch.testing.assert_close(server.centre[0], want, rtol=0, atol=4 * eps)
    numbered(server, 0, 2, x0)  # the next exchange is applied as usual
    assert server.exchanges == {0: 2, 1: 1}


def test_a_centre_without_a_standby_keeps_no_read_after_the_add():
    server = CentreServer([torch.zeros(3)], num_worker=1, timeout=10.0)
    hello(server, 0)
    numbered(server, 0, 1, [torch.ones(3)])
    assert server.reads == {}  # no model-sized copy per worker where nothing is sent again
    with pytest.raises(ValueError, match="exchange_add 2 without an exchange_read"):
        server.handle({"op": "exchange_add", "worker": 0, "alpha": 0.5,
                       "params": [torch.ones(3)], "number": 2}, 0)  # fmt: skip


def test_a_new_standby_starts_from_the_replica_state_and_then_follows_as_the_centre():
    """``replica_state`` through the wire's JSON (dict keys become strings) into an empty
    centre (``load_replica``): the same requests then give both the same answers and state,
    also for an exchange sent again whose read was kept."""
    from gradfleet.distributed.transport import wire

    centre = CentreServer([torch.tensor([1.0, 2.0])], num_worker=2, timeout=10, keep_reads=True)
    for w in (0, 1):
        hello(centre, w)
    centre.handle({"op": "exchange_read", "worker": 0, "number": 1}, 0)
    add_1 = {"op": "exchange_add", "worker": 0, "alpha": 0.5, "number": 1,
             "params": [torch.tensor([3.0, 0.0])]}  # fmt: skip
    centre.handle(add_1, 0)
    centre.handle({"op": "exchange_read", "worker": 1, "number": 1}, 1)  # its add comes later
    centre.handle({"op": "done", "worker": 0}, 0)
    skeleton, tensors = wire.split({"op": "load_replica", **centre.replica_state()})
    copy = CentreServer([torch.zeros(2)], num_worker=2, timeout=10, keep_reads=True)
    copy.handle(wire.join(wire.loads(wire.dumps(skeleton)), tensors), None)
    assert copy.members.left == {0} and copy.applied == {0: 1} and copy.exchanges == {0: 1}
    add_2 = {"op": "exchange_add", "worker": 1, "alpha": 0.5, "number": 1,
             "params": [torch.tensor([0.0, 4.0])]}  # fmt: skip
    for server in (centre, copy):
        server.handle(add_2, 1)  # worker 1's read was taken before the copy
        server.handle(add_1, 0)  # sent again: applied once already
    assert torch.equal(centre.centre[0], copy.centre[0])
    assert centre.resent == copy.resent == {0: 1} and copy.exchanges == {0: 1, 1: 1}
