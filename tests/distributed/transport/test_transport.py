"""The transport layer alone: wire format (JSON control + packed tensors), gloo pair links,
the request/reply mailbox with tensors on the data plane, rejoin, errors, dead servers."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradfleet.distributed.hosting.hosted_server import probe
from gradfleet.distributed.transport import (
    JobEnded,
    LocalLink,
    MailboxClient,
    MailboxServer,
    Packer,
    PairLink,
    ServerClosed,
    ServerUnreachable,
    join,
    local_address_towards,
    split,
)
from gradfleet.distributed.transport.pairs import DEVICES_PER_PROCESS
from gradfleet.distributed.transport.pairs import STANDING_BYTES as PAIR_STANDING_BYTES
from gradfleet.distributed.transport.wire import ALIGN, DIRECT, dumps, layout, views

pytestmark = pytest.mark.timeout(120)
# A client in the server's process normally gets an in-process link; False forces the gloo
# pair a client in another process gets, so both data planes run the same request tests.
IN_PROCESS = pytest.mark.parametrize("in_process", [False, True], ids=["pair", "local"])

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex128,
    torch.int64,
    torch.int8,
    torch.bool,
]


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(3, 5, generator=g).to(d) for d in DTYPES]
    out.append(torch.empty(0, 4))
    out.append(torch.tensor(2.5, dtype=torch.float64))
    return out


def test_split_join_roundtrip_nested_and_sparse():
    sparse = torch.sparse_coo_tensor([[0, 2, 2]], [[1.0], [2.0], [3.0]], (4, 1))
    msg = {"a": 1, "grads": [torch.ones(2), None, sparse], "nested": {3: [torch.zeros(1), "x"]}}
    skeleton, tensors = split(msg)
    json.dumps(skeleton)  # the control part is plain JSON: nothing pickled
    assert len(tensors) == 4  # dense, sparse indices, sparse values, nested dense
    back = join(skeleton, tensors)
    assert back["a"] == 1 and back["grads"][1] is None and back["nested"]["3"][1] == "x"
    torch.testing.assert_close(back["grads"][2].to_dense(), sparse.coalesce().to_dense())
    assert back["grads"][2].is_sparse


def test_pack_unpack_every_dtype_aligned_views():
    tensors = sample_tensors()
    spec = layout(tensors)
    assert all(offset % ALIGN == 0 for _, _, offset, _ in spec["entries"])
    sent_spec, messages = Packer().pack(tensors)
    assert sent_spec == spec and len(messages) == 1 and messages[0].dtype == torch.uint8
    inbox = Packer()
    targets = inbox.receive(json.loads(dumps(spec)))
    for dst, src in zip(targets, messages, strict=True):
        dst.copy_(src)  # what the pair link's recv does
    for got, want in zip(inbox.unpack(spec), tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_large_tensors_go_direct_without_a_copy():
    big, small = torch.randn(DIRECT), torch.randn(10)
    spec, messages = Packer().pack([small, big, small], direct=True)
    assert [e[3] for e in spec["entries"]] == [False, True, False]
    assert len(messages) == 2 and messages[1].data_ptr() == big.data_ptr()  # zero copy
    inbox = Packer()
    for dst, src in zip(inbox.receive(spec), messages, strict=True):
        dst.copy_(src)
    got = inbox.unpack(spec)
    assert torch.equal(got[1], big) and torch.equal(got[0], small) and torch.equal(got[2], small)


def test_packer_buffer_is_reused_not_reallocated():
    packer = Packer()
    _, [first] = packer.pack([torch.ones(1000)])
    _, [second] = packer.pack([torch.ones(10), torch.zeros(20)])
    assert second.data_ptr() == first.data_ptr()
    _, [third] = packer.pack([torch.ones(5000)])  # grows once
    assert third.numel() >= 20000


def test_unsupported_dtype_is_named():
    with pytest.raises(TypeError, match="uint16|dtype"):
        layout([torch.zeros(2, dtype=torch.uint16)])


def _store(port: int = 0, master: bool = True):
    return dist.TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False)


def test_pair_link_moves_raw_buffers_both_ways():
    store = _store()
    links = {}

    def make(rank):
        own = store if rank == 0 else store.clone()  # one store connection per side
        links[rank] = PairLink(own, "gf/pair/t/0", rank, "127.0.0.1", 20.0)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    payload = torch.arange(1 << 16, dtype=torch.float32).view(torch.uint8)
    links[1].send([payload, payload[:10]])
    got, head = torch.empty_like(payload), torch.empty(10, dtype=torch.uint8)
    links[0].recv([got, head])
    links[1].wait_sent()
    assert torch.equal(got, payload) and torch.equal(head, payload[:10])
    assert links[1].bytes_sent == payload.numel() + 10
    links[0].send([payload.flip(0).contiguous()])
    links[1].recv([got])
    assert torch.equal(got, payload.flip(0))


def _pair_links(name: str) -> dict[int, PairLink]:
    store = _store()
    links: dict[int, PairLink] = {}

    def make(rank):
        own = store if rank == 0 else store.clone()
        links[rank] = PairLink(own, f"gf/pair/{name}/0", rank, "127.0.0.1", 20.0)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    return links


def _sent_within(link: PairLink, seconds: float) -> bool:
    """Does ``link``'s last send complete within ``seconds`` (no receive posted meanwhile)?"""
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (link.wait_sent(), done.set()), daemon=True)
    waiter.start()
    return done.wait(seconds)


def test_small_message_travels_before_its_receive_is_asked_for():
    """Gloo sends a message only once its receive is posted.  After a small message the
    receiver posts the next one of the same sizes at once (a standing receive), so that one
    leaves as soon as it is sent; a message of other sizes still waits for its receive."""
    links = _pair_links("standing")
    small = torch.arange(1000, dtype=torch.float32).view(torch.uint8)
    got = torch.empty_like(small)
    links[1].send([small])
    assert not _sent_within(links[1], 0.5)  # the first: nothing posted yet
    links[0].recv([got])
    links[1].wait_sent()
    assert torch.equal(got, small)
    links[1].send([small + 1])  # same sizes: the standing receive takes it
    assert _sent_within(links[1], 10.0)
    links[0].recv([got])
    assert torch.equal(got, small + 1)
    other = torch.ones(10, dtype=torch.uint8)
    links[1].send([other])  # other sizes: waits for its own receive, as before
    assert not _sent_within(links[1], 0.5)
    head = torch.empty(10, dtype=torch.uint8)
    links[0].recv([head])
    links[1].wait_sent()
    assert torch.equal(head, other)
    large = torch.zeros(PAIR_STANDING_BYTES + 16, dtype=torch.uint8)
    links[1].send([large])  # too large to post ahead
    assert not _sent_within(links[1], 0.5)
    links[0].recv([torch.empty_like(large)])
    links[1].wait_sent()
    links[1].send([large])
    assert not _sent_within(links[1], 0.5)
    links[0].recv([torch.empty_like(large)])
    links[1].wait_sent()
    for link in links.values():  # with standing receives still posted
        link.close()


def test_standing_receives_keep_every_message_in_order_whatever_the_sizes():
    """Both ends decide alone which receive a message meets: any sequence of sizes (repeats,
    alternations, several messages, messages too large to post ahead) arrives intact, through
    ``begin_receive`` with a layout as the mailbox uses it, both ways."""
    links = _pair_links("standing-order")
    g = torch.Generator().manual_seed(0)
    big = (PAIR_STANDING_BYTES // 4 + 1,)
    shapes = [[(100,)], [(100,)], [(7,), (300,)], [(100,)], [(7,), (300,)], [(7,), (300,)],
              [big], [(100,)], [(100,)], [(20_000,)], [(100,)]]  # fmt: skip
    inboxes = {0: Packer(), 1: Packer()}
    for n, sizes in enumerate(shapes * 3):
        src, dst = n % 2, 1 - n % 2  # both directions, each with its own state
        tensors = [torch.randn(*s, generator=g) for s in sizes]
        spec, messages = Packer().pack(tensors, direct=True, copy=True)
        finish = links[dst].begin_receive(spec, inboxes[dst])
        links[src].send(messages)
        got = finish()
        links[src].wait_sent()
        assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True)), n


def _gloo_loop_threads() -> int:
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == "gloo_tcp_loop"
        except FileNotFoundError:  # a thread that ended while we looked
            pass
    return count


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_pair_links_of_a_process_share_its_gloo_devices():
    """A process's pair links take turns on ``DEVICES_PER_PROCESS`` gloo devices (one
    event-loop thread each), not a device per link (six loop threads for a rank serving three
    workers and pushing to three shards)."""
    store = _store()
    before = _gloo_loop_threads()
    links: dict[tuple[int, int], PairLink] = {}

    def make(pair, rank):
        own = store if rank == 0 else store.clone()
        links[pair, rank] = PairLink(own, f"gf/pair/share/{pair}", rank, "127.0.0.1", 20.0)

    threads = [threading.Thread(target=make, args=(p, r)) for p in range(3) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert len(links) == 6
    assert _gloo_loop_threads() - before <= DEVICES_PER_PROCESS  # not one per link (6)
    for pair in range(3):  # and each pair still carries its own messages
        payload = torch.full((1 << 16,), pair, dtype=torch.uint8)
        links[pair, 1].send([payload])
        got = torch.empty_like(payload)
        links[pair, 0].recv([got])
        links[pair, 1].wait_sent()
        assert torch.equal(got, payload)


def test_local_address_for_loopback_and_override(monkeypatch):
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    monkeypatch.setenv("GRADFLEET_DATA_HOST", "127.0.0.5")
    assert local_address_towards("10.1.2.3") == "127.0.0.5"


class Echo:
    """Replies 2 * x; ``hold`` defers the reply until the next request ("release")."""

    def __init__(self):
        self.held = []

    def handle(self, msg, reply):
        if msg["op"] == "double":
            reply.send({"y": [None if t is None else 2 * t for t in msg["x"]], "n": msg["n"]})
        elif msg["op"] == "hold":
            self.held.append(reply)
        elif msg["op"] == "release":
            for r in self.held:
                r.send({"y": [torch.ones(3)]})
            self.held = []
            reply.send({})
        else:
            raise ValueError(f"unknown op {msg['op']!r}")


@IN_PROCESS
def test_mailbox_tensors_on_the_pair_control_tiny_and_no_torch_save(monkeypatch, in_process):
    server = MailboxServer(Echo().handle)
    try:
        client = MailboxClient(server.address, "w0", 20.0, "server rank 0", in_process=in_process)
        assert isinstance(client.link, LocalLink if in_process else PairLink)

        def forbidden(*a, **k):
            raise AssertionError("torch.save used by the transport")

        monkeypatch.setattr(torch, "save", forbidden)
        x = [torch.randn(1000, 100), None, torch.arange(5)]
        for _ in range(3):
            reply = client.call("double", x=x, n=7)
        assert reply["n"] == 7 and reply["y"][1] is None
        torch.testing.assert_close(reply["y"][0], 2 * x[0])
        assert torch.equal(reply["y"][2], 2 * x[2])
        assert client.link is not None
        tensor_bytes = 3 * (400_000 + 48)  # x[0] direct, x[2] packed (40 bytes padded)
        assert client.link.bytes_sent == tensor_bytes  # the tensors went on the pair group
        assert client.bytes_out - tensor_bytes < 3 * 400  # the store saw only small JSON
        with pytest.raises(ValueError, match="unknown op 'nope'"):
            client.call("nope")
    finally:
        server.close()


@IN_PROCESS
def test_restarted_client_gets_a_new_pair_and_ignores_old_replies(in_process):
    echo = Echo()
    server = MailboxServer(echo.handle)
    try:
        old = MailboxClient(server.address, "w1", 20.0, "server rank 0", in_process=in_process)
        old.request("hold")  # the old incarnation "dies" while its reply is pending
        new = MailboxClient(server.address, "w1", 20.0, "server rank 0", in_process=in_process)
        other = MailboxClient(server.address, "w2", 20.0, "server rank 0", in_process=False)
        other.call("release")  # the old reply goes nowhere (its pair was replaced)
        x = torch.randn(64)
        torch.testing.assert_close(new.call("double", x=[x], n=1)["y"][0], 2 * x)
        assert server.peers["w1"].incarnation == new.inc != old.inc
    finally:
        server.close()


@IN_PROCESS
def test_dead_server_raises_server_unreachable_naming_it(in_process):
    server = MailboxServer(Echo().handle)
    client = MailboxClient(server.address, "w0", 30.0, "server rank 7", in_process=in_process)
    server.close()
    start = time.monotonic()
    with pytest.raises(ServerUnreachable, match="server rank 7"):
        client.call("double", x=[torch.ones(4)], n=0, timeout=2.0)
    assert time.monotonic() - start < 10
    with pytest.raises(ServerUnreachable, match="server rank 7"):
        MailboxClient("127.0.0.1:1", "w0", 2.0, "server rank 7")


def test_a_dead_or_closed_server_is_unreachable_at_once():
    """A store client retries a refused connection for its whole timeout (30 s here).  A
    server's address is shared only once it listens, so a refusal means it died: the client
    says so at once, naming it; so does a server that stopped serving in a process that lives
    on (its store still answers)."""
    closed = MailboxServer(Echo().handle)
    closed.close()
    with socket.socket() as s:  # a port nothing listens on any more: a dead server's
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    # closed: the job ended (a process restarted too late is told so), a lost server is not
    with pytest.raises(ServerClosed, match="server rank 3 at .* stopped serving") as ended:
        MailboxClient(closed.address, "w1", 30.0, "server rank 3", in_process=False)
    assert isinstance(ended.value, ServerUnreachable) and isinstance(ended.value, JobEnded)
    with pytest.raises(ServerUnreachable, match=f"server rank 3 at {dead} .*refused") as lost:
        MailboxClient(dead, "w1", 30.0, "server rank 3")
    assert not isinstance(lost.value, JobEnded)
    with pytest.raises(ConnectionRefusedError, match="refused"):
        probe(dead, 5.0, connect_s=30.0)
    assert time.monotonic() - start < 10  # not the 30 s of a store client's retries
    live = MailboxServer(Echo().handle)
    try:  # a live server still connects, and the check costs it nothing
        client = MailboxClient(live.address, "w0", 30.0, "server rank 3", in_process=False)
        assert client.call("double", x=[torch.ones(2)], n=0)["y"][0].tolist() == [2.0, 2.0]
        probe(live.address, 5.0)()
    finally:
        live.close()


def test_in_process_client_is_served_on_its_own_thread_unless_the_server_is_busy():
    """An in-process client's request skips the store and the server's threads: an idle
    server handles it on the client's thread.  A busy server (here: its handler waits on a
    remote client's request) queues it, so the client is not held up, and its handling thread
    answers it once free; the replies still match their requests."""
    threads: dict[str, int] = {}
    busy, free = threading.Event(), threading.Event()

    def handle(msg, reply):
        threads[msg["tag"]] = threading.get_ident()
        if msg["op"] == "block":
            busy.set()
            assert free.wait(20)
        reply.send({"tag": msg["tag"], "y": [2 * msg["x"][0]]})

    server = MailboxServer(handle)
    try:
        local = MailboxClient(server.address, "w0", 20.0, "server rank 0")
        remote = MailboxClient(server.address, "w1", 20.0, "server rank 0", in_process=False)
        x = torch.arange(4.0)
        assert local.call("double", x=[x], tag="idle")["tag"] == "idle"
        assert threads["idle"] == threading.get_ident()

        remote.request("block", x=[x], tag="remote")
        assert busy.wait(20)
        start = time.monotonic()
        local.request("double", x=[x + 1], tag="queued")  # returns at once: queued
        assert time.monotonic() - start < 5 and "queued" not in threads
        free.set()
        reply = local.response()
        assert reply["tag"] == "queued" and torch.equal(reply["y"][0], 2 * (x + 1))
        assert threads["queued"] == threads["remote"] != threading.get_ident()
        assert remote.response()["tag"] == "remote"
    finally:
        free.set()
        server.close()


def test_control_only_client_has_no_pair():
    server = MailboxServer(Echo().handle)
    try:
        client = MailboxClient(server.address, "c", 10.0, "chief", data=False)
        assert client.link is None and "c" not in server.peers
        with pytest.raises(ValueError, match="data=False"):
            client.call("double", x=[torch.ones(1)], n=0)
        assert client.call("release") == {"seq": 2, "inc": client.inc}
    finally:
        server.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_through_pinned_host_memory():
    tensors = [torch.randn(DIRECT, device="cuda"), torch.arange(7, device="cuda")]
    spec, messages = Packer().pack(tensors, direct=True)
    assert not any(e[3] for e in spec["entries"])  # CUDA tensors are never sent in place
    assert len(messages) == 1 and messages[0].is_pinned() and not messages[0].is_cuda
    inbox = Packer()
    for dst, src in zip(inbox.receive(spec), messages, strict=True):
        dst.copy_(src)
    for got, want in zip(inbox.unpack(spec), tensors, strict=True):
        assert torch.equal(got.cuda(), want)


@IN_PROCESS
def test_abandoned_reply_tensors_are_drained_not_mistaken_for_the_next(in_process):
    server = MailboxServer(Echo().handle)
    try:
        client = MailboxClient(server.address, "w0", 20.0, "server rank 0", in_process=in_process)
        other = MailboxClient(server.address, "w1", 20.0, "server rank 0", in_process=False)
        client.request("hold")  # abandoned: its reply (with a tensor) arrives later
        other.call("release")
        x = torch.randn(DIRECT)  # a different size and path than the abandoned ones(3)
        for _ in range(2):
            torch.testing.assert_close(client.call("double", x=[x], n=1)["y"][0], 2 * x)
    finally:
        server.close()


def test_views_of_received_messages_match_the_packed_tensors():
    tensors = sample_tensors() + [torch.randn(DIRECT)]
    spec, messages = Packer().pack(tensors, direct=True)
    assert spec["entries"][-1][3]  # the large one travels alone
    for got, want in zip(views(spec, messages), tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


class Reader:
    """Replies first, then reads the request's tensor (as the EASGD centre does)."""

    def __init__(self):
        self.seen = []

    def handle(self, msg, reply):
        reply.send({"ok": 1})
        time.sleep(0.05)  # a client told at once would have changed x by now
        self.seen.append(msg["x"][0].clone())
        self.pointers = msg["x"][0].data_ptr()


@IN_PROCESS
def test_handler_reads_each_request_intact_while_the_next_one_arrives(in_process):
    """The handler answers first and reads the request's tensor afterwards (as the EASGD
    centre does).  In-process: the server read the client's own memory, and the client was
    told only after the handler returned.  Over a pair: the client's next request is received
    into the other inbox while the handler still reads this one."""
    reader = Reader()
    server = MailboxServer(reader.handle)
    try:
        client = MailboxClient(server.address, "w0", 20.0, "server rank 0", in_process=in_process)
        assert isinstance(client.link, LocalLink if in_process else PairLink)
        x = torch.randn(DIRECT)
        for _ in range(3):
            client.call("read", x=[x])
            x.add_(1.0)  # what a worker does with its tensors once the reply is there
        assert (reader.pointers == x.data_ptr()) == in_process  # zero copy in-process only
        for k, seen in enumerate(reader.seen):
            torch.testing.assert_close(seen, x - (3 - k), rtol=0, atol=1e-5)
    finally:
        server.close()


def test_copy_mode_snapshots_large_tensors_that_still_travel_alone():
    big, small = torch.randn(DIRECT), torch.arange(3.0)
    spec, messages = Packer().pack([small, big], direct=True, copy=True)
    assert [e[3] for e in spec["entries"]] == [False, True] and len(messages) == 2
    big.add_(1.0)  # the sender may change its tensors at once
    got = views(spec, messages)
    torch.testing.assert_close(got[1], big - 1.0, rtol=0, atol=1e-6)
    assert torch.equal(got[0], small)


def test_reply_lands_in_the_callers_tensors_where_they_match():
    server = MailboxServer(Echo().handle)
    try:
        client = MailboxClient(server.address, "w0", 20.0, "server rank 0", in_process=False)
        x = [torch.randn(DIRECT), torch.randn(DIRECT), torch.arange(4.0)]
        into = [torch.empty(DIRECT), torch.empty(DIRECT + 1), torch.empty(4)]
        y = client.call("double", x=x, n=0, receive_into=into)["y"]
        assert y[0].data_ptr() == into[0].data_ptr()  # received in place
        assert y[1].data_ptr() != into[1].data_ptr()  # wrong shape: the link's own buffer
        assert y[2].data_ptr() != into[2].data_ptr()  # small: packed, never in place
        for got, want in zip(y, x, strict=True):
            torch.testing.assert_close(got, 2 * want)
        torch.testing.assert_close(into[0], 2 * x[0])
    finally:
        server.close()


@IN_PROCESS
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_request_and_reply_travel_through_host_memory_never_torch_save(
    monkeypatch, in_process
):
    def forbidden(*a, **k):
        raise AssertionError("torch.save used by the transport")

    monkeypatch.setattr(torch, "save", forbidden)
    server = MailboxServer(Echo().handle)
    try:
        client = MailboxClient(server.address, "w0", 20.0, "server rank 0", in_process=in_process)
        x = [torch.randn(DIRECT, device="cuda"), torch.arange(5, device="cuda")]
        into = [torch.empty(DIRECT, device="cuda"), None]
        y = client.call("double", x=x, n=0, receive_into=into)["y"]
        for got, want in zip(y, x, strict=True):
            assert not got.is_cuda  # a host view: the caller copies it to its device
            torch.testing.assert_close(got.cuda(), 2 * want)
    finally:
        server.close()


def _call_from_forked_child(address, queue):
    client = MailboxClient(address, "child", 10.0, "server rank 0")
    x = torch.arange(4.0)
    y = client.call("double", x=[x], n=0)["y"][0]
    queue.put((type(client.link).__name__, y.tolist()))


def test_forked_child_of_a_server_process_uses_a_pair_not_the_dead_servers_memory():
    """A child forked from a server's process inherits the registry of in-process servers
    but not the server's thread: it must talk to the server over a pair."""
    import multiprocessing as mp

    server = MailboxServer(Echo().handle)
    try:
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_call_from_forked_child, args=(server.address, queue))
        child.start()
        kind, y = queue.get(timeout=60)
        child.join(30)
        assert kind == "PairLink" and y == [0.0, 2.0, 4.0, 6.0]
    finally:
        server.close()


def test_a_request_is_handled_once_its_tensors_are_in_not_when_its_control_came():
    """A client whose tensors are late (a slow link) holds back no one: a request that
    came after it but whose tensors are in is handled first; the late one then intact."""
    order: list[tuple[str, float]] = []

    def handler(request, reply):
        order.append((request["client"], float(request["x"][0].sum())))
        reply.send({})

    server = MailboxServer(handler)
    try:
        slow = MailboxClient(server.address, "slow", 20.0, "server", in_process=False)
        fast = MailboxClient(server.address, "fast", 20.0, "server", in_process=False)
        send, fast_answered = slow.link.send, threading.Event()

        def late_send(messages):  # the control part goes now, the tensors once fast is answered
            threading.Thread(target=lambda: (fast_answered.wait(30), send(messages))).start()

        slow.link.send = late_send
        x = torch.ones(DIRECT)
        slow.request("push", x=[x])
        time.sleep(0.3)  # the slow request's control part is at the server first
        # handled in arrival order, this call would wait for tensors sent only after it
        fast.call("push", x=[2 * x], timeout=10.0)
        fast_answered.set()
        assert order == [("fast", 2.0 * DIRECT)]  # answered while the slow tensors travel
        slow.response()
        assert order == [("fast", 2.0 * DIRECT), ("slow", 1.0 * DIRECT)]
    finally:
        server.close()


def test_receipt_says_a_requests_tensors_are_in_before_any_answer():
    """A request with ``receipt=True`` is confirmed once its tensors have arrived (the server
    counted them), while the handler still holds its answer.  A request that asked for none
    gets none: the wait skips the earlier request's receipt still queued, and ends naming
    the server."""
    held: list = []
    server = MailboxServer(lambda msg, reply: held.append(reply))

    def until(condition) -> None:  # waits at most 10 s; the assertion after it says what failed
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)

    def answer() -> None:
        until(lambda: held)
        held.pop().send({"ok": 1})
        assert client.response() == {"ok": 1, "seq": client.last_request[1], "inc": client.inc}

    try:
        client = MailboxClient(server.address, "w0", 20.0, "server rank 3", in_process=False)
        assert client.receipts
        x = torch.randn(1 << 20)  # 4 MiB: travels as its own message
        client.request("push", x=[x], receipt=True)
        client.wait_receipt(client.last_request[1], 10.0)
        assert server.bytes_in == x.numel() * 4
        answer()
        client.request("push", x=[x], receipt=True)  # its receipt is left in the queue
        answer()
        client.request("push", x=[x])  # no receipt asked for
        with pytest.raises(ServerUnreachable, match="server rank 3.*no reply in 0.5s.*'receipt'"):
            client.wait_receipt(client.last_request[1], 0.5)
        until(lambda: server.bytes_in >= 3 * x.numel() * 4)  # its tensors came all the same
        assert server.bytes_in == 3 * x.numel() * 4
    finally:
        server.close()


def test_in_process_clients_need_no_receipts():
    server = MailboxServer(Echo().handle)
    try:
        assert not MailboxClient(server.address, "w0", 20.0, "server rank 0").receipts
    finally:
        server.close()
