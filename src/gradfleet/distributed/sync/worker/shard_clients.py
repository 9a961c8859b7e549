"""A SyncReplicas worker's clients of the servers, one per shard, and what both protocols
(:mod:`.plain_links`, :mod:`.ahead_links`) share over them: joining (``hello``), the shard
versions the worker holds, what a push carries (:func:`push_data`), the order pushes leave in
(:func:`push_order`), reads, queries and leaving.

Shard 0 is the chief's (it also keeps ``global_step`` and the tokens); shards 1.. are the
other server ranks' (a rank may host several).

Replicated servers (:mod:`...hosting.standby`): each server's hello names its standby; the
worker sends each step's gradients of a shard there itself, on a link of its own, before the
push (the chief's: the step request) goes to the shard's server
(:meth:`ShardClients.send_standby`), and numbers its step requests and pushes with the step's
``number``.  When a server is lost, :meth:`ShardClients.fail_over` moves that shard's link to
its standby (:class:`ShardLost` names the shard; any other loss is the chief's); the answers
name a standby that took the place of a lost one (:meth:`ShardClients.follow_standby`), so a
second loss is survived as the first.  Where the job's store keeps a directory of the servers
(:mod:`...hosting.server_directory`), a lost server's link moves where the directory says it
is now: a standby that attached after this worker's last answer from the server, or one that
took over already.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...hosting.server_directory import Place, ServerDirectory
from ...hosting.standby import DATA
from ...transport import MailboxClient, ServerUnreachable
from ..common.finite import all_finite
from ..layout.pieces import rank_places

__all__ = ["SendAgain", "ShardClients", "ShardLost", "busy_error", "push_data", "push_order"]

log = logging.getLogger(__name__)

Grads = list[torch.Tensor | None]
Load = Callable[[int, list[torch.Tensor]], None]


class ShardLost(ServerUnreachable):
    """The server of shard ``shard`` is lost (the error its link raised, named)."""

    def __init__(self, shard: int, message: str) -> None:
        super().__init__(message)
        self.shard = shard


class SendAgain(ShardLost):
    """The chief says shard ``shard``'s standby took over at ``address`` and withdrew this
    step's gradient (its sum went with the lost server): move there and send the step again."""

    def __init__(self, shard: int, address: str | None) -> None:
        super().__init__(shard, f"shard {shard}'s standby took over at {address}: the step again")
        self.address = address


def push_order(ranks: Sequence[int], turn: int) -> list[int]:
    """The shards in the order a worker pushes them: every server rank's first shard, then
    every rank's second, ..., the ranks rotated by ``turn`` (the worker's number), so that at
    any moment the workers push to different server ranks (``[4, 5, 4, 5]``, turn 1 ->
    ``[1, 0, 3, 2]``).

    Shard 0 is never last: the token request follows the push to shard 0 at once, and it must
    reach the chief before this worker's last push can complete an update; else a faster
    worker could take the token meant for this one (TF hands tokens to whoever asks first),
    and a lockstep job (R = N, no initial tokens) would no longer run the same way twice."""
    hosts = list(dict.fromkeys(ranks))
    places = rank_places(ranks)
    order = sorted(
        range(len(ranks)),
        key=lambda k: (places[k], (hosts.index(ranks[k]) - turn) % len(hosts), k),
    )
    if len(order) > 1 and order[-1] == 0:
        order[-2:] = [0, order[-2]]
    return order


def push_data(
    tag: int, version: int, grads: Grads, shapes: Sequence[tuple[int, ...]] | None
) -> dict[str, Any]:
    """A push's data: ``{"grads": grads}``, or ``{"withheld": True}`` when its shard is certain
    to drop them as stale.

    TF's accumulators drop a gradient whose tag is below their step; a worker that has loaded
    the shard's values of step ``version`` > ``tag`` knows the shard is past ``tag`` (a shard's
    step never goes back, and a checkpoint load forgets the versions).  A backup worker, or
    one holding a surplus token, then sends a few bytes instead of gradients that would cross
    its link only to be dropped; the shard counts the push as dropped all the same
    (``GradientAggregator.drop_withheld``).  Gradients the shard should judge travel: bad
    input (``tag < 0``, NaN or Inf, which the shard reports under ``nonfinite="raise"`` or
    ``"drop"`` even when stale), shapes other than the shard's (``shapes``, from ``hello``),
    sparse ones."""
    stale = 0 <= tag < version and shapes is not None and len(shapes) == len(grads)
    if stale and all(
        g is None or (not g.is_sparse and tuple(g.shape) == tuple(s) and all_finite(g))
        for g, s in zip(grads, shapes, strict=True)
    ):
        return {"withheld": True}
    return {"grads": grads}


def busy_error(op: str) -> RuntimeError:
    """A query ``op`` between backward and ``step()`` with overlap would take the place of a
    push's answer on its link (one request at a time per client): the error refusing it."""
    return RuntimeError(
        f"SyncReplicasOptimizer: {op!r} while this step's pushes are in flight "
        "(overlap=True pushes during backward): call it after step()"
    )


class ShardClients:
    """Clients of the servers at ``addresses`` (shard order; ``ranks`` host them) for worker
    ``worker``; a reply may take ``timeout`` seconds (plus a margin for the server's own);
    ``workers``: the job's N (ranks from N on only serve); ``directory``: where the servers
    and their standbys are now (module docstring)."""

    def __init__(
        self,
        addresses: Sequence[str],
        ranks: Sequence[int],
        worker: int,
        timeout: float,
        workers: int,
        directory: ServerDirectory | None = None,
    ) -> None:
        self.addresses, self.ranks = list(addresses), list(ranks)
        self.directory = directory
        self.worker, self.timeout, self.workers = worker, timeout, workers
        self.clients = {k: self.connect(k) for k in range(len(self.addresses))}
        self.versions = dict.fromkeys(self.clients, -1)  # each shard's step the worker holds
        self._shapes: dict[int, list[tuple[int, ...]]] = {}  # each shard's, from hello
        self.withheld = 0  # pushes sent without their gradients (push_data)
        self.replicas: int | None = None  # the chief's R at hello
        self.order = push_order(self.ranks, worker)
        # each shard's standby (address, rank), named by its server; the links this worker
        # sends its gradients there on; the number of its next step; each lost server's rank
        self.standbys: dict[int, tuple[str, int]] = {}
        self.standby_clients: dict[int, MailboxClient] = {}
        # shards whose standby gets no gradients from the workers (the chief's, which is
        # sent what its primary made of them), as their hellos say
        self.no_standby_data: set[int] = set()
        self.number = 1
        self.moved: dict[int, int] = {}
        self._lost: set[str] = set()  # addresses of servers and standbys found lost

    @property
    def standby(self) -> tuple[str, int] | None:
        """The chief's standby (address, rank), or None."""
        return self.standbys.get(0)

    @property
    def moved_from(self) -> int | None:
        """The lost chief's rank, once this worker moved to its standby (else None)."""
        return self.moved.get(0)

    def connect(self, k: int, suffix: str = "", data: bool = True) -> MailboxClient:
        """A client of shard ``k``'s server (``suffix``: a second client of it, e.g. the
        token's; ``data=False``: control messages only)."""
        name = f"server rank {self.ranks[k]}" + (f" (shard {k})" if k else "")
        return MailboxClient(
            self.addresses[k], f"w{self.worker}{suffix}", self.timeout + 10.0, name, data=data
        )

    @property
    def chief(self) -> MailboxClient:
        return self.clients[0]

    @property
    def shards(self) -> dict[int, MailboxClient]:
        """The clients of shards 1.. (not the chief's)."""
        return {k: c for k, c in self.clients.items() if k}

    def __len__(self) -> int:
        return len(self.clients)

    def __contains__(self, k: object) -> bool:
        return k in self.clients

    def hello(self, parts: Sequence[Sequence[torch.Tensor]]) -> tuple[int, dict[int, list]]:
        """Join every server: ``(global_step, {shard: its current values})``."""
        out, step = {}, 0
        for k, client in self.clients.items():
            reply = client.call(
                "hello",
                worker=self.worker,
                to=self.addresses[k],  # a loss reported later about an earlier self: stale
                shapes=[list(p.shape) for p in parts[k]],
                dtypes=[str(p.dtype) for p in parts[k]],
            )
            self.versions[k] = int(reply["version"])
            self._shapes[k] = [tuple(p.shape) for p in parts[k]]
            out[k] = reply["params"]
            step = int(reply["global_step"]) if k == 0 else step
            if k == 0:  # the R of the first update this worker's gradient may join
                self.replicas = reply.get("r")
            if not reply.get("standby_data", True):
                self.no_standby_data.add(k)
            if reply.get("standby") is not None:
                self._meet_standby(k, str(reply["standby"]), int(reply["standby_rank"]))
        return step, out

    def push_data(self, k: int, tag: int, grads: Grads) -> dict[str, Any]:
        """:func:`push_data` for shard ``k``; a withheld push is counted and logged."""
        data = push_data(tag, self.versions[k], grads, self._shapes.get(k))
        if "withheld" in data:
            self.withheld += 1
            log.debug("worker rank %d: shard %d is at step %d: gradients of step %d withheld",
                      self.worker, k, self.versions[k], tag)  # fmt: skip
        return data

    # ------------------------------------------------------------------ standbys
    def _name(self, k: int) -> str:
        return "the chief" if k == 0 else f"shard {k}"

    def _meet_standby(self, k: int, address: str, rank: int) -> None:
        self.standbys[k] = (address, rank)
        try:
            self.standby_clients[k] = MailboxClient(
                address, f"w{self.worker}s{k or ''}", self.timeout + 10.0,
                f"server rank {rank} (standby of {self._name(k)})",
            )  # fmt: skip
        except ServerUnreachable as exc:
            self.standby_lost(k, exc)

    def follow_standby(self, address: str | None, rank: int | None, k: int = 0) -> None:
        """Shard ``k``'s server names a standby this worker does not send to (one that took
        the place of a lost one, from the server's live state): send there from the next
        step on."""
        known = self.standbys.get(k, (None, None))[0]
        if address is None or rank is None or address in (known, self.addresses[k]):
            return
        if address in self._lost:
            return
        log.info("worker rank %d: the standby of %s is now on rank %d (%s)",
                 self.worker, self._name(k), rank, address)  # fmt: skip
        self._meet_standby(k, address, rank)

    def send_standby(self, fields: dict[str, Any], k: int = 0) -> str | None:
        """Shard ``k``'s standby gets ``fields`` (this step's gradients of the shard) before
        the push (the chief's: the step request) leaves for its server, so that the server
        never applies a push whose gradients its standby could miss: the address they went
        to, or None (no standby, or it is lost: the server's copy then carries them)."""
        client, standby = self.standby_clients.get(k), self.standbys.get(k)
        if client is None or standby is None or k in self.no_standby_data:
            return None
        try:
            client.call(DATA, worker=self.worker, number=self.number, fields=list(fields),
                        **fields)  # fmt: skip
        except ServerUnreachable as exc:
            self.standby_lost(k, exc)
            return None
        return standby[0]

    def local_standby(self, k: int) -> MailboxClient | None:
        """The client of shard ``k``'s standby where it is on this worker's own rank: it
        reads that shard's values there, not over the server's link (None elsewhere)."""
        standby = self.standbys.get(k)
        if standby is None or standby[1] != self.worker:
            return None
        return self.standby_clients.get(k)

    def standby_lost(self, k: int, exc: ServerUnreachable) -> None:
        """Shard ``k``'s standby did not answer: it is lost (its server goes on alone)."""
        log.warning("worker rank %d: the standby %s of %s is lost: %s",
                    self.worker, self.standbys.get(k), self._name(k), exc)  # fmt: skip
        if k in self.standbys:
            self._lost.add(self.standbys[k][0])  # its server may still name it a while
        self.standby_clients.pop(k, None)
        self.standbys.pop(k, None)

    def fail_over(self, exc: ServerUnreachable) -> None:
        """A server is lost (``exc``: a :class:`ShardLost` names the shard; any other loss is
        the chief's): that shard's link moves to its standby, which takes over at this
        worker's first request (to where the job's directory says it is, where the standby
        is not known or gone too); raises ``exc`` where there is none."""
        k = exc.shard if isinstance(exc, ShardLost) else 0
        if isinstance(exc, SendAgain) and exc.address == self.addresses[k]:
            return  # this worker found the server lost itself and moved there already
        lost = self.ranks[k]
        lost_address = self.addresses[k]
        while True:  # each place tried once: it joins the lost ones, which _next_place skips
            self._lost.add(self.addresses[k])
            place = self._next_place(k)
            if place is None:
                raise exc
            address, rank = place
            named = place == self.standbys.pop(k, None)
            self.standby_clients.pop(k, None)  # until the new server names one
            log.warning(
                "worker rank %d: SyncReplicas' %s on server rank %d is lost (%s); moving to "
                "its standby on rank %d%s", self.worker, self._name(k), self.ranks[k], exc, rank,
                "" if named else " (as the job's directory says)",
            )  # fmt: skip
            self.addresses[k], self.ranks[k] = address, rank
            try:
                self.clients[k] = self.connect(k)
                break
            except ServerUnreachable as again:  # gone too: the next place, if any
                exc = again
        self.moved[k] = lost
        if lost != self.worker and lost < self.workers:
            # the lost server's host took its worker with it: the new server must not wait
            # for it (a worker that is still alive counts again at its next hello)
            self.clients[k].call("done", worker=lost, forgotten=True,
                                 lost_server=lost_address)  # fmt: skip

    def _next_place(self, k: int) -> tuple[str, int] | None:
        """Where shard ``k``'s server went: the standby its answers named, else (none, or it
        was found lost) the job's directory's place for it (a standby that attached since,
        or one that took over already); None if neither."""
        named = self.standbys.get(k)
        if named is not None and named[0] not in self._lost:
            return named
        found: Place | None = None
        if self.directory is not None:
            found = self.directory.next_after(k, self._lost)
        return None if found is None else (found.address, found.rank)

    def read(self, shards: Sequence[int], into: dict[int, list[torch.Tensor]], load: Load) -> None:
        """Read ``shards``' values that changed since the last read, all replies' receives
        posted before any is waited for; ``load(k, values)`` runs on each shard's new ones."""
        for k in shards:
            self.clients[k].request("read", worker=self.worker, version=self.versions[k])
        reads = {k: self.clients[k].begin_response(receive_into=into.get(k)) for k in shards}
        for k, (_, finish) in reads.items():
            self.loaded(k, finish(), load)

    def loaded(self, k: int, values: dict[str, Any], load: Load) -> None:
        """Shard ``k`` answered with ``values`` (its ``version``, and ``params`` if newer than
        what the worker held): note the version, load the values."""
        self.versions[k] = int(values["version"])
        if "params" in values:
            load(k, values["params"])

    def forget_versions(self) -> None:
        """The next token and read bring every shard's values (after a checkpoint load)."""
        self.versions = dict.fromkeys(self.versions, -1)

    def call(self, shard: int, op: str, **fields: Any) -> dict[str, Any]:
        """Shard ``shard``'s answer to ``op``; from its standby if its server is lost."""
        try:
            return self.clients[shard].call(op, worker=self.worker, **fields)
        except ServerUnreachable as exc:
            self.fail_over(ShardLost(shard, str(exc)))
            return self.clients[shard].call(op, worker=self.worker, **fields)

    def call_all(self, op: str, **fields: Any) -> dict[int, dict[str, Any]]:
        return {k: c.call(op, worker=self.worker, **fields) for k, c in self.clients.items()}

    def forget(self, ranks: Sequence[int]) -> None:
        """Tell every server that the workers ``ranks`` are dead for good."""
        for client in self.clients.values():
            for r in ranks:
                client.call("done", worker=r, forgotten=True)

    def leave(self, unreachable: str | None = None) -> None:
        """Say ``done`` to every server; a server that is already gone is logged and skipped.
        ``unreachable``: this worker leaves because a server is gone (its error's message)."""
        cause = {} if unreachable is None else {"unreachable": unreachable}
        for k in list(self.clients):
            try:
                try:
                    self.clients[k].call("done", worker=self.worker, timeout=5.0, **cause)
                except ServerUnreachable as exc:  # a server lost at the end: its standby
                    self.fail_over(ShardLost(k, str(exc)))
                    self.clients[k].call("done", worker=self.worker, timeout=5.0, **cause)
            except Exception as exc:  # leaving must not fail: the server may have stopped
                log.info("worker rank %d: shard %d gone before its done: %s", self.worker, k, exc)
            self.clients[k].close()

    @property
    def bytes_out(self) -> int:
        return sum(c.bytes_out for c in self.clients.values())
