"""Where the wrappers' servers listen when no ``host=`` is given: loopback while every rank is
on this host, the interface towards ``MASTER_ADDR`` when the ranks are on several hosts, and
otherwise one clear error naming ``host=`` on every rank."""

from __future__ import annotations

import pytest

from gradfleet.distributed.common.membership import Membership
from gradfleet.distributed.common.replies import Answer
from gradfleet.distributed.hosting import hosted_server as hosting
from gradfleet.distributed.hosting.hosted_server import (
    HostedServer,
    choose_server_host,
    env_server_host,
    server_host,
)
from gradfleet.distributed.transport import ServerUnreachable

ONE_HOST = [("node-a", "10.0.0.1")] * 3
TWO_HOSTS = [("node-a", "10.0.0.1"), ("node-a", "10.0.0.1"), ("node-b", "10.0.0.2")]


def test_ranks_on_one_host_listen_on_loopback():
    assert choose_server_host(ONE_HOST, 0, "X") == "127.0.0.1"
    assert choose_server_host([("node-a", "127.0.0.1")] * 2, 1, "X") == "127.0.0.1"
    assert choose_server_host([("node-a", None)], 0, "X") == "127.0.0.1"


def test_ranks_on_several_hosts_listen_on_their_route_to_the_master():
    assert choose_server_host(TWO_HOSTS, 0, "X") == "10.0.0.1"
    assert choose_server_host(TWO_HOSTS, 2, "X") == "10.0.0.2"
    # namespaces share a host name: different addresses are different hosts
    assert choose_server_host([("box", "10.1.0.1"), ("box", "10.1.0.2")], 1, "X") == "10.1.0.2"


@pytest.mark.parametrize("bad", [None, "127.0.0.1"])
def test_several_hosts_without_a_reachable_address_name_host_on_every_rank(bad, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    places = [("node-a", bad), ("node-b", "10.0.0.2")]
    messages = set()
    for rank in range(2):  # the same places give every rank the same error
        with pytest.raises(ValueError, match="pass host=") as err:
            choose_server_host(places, rank, "SyncReplicasOptimizer")
        messages.add(str(err.value))
    (message,) = messages
    assert "SyncReplicasOptimizer" in message and "node-a, node-b" in message
    assert "rank(s) [0]" in message and "'localhost'" in message


def test_explicit_host_and_environment_win(monkeypatch):
    monkeypatch.delenv("GRADFLEET_SERVER_HOST", raising=False)
    assert server_host("10.9.9.9", "X") == "10.9.9.9"
    monkeypatch.setenv("GRADFLEET_SERVER_HOST", "10.8.8.8")
    assert server_host(None, "X") == "10.8.8.8"
    assert env_server_host() == "10.8.8.8"
    monkeypatch.setenv("GRADFLEET_SERVER_HOST", "0.0.0.0")
    with pytest.raises(ValueError, match="not the wildcard"):
        server_host(None, "X")


def test_without_a_process_group_the_server_listens_on_loopback(monkeypatch):
    monkeypatch.delenv("GRADFLEET_SERVER_HOST", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.255.255.1")
    assert server_host(None, "X") == "127.0.0.1"  # one rank: one host


def test_env_server_host_follows_master_addr(monkeypatch):
    monkeypatch.delenv("GRADFLEET_SERVER_HOST", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert env_server_host() == "127.0.0.1"
    monkeypatch.setattr(hosting, "route_address", lambda target, port=9: None)
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(ValueError, match="GRADFLEET_SERVER_HOST"):
        env_server_host()


class _Ticket:
    def __init__(self) -> None:
        self.payloads: list[dict] = []

    def send(self, payload, share=None, fresh=False):
        self.payloads.append(payload)


class _Idle:
    def handle(self, msg, ticket):
        return []

    def tick(self):
        return []


def test_answers_after_a_failed_effect_carry_its_error():
    """A shard's report to a dead chief fails: the answers the update released after it still
    go out, as the report's error (naming the chief), instead of never."""

    def report(effect):
        raise ServerUnreachable("server rank 2 (chief) at 127.0.0.1:1 closed the connection")

    hosted = HostedServer(_Idle(), Membership(1, 5.0), "127.0.0.1", "shard", perform=report)
    try:
        before, after = _Ticket(), _Ticket()
        outputs = [Answer(before, {"step": 1}), "applied", Answer(after, {"step": 1})]
        with pytest.raises(ServerUnreachable, match="server rank 2"):
            hosted._emit(outputs)
        assert before.payloads == [{"step": 1}]
        (payload,) = after.payloads
        assert payload["error"] == "ServerUnreachable" and "server rank 2" in payload["message"]
    finally:
        hosted.mailbox.close()


def test_a_primary_without_a_standby_takes_a_new_one_from_its_whole_state():
    """``standby_attach``: the new standby's first copy is the primary's whole state, and the
    answer waits until it has it; a second one, a standby's own server, or a machine that
    cannot be replicated refuse, naming why."""
    import time

    import torch

    from gradfleet.distributed.easgd.server.centre_server import CentreServer
    from gradfleet.distributed.hosting.standby import ATTACH

    def attach(hosted: HostedServer, to: HostedServer) -> _Ticket:
        ticket = _Ticket()
        msg = {"op": ATTACH, "address": to.address, "rank": 1, "seconds": 10.0}
        hosted._handle(msg, ticket)
        return ticket

    centre = CentreServer([torch.tensor([1.0, 2.0])], 2, 10.0, keep_reads=True)
    centre.handle({"op": "load", "worker": 0, "centre": [torch.tensor([5.0, 6.0])]}, None)
    primary = HostedServer(centre, centre.members, "127.0.0.1", "centre")
    copy = CentreServer([torch.zeros(2)], 2, 10.0, keep_reads=True)
    standby = HostedServer(copy, copy.members, "127.0.0.1", "copy", standby=True)
    idle = HostedServer(_Idle(), Membership(1, 5.0), "127.0.0.1", "idle")
    try:
        refused = attach(standby, primary)  # a standby is no primary
        assert "it is a standby" in refused.payloads[0]["message"]
        refused = attach(idle, standby)
        assert "cannot be replicated" in refused.payloads[0]["message"]
        first = attach(primary, standby)
        deadline = time.monotonic() + 10
        while not first.payloads and time.monotonic() < deadline:
            time.sleep(0.01)  # answered from the server's tick once the copy is handled
        assert first.payloads == [{}]
        assert torch.equal(copy.centre[0], torch.tensor([5.0, 6.0]))
        assert (centre.standby, centre.standby_rank) == (standby.address, 1)
        second = attach(primary, standby)
        assert "it has a live standby" in second.payloads[0]["message"]
    finally:
        for hosted in (primary, standby, idle):
            if hosted.forwarder is not None:
                hosted.forwarder.close()
            hosted.mailbox.close()
