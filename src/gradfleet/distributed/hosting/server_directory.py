"""Where each replicated server is now, and its standby: one small record per server on the
job's store, for whoever finds a server lost before any answer told it the standby.

Workers and shard servers learn where a server's standby is from the server's answers
(:mod:`.standby`).  That leaves a window: a restarted process that has just become a
standby is named only in answers given after it attached, and a copy that has just taken
over a shard has never had an answer from the chief at all.  A server lost in that window
left them with no standby, or with one that is long gone, and the job stopped although a
live copy held the server's whole state.

So a server with a standby says where it and its standby are, here, each time that changes:
once a standby attached (after it holds the whole state), once it is found lost, and when a
standby takes over (it is the server now, without a standby).  :meth:`ServerDirectory.next_after`
answers "the server did not answer at these addresses: where now?": the server the record
names if that is another one (a standby took over already), else its standby.  The callers
ask it after the standby the answers named, which is where a server almost always went: the
directory costs a store round trip only when that one is missing or gone too.

The record is a control message on the job's c10d store (a few dozen bytes, written a
handful of times a job), never on the data plane.  The store may be gone with the rank that
hosted it (``GRADFLEET_STORE=rank0``): the directory then answers nothing, and the callers
keep what the answers told them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from ..transport.elastic_group import root_store

__all__ = ["Place", "ServerDirectory", "job_directory"]

log = logging.getLogger(__name__)

PREFIX = "gradfleet/servers/"


class Place(NamedTuple):
    """A server's address and rank."""

    address: str
    rank: int


class ServerDirectory:
    """The records of one job's servers (module docstring) under ``name`` (e.g.
    ``"sync/1"``): server ``k`` (0: the chief).  ``connect`` makes the store client, at
    first use: a store that is gone costs the first caller a connect's wait, once."""

    def __init__(self, connect: Callable[[], dist.Store], name: str) -> None:
        self._connect, self.prefix = connect, f"{PREFIX}{name}/"
        self._store: dist.Store | None = None
        self._gone = False  # the store did not answer once: never asked again
        self._lock = threading.Lock()  # one client, several threads (servers, the worker)
        # records to write, the latest per server: written by a thread of their own, so that
        # a server's thread never waits for the store (gone with rank 0, it would wait for a
        # connect's timeout in the middle of a takeover)
        self._unsaid: dict[int, str] = {}
        self._said = threading.Condition()
        self._writer: threading.Thread | None = None
        self._writing = False

    def _call(self, what: str, k: int, call: Callable[[dist.Store], Any]) -> Any:
        with self._lock:
            if self._gone:
                return None
            try:
                if self._store is None:
                    self._store = self._connect()
                return call(self._store)
            except Exception as exc:  # the store went with its rank: the answers still tell
                self._gone = True
                log.warning("server %d: the job's store did not %s (%s); the servers' "
                            "answers alone say where they are", k, what, exc)  # fmt: skip
                return None

    def publish(self, k: int, server: Place, standby: Place | None) -> None:
        """Server ``k`` is at ``server`` and its standby at ``standby`` (None: it has none):
        written soon, by the directory's own thread (a later record of ``k`` replaces one
        not written yet)."""
        record = {"server": list(server), "standby": None if standby is None else list(standby)}
        with self._said:
            self._unsaid[k] = json.dumps(record)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write, name="gradfleet-directory", daemon=True
                )
                self._writer.start()
            self._said.notify_all()

    def _write(self) -> None:
        while True:
            with self._said:
                while not self._unsaid:
                    self._said.wait()
                k, record = self._unsaid.popitem()
                self._writing = True
            key = f"{self.prefix}{k}"
            self._call("keep where it is", k, lambda store: store.set(key, record))  # noqa: B023
            with self._said:
                self._writing = False
                self._said.notify_all()

    def flush(self, seconds: float = 10.0) -> bool:
        """Wait until every record published so far is written; False after ``seconds``."""
        with self._said:
            return self._said.wait_for(lambda: not self._unsaid and not self._writing, seconds)

    def read(self, k: int) -> tuple[Place, Place | None] | None:
        """Server ``k``'s record (server, standby), or None (none yet, or no store)."""
        key = f"{self.prefix}{k}"

        def get(store: dist.Store) -> Any:
            return json.loads(store.get(key)) if store.check([key]) else None

        record = self._call("say where it is", k, get)
        if record is None:
            return None
        standby = record["standby"]
        return Place(*record["server"]), None if standby is None else Place(*standby)

    def next_after(self, k: int, lost: Collection[str]) -> Place | None:
        """Server ``k`` did not answer at any of the addresses ``lost``: where it is now (a
        standby that took over), else its standby, else None."""
        found = self.read(k)
        if found is None:
            return None
        for place in found:
            if place is not None and place.address not in lost:
                return place
        return None


def job_directory(name: str, joining: bool, timeout: float) -> ServerDirectory | None:
    """The directory ``name`` on this job's store: the process group's (``joining``: a
    restarted process outside it, the store at ``MASTER_ADDR:MASTER_PORT``), through a client
    of its own (the callers' threads must not queue behind the group's store calls), which
    may take the job's ``timeout`` to connect and answer, as the job's other store clients
    (a loaded machine's store answers a connect late; one that never does is gone, and the
    first caller finds out after that wait, once); None where there is no store to share."""
    if joining:
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = root_store(dist.distributed_c10d._get_default_store())
        if not isinstance(store, dist.TCPStore):
            return ServerDirectory(lambda: store, name)  # a file or hash store: shared as is
        host, port = store.host, store.port

    def connect() -> dist.Store:
        return dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )  # fmt: skip

    return ServerDirectory(connect, name)
