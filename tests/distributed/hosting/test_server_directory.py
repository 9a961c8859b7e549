"""The job's directory of its replicated servers (``hosting/server_directory.py``): what a
server says is where the others find it, the latest record wins, a store that is gone makes it
answer nothing (once, without waiting again), and bad records never mislead a caller."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from gradfleet.distributed.hosting.server_directory import Place, ServerDirectory


def _directory(store: dist.Store, name: str = "sync/1") -> ServerDirectory:
    return ServerDirectory(lambda: store, name)


def test_a_published_record_is_read_back_and_the_latest_wins() -> None:
    store = dist.HashStore()
    chief, shard = _directory(store), _directory(store)  # two processes' clients
    assert shard.read(0) is None  # nothing said yet
    chief.publish(0, Place("10.0.0.1:5000", 0), Place("10.0.0.2:5001", 1))
    chief.publish(0, Place("10.0.0.1:5000", 0), Place("10.0.0.3:5002", 3))  # a new standby
    assert chief.flush()
    assert shard.read(0) == (Place("10.0.0.1:5000", 0), Place("10.0.0.3:5002", 3))
    assert shard.read(1) is None  # another server's record is its own
    assert _directory(store, "sync/2").read(0) is None  # and another exchange's


def test_next_after_skips_every_address_found_lost() -> None:
    store = dist.HashStore()
    directory = _directory(store)
    chief, standby = Place("a:1", 0), Place("b:2", 1)
    directory.publish(0, chief, standby)
    assert directory.flush()
    assert directory.next_after(0, {"a:1"}) == standby  # the chief lost: its standby
    assert directory.next_after(0, {"a:1", "b:2"}) is None  # both lost: nowhere
    assert directory.next_after(0, {"c:3"}) == chief  # another address lost: the chief is here
    # the standby took over (it is the server now, with no standby of its own)
    directory.publish(0, standby, None)
    assert directory.flush()
    assert directory.next_after(0, {"a:1"}) == standby
    assert directory.next_after(0, {"a:1", "b:2"}) is None


def test_a_store_that_is_gone_answers_nothing_and_is_not_asked_again() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    connects = []

    def connect() -> dist.Store:
        connects.append(port)
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))

    directory = ServerDirectory(connect, "sync/1")
    assert directory.read(0) is None
    assert directory.next_after(0, {"a:1"}) is None
    directory.publish(0, Place("a:1", 0), None)
    assert directory.flush()
    assert connects == [port]  # one connect's wait, not one per call


def test_a_publish_never_waits_for_the_store() -> None:
    store, answer = dist.HashStore(), threading.Event()

    def connect() -> dist.Store:
        answer.wait(30)  # a store slow to answer (or gone: a connect's timeout)
        return store

    directory = ServerDirectory(connect, "sync/1")
    directory.publish(0, Place("a:1", 0), Place("b:2", 1))  # returns with the store silent
    directory.publish(0, Place("a:1", 0), Place("c:3", 2))  # replaces the unwritten one
    assert not directory.flush(seconds=0.2)
    answer.set()
    assert directory.flush(seconds=30)
    assert _directory(store).read(0) == (Place("a:1", 0), Place("c:3", 2))
