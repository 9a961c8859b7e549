"""Asynchronous EASGD: the centre lives on a server, each worker exchanges on its own schedule.

``ElasticAverageOptimizer(..., mode="async")`` (or ``mode=AsyncCentre(...)`` for options) keeps
TF's ``global_center_variable`` in a server thread inside rank ``server_rank`` (TF's PS).  Every
``communication_period`` local steps a worker reads the centre and adds its pull to it, as TF's
worker does (reference 3.4)::

    server:  c_read := c                      (the worker's "exchange_read")
             c := c + alpha * (x - c_read)    (its "exchange_add", carrying x)
    worker:  c_loc := c_read;  d := x - c_loc;  x := x - alpha * d

No barrier and no waiting for other workers: the result depends on the order in which workers
reach the server.  As in TF, the read and the add are not atomic across workers: another
worker's read or add may come between them.  The worker sends ``x`` right after its read
request, while ``c_read`` is still on its way to it, so both directions of its link carry
data at once: an exchange costs one transfer time (P bytes at the link's rate), not two.
``synchronous=True`` adds TF's one-time start-up barrier (every worker waits until all
``num_worker`` have read the initial centre) and nothing else.

Start / restart (TF's ``get_init_op`` + ``synchronous=False``): a worker reads the current centre
into its parameters and local centre and starts at ``local_step = 0``; a worker that was killed and
restarted does the same while the others never stop.  A restarted process is outside the process
group, so it names the server explicitly: ``AsyncCentre(address=..., worker=...)`` with the
``address`` of the running server (``AsyncCentre.address`` on any worker).

A standby (:mod:`..hosting.standby`, ``standby=True`` or a rank): the centre has a live copy on
a worker rank other than the server's (chosen: the first worker rank after the server's on
another host, else the next one, wrapping; a dedicated centre rank's standby is on a worker
rank too, rank 0 where all share one host).  The server answers an exchange once
the standby has it too, so the copy is bit-identical after every exchange a worker saw
answered; each worker sends its parameters to the standby itself.  When the server's host is
lost, each worker moves to the standby and sends the exchange it was waiting on again under
the same number (the centre applies it once: redone, or applied already and answered with the
same read), and training goes on.  A restarted process that joins by address with
``standby=True`` becomes the new centre's standby, from its live state, so a later loss is
survived too.  A loss while the centre has no standby (the default on a worker rank, one
worker with the centre on its rank, or after a loss until a process takes the standby's
place) makes every exchange fail at once with an error naming the server rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..common.flat import copy_received
from ..hosting.centre_standby import attach_centre_standby
from ..hosting.dedicated import CENTRE, announce
from ..hosting.hosted_server import HostedServer, env_server_host, server_host, share_address
from ..hosting.standby import DATA, standby_rank
from ..transport import MailboxClient, ServerUnreachable
from ..transport.collectives import Collective, LocalCollective, TorchCollective
from .centre import CENTRE_MODES, CentreStrategy
from .server.centre_server import CentreServer

__all__ = ["AsyncCentre", "CENTRE_MODES"]

log = logging.getLogger(__name__)


class AsyncCentre(CentreStrategy):
    """Centre on a server inside ``server_rank``; asynchronous exchanges (module docstring).

    Args:
        server_rank: rank hosting the server (TF's PS).  A worker rank also trains; rank
            ``num_worker`` of a job of ``num_worker + 1`` processes only serves (it calls
            :func:`gradfleet.distributed.serve`; the centre starts at rank 0's parameters).
        timeout: seconds to wait for the server, the start-up barrier or the end of training.
        host: interface the server listens on.  Default: loopback while every rank is on
            this host, else this host's address on the route to ``MASTER_ADDR``
            (``GRADFLEET_SERVER_HOST`` overrides it); ranks on several hosts without such an
            address raise ``ValueError`` naming ``host=`` on every rank.
        address: for a process outside the process group (a restarted worker): the running
            server's ``"host:port"``.
        worker: that process's worker id (with ``address``).
        standby: the rank that keeps a live copy of the centre and takes over when the
            server's host is lost (module docstring); ``True``: chosen, the first worker rank
            after ``server_rank`` on another host, else the next one; ``False``: none;
            ``None`` (default): on for a dedicated centre rank, off for a centre on a worker
            rank (:meth:`asked_standby`; the costs are in docs/failures.md).  For a process
            that joins by ``address`` (a restarted one), ``True``: become the standby of a
            centre that has none (its own took over after a loss), from its live state.
    """

    mode = "async"

    def __init__(
        self,
        server_rank: int = 0,
        timeout: float = 60.0,
        host: str | None = None,
        address: str | None = None,
        worker: int | None = None,
        standby: int | bool | None = None,
    ) -> None:
        if standby is not None and not isinstance(standby, (bool, int)):
            raise ValueError(
                f"AsyncCentre: standby must be a worker rank, True (chosen) or False/None "
                f"(none), got {standby!r}"
            )
        self.server_rank, self.timeout, self.host = server_rank, float(timeout), host
        self.address, self.worker = address, worker
        self.standby: int | bool | None = standby
        self._by_address = address is not None  # a process that joins a running job
        self.standby_address: str | None = None  # where the standby serves, once it does
        self._number = 0  # this worker's exchanges: each is applied once, also when sent again
        self.moved_from: int | None = None  # the lost server's rank, once on the standby
        self._lost: set[str] = set()  # addresses of standbys found lost
        self.num_worker, self.synchronous = 1, False
        self.dedicated = False  # the centre's rank only serves (it is not a worker)
        self._server: CentreServer | None = None
        self._hosted: HostedServer | None = None
        self._standby_server: CentreServer | None = None  # on the standby's rank
        self._standby_hosted: HostedServer | None = None
        self._client: MailboxClient | None = None
        self._standby_client: MailboxClient | None = None  # x goes there too, on this link
        self._read: list[torch.Tensor] | None = None
        self._diff: list[torch.Tensor] = []

    # ------------------------------------------------------------------ wrapper hooks
    def configure(self, num_worker: int, synchronous: bool) -> None:
        self.num_worker, self.synchronous = num_worker, synchronous

    def resolve_collective(self, num_worker: int, group: Any, owner: str) -> Collective:
        """Inside the process group: the group's collective; a restarted process (``address``
        given) needs none."""
        if self.address is not None:
            local = LocalCollective()
            local.rank, local.world_size = int(self.worker or 0), num_worker
            return local
        if self.server_rank >= num_worker and dist.is_available() and dist.is_initialized():
            return self._dedicated_collective(num_worker, group, owner)
        return super().resolve_collective(num_worker, group, owner)

    def _dedicated_collective(self, num_worker: int, group: Any, owner: str) -> Collective:
        """The centre on a rank that only serves: ranks ``0 .. num_worker-1`` train, rank
        ``num_worker`` calls :func:`gradfleet.distributed.serve`."""
        world = dist.get_world_size()
        if group is not None or self.server_rank != num_worker or world != num_worker + 1:
            raise ValueError(
                f"{owner}: a dedicated centre rank must be rank num_worker={num_worker} of a "
                f"job of num_worker + 1 processes on the default group; got server_rank="
                f"{self.server_rank}, world size {world}"
                + (", a process_group" if group is not None else "")
            )
        if dist.get_rank() >= num_worker:
            raise ValueError(
                f"{owner}: rank {dist.get_rank()} is the dedicated centre: it calls "
                "gradfleet.distributed.serve() instead of building the optimizer"
            )
        self.dedicated = True
        return TorchCollective(None)

    def global_step_increment(self) -> int:
        return 1  # TF: global_step counts communications of all workers

    def setup(self, params: Sequence[torch.Tensor], comm: Collective) -> None:
        if self.worker is None:
            self.worker = comm.rank
        if self.address is None:
            group = getattr(comm, "group", None)
            if self.dedicated:  # the centre's rank learns the job from rank 0 (..serving)
                self._check_standby()  # before the server waits on this job's set-up
                spec = {
                    "kind": CENTRE, "server_rank": self.server_rank, "timeout": self.timeout,
                    "num_worker": self.num_worker, "standby": self.asked_standby(),
                    "layout": [
                        (list(p.shape), str(p.dtype).removeprefix("torch.")) for p in params
                    ],
                }  # fmt: skip
                announce(
                    spec, params, [self.server_rank], [list(range(len(params)))], self.num_worker
                )
            host = server_host(self.host, "AsyncCentre", group)  # collective over the group
            standby = self._standby_rank(group)
            if comm.rank == self.server_rank:
                self._server = CentreServer(
                    params, self.num_worker, self.timeout, keep_reads=standby is not None
                )
                self._hosted = HostedServer(
                    self._server, self._server.members, host, "EASGD centre"
                )
                self.address = self._hosted.address
            self.address = share_address(self.address, self.server_rank, group)
            if standby is not None:
                self._start_standby(standby, comm.rank, host, group)
        self._client = self._connect(self.address, self.server_rank)
        rejoin_as_standby = self._by_address and self.standby is True
        hello = self._client.call(
            "hello", worker=self.worker, shapes=[list(p.shape) for p in params]
        )
        if self.standby_address is None and hello.get("standby") is not None:
            # a process that joined by address: the standby the centre named
            self.standby_address, self.standby = hello["standby"], hello["standby_rank"]
        if self.standby_address is not None:  # x goes there too, on this link
            self._standby_client = self._connect(self.standby_address, self.standby)
        elif rejoin_as_standby:
            self._become_standby(params)
        with torch.no_grad():  # TF's init op: x := centre (the wrapper then caches c_loc := x)
            for p, c in zip(params, hello["centre"], strict=True):
                p.copy_(c)
        if self.synchronous:
            self._client.call("barrier", worker=self.worker)

    # ------------------------------------------------------------------ the standby
    def _standby_rank(self, group: Any) -> int | None:
        """The standby's rank (collective: every rank of the group, a dedicated centre's
        included, gathers the host names)."""
        self._check_standby()
        return standby_rank(self.asked_standby(), self.server_rank, range(self.num_worker), group)

    def asked_standby(self) -> int | bool:
        """``standby`` as given, or by default (None): on for a dedicated centre rank, whose
        standby costs about nothing (its workers send the copy on their own links), off for
        a centre on a worker rank (the worker beside the centre loses its loopback
        exchanges: docs/failures.md)."""
        return self.dedicated if self.standby is None else self.standby

    def _check_standby(self) -> None:
        if self.standby is None or isinstance(self.standby, bool):
            return
        if not 0 <= self.standby < self.num_worker or self.standby == self.server_rank:
            raise ValueError(
                f"AsyncCentre: standby must be a worker rank in [0, {self.num_worker}) other "
                f"than server_rank={self.server_rank}, got {self.standby}"
            )

    def _start_standby(self, rank: int, mine: int, host: str, group: Any) -> None:
        """Rank ``rank`` starts the standby from the server's centre, before any worker's
        hello; the server then forwards to it (collective over the group)."""
        self.standby = rank
        if mine == rank:
            server = MailboxClient(  # once, to read the centre it starts from
                self.address,
                f"easgd-standby{rank}",
                self.timeout,
                f"server rank {self.server_rank}",
            )
            centre = server.call("read", worker=self.worker)["centre"]
            self._standby_server = CentreServer(
                centre, self.num_worker, self.timeout, keep_reads=True
            )
            self._standby_hosted = HostedServer(
                self._standby_server, self._standby_server.members, host,
                f"EASGD centre (standby on rank {rank})", standby=True,
            )  # fmt: skip
            self.standby_address = self._standby_hosted.address
        self.standby_address = share_address(self.standby_address, rank, group)
        if self._hosted is not None and self._server is not None:
            self._hosted.forward_to(self.standby_address, rank, self.timeout)
        dist.barrier(group=group)  # no hello before the server forwards

    def _become_standby(self, params: Sequence[torch.Tensor]) -> None:
        """A restarted process (joined by ``address``) with ``standby=True``, whose centre has
        no standby (its own took over after a loss): serve an empty copy and ask the centre
        to take it as its standby; the centre's first copy is its whole state, so a second
        loss is survived as the first."""
        assert self._client is not None
        name = f"the EASGD centre's standby on rank {self.worker}"
        try:
            self._standby_server, self._standby_hosted = attach_centre_standby(
                self._client, params, num_worker=self.num_worker, timeout=self.timeout,
                host=self.host or env_server_host(), name=name, worker=self.worker,
                rank=self.worker,
            )  # fmt: skip
        except RuntimeError as exc:  # refused (the centre has a standby): a worker only
            log.warning("worker rank %s: not a standby: %s", self.worker, exc)
            return
        log.info("worker rank %s: %s, from the centre's live state", self.worker, name)

    def _connect(self, address: str, rank: int | bool | None) -> MailboxClient:
        return MailboxClient(
            address, f"easgd{self.worker}", self.timeout + 10.0, f"server rank {rank}"
        )

    def _call(self, op: str, worker: int | None = None, **fields: Any) -> dict[str, Any]:
        """One request to the centre (as ``worker``, default this one), sent again to the
        standby if the centre is lost."""
        assert self._client is not None, "setup() must run first"
        fields["worker"] = self.worker if worker is None else worker
        try:
            return self._client.call(op, **fields)
        except ServerUnreachable as exc:
            self._fail_over(exc)
            return self._client.call(op, **fields)

    def _fail_over(self, exc: ServerUnreachable) -> None:
        """The centre is lost: move to its standby (once), or raise ``exc``."""
        if self.standby_address is None or self.standby_address == self.address:
            raise exc
        log.warning(
            "worker rank %s: the EASGD centre on server rank %s is lost (%s); moving to its "
            "standby on rank %s", self.worker, self.server_rank, exc, self.standby,
        )  # fmt: skip
        lost = self.server_rank
        self.moved_from = int(lost)
        self.address, self.server_rank = self.standby_address, self.standby
        self._client, self._standby_client = self._connect(self.address, self.server_rank), None
        if isinstance(lost, int) and lost < self.num_worker and lost != self.worker:
            # the lost server's host took its worker with it: the new centre must not wait
            # for its done (a worker that is still alive counts again at its next request)
            self._client.call("done", worker=lost, forgotten=True)

    def exchange(self, params: Sequence[torch.Tensor], moving_rate: float) -> list[torch.Tensor]:
        assert self._client is not None, "setup() must run first"
        if self._read is None:  # buffers reused by every exchange (the wrapper's c_loc)
            self._read = [torch.empty_like(p, requires_grad=False) for p in params]
            self._diff = [torch.empty_like(p, requires_grad=False) for p in params]
        self._number += 1
        try:
            self._exchange_once(params, moving_rate)
        except ServerUnreachable as exc:
            self._fail_over(exc)  # then the same exchange again, under the same number
            self._exchange_once(params, moving_rate)
        with torch.no_grad():
            for p, r, d in zip(params, self._read, self._diff, strict=True):
                p.sub_(torch.sub(p, r, out=d), alpha=moving_rate)  # x -= alpha (x - c_loc)
        return self._read

    def _exchange_once(self, params: Sequence[torch.Tensor], moving_rate: float) -> None:
        """Read the centre into ``self._read`` and add this worker's pull to it."""
        assert self._client is not None and self._read is not None
        client = self._client
        # TF's read of the centre, then its assign_add: x goes out while c_read comes in (the
        # receive is posted before x is sent, so gloo can start c_read at once)
        x = [p.detach() for p in params]
        client.request("exchange_read", worker=self.worker, number=self._number)
        _, finish_read = client.begin_response(receive_into=self._read)
        # x is at the standby before the add leaves: the server never applies an add whose x
        # the standby could miss (this worker lost on the way), and a restarted worker's x
        # (its numbers start again) replaces any its earlier self left there
        sent = self._send_standby(x) and self._standby_answer()
        client.request(
            "exchange_add", worker=self.worker, alpha=moving_rate, number=self._number, params=x,
            standby=self.standby_address if sent else None,  # where x went too (if anywhere)
        )  # fmt: skip
        answer = finish_read()
        client.response()  # the centre has x: the parameters may change now
        for r, c in zip(self._read, answer["centre"], strict=True):
            copy_received(r, c)
        self._follow_standby(answer.get("standby"), answer.get("standby_rank"))

    def _follow_standby(self, address: str | None, rank: int | None) -> None:
        """The centre named a standby this worker does not send to (one attached since its
        hello, after a loss): send there from the next exchange on."""
        if address in (None, self.standby_address, self.address) or address in self._lost:
            return
        log.info("worker rank %s: the EASGD centre's standby is now on rank %s (%s)",
                 self.worker, rank, address)  # fmt: skip
        self.standby_address, self.standby = address, rank
        try:
            self._standby_client = self._connect(address, rank)
        except ServerUnreachable as exc:
            self._standby_lost(exc)

    def _send_standby(self, x: list[torch.Tensor]) -> bool:
        """Send x to the standby as well, on this worker's own link (:mod:`..hosting.standby`);
        a lost standby is dropped (the server goes on without it too)."""
        if self._standby_client is None:
            return False
        try:
            self._standby_client.request(
                DATA, worker=self.worker, number=self._number, fields=["params"], params=x
            )
            return True
        except ServerUnreachable as exc:
            self._standby_lost(exc)
            return False

    def _standby_answer(self) -> bool:
        """Whether the standby acknowledged the parameters sent to it."""
        assert self._standby_client is not None
        try:
            self._standby_client.response()
            return True
        except ServerUnreachable as exc:
            self._standby_lost(exc)
            return False

    def _standby_lost(self, exc: ServerUnreachable) -> None:
        log.warning("worker rank %s: the EASGD centre's standby on rank %s is lost: %s",
                    self.worker, self.standby, exc)  # fmt: skip
        if self.standby_address is not None:
            self._lost.add(self.standby_address)  # the centre may still name it a while
        self._standby_client, self.standby_address = None, None

    def centre(self) -> list[torch.Tensor]:
        return [c.clone() for c in self._call("read")["centre"]]

    def counters(self) -> dict[str, dict[int, int]]:
        """Server-side exchanges and (re)joins per worker."""
        reply = self._call("read")
        return {k: {int(w): n for w, n in reply[k].items()} for k in ("exchanges", "joins")}

    def worker_silence(self) -> dict[int, float]:
        """Seconds since the centre last heard from each worker that has not left."""
        report = self._call("members")
        return {int(w): float(s) for w, s in report["silence"].items()}

    def forget_workers(self, ranks: Sequence[int]) -> None:
        """Count the workers ``ranks`` as having left (dead for good): the server rank's
        :meth:`close` stops waiting for them at once.  A forgotten worker that comes back
        (``hello``) is counted again."""
        assert self._client is not None, "setup() must run first"
        bad = [r for r in ranks if not 0 <= int(r) < self.num_worker]
        if bad:
            raise ValueError(
                f"AsyncCentre.forget_workers: ranks must be in [0, {self.num_worker}), got {bad}"
            )
        for r in ranks:
            self._call("done", worker=int(r), forgotten=True)

    @property
    def bytes_sent(self) -> int:
        return self._client.bytes_out if self._client is not None else 0

    # ------------------------------------------------------------------ checkpoints / end
    def state_dict(self) -> dict[str, Any]:
        return {"centre": [c.clone() for c in self.centre()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """On the rank that hosts the centre (the server's, or the standby's once it took
        over): restore the centre (the standby gets it too); elsewhere only check the
        shapes."""
        current = self.centre()
        values = state["centre"]
        if [tuple(v.shape) for v in values] != [tuple(c.shape) for c in current]:
            raise ValueError("ElasticAverageOptimizer.load_state_dict: centre shapes differ")
        if self.worker == self.server_rank:
            self._call("load", centre=values)

    def close(self) -> None:
        """Leave; the server rank (and the standby's) keeps serving until every worker (also
        one that has not said hello yet) left or has been silent for ``timeout`` seconds, so
        call it at the end of training on every worker."""
        if self._client is not None:
            try:
                self._call("done", timeout=5.0)
            except Exception as exc:  # leaving must not fail: the server may have stopped
                log.info("worker rank %s: EASGD centre gone before its done: %s", self.worker, exc)
            for client in {self._client, self._standby_client} - {None}:
                client.close()
            self._client = self._standby_client = None
        for hosted in (self._hosted, self._standby_hosted):
            if hosted is not None:
                hosted.close(time.monotonic() + self.timeout)
        self._hosted = self._standby_hosted = None


CENTRE_MODES[AsyncCentre.mode] = AsyncCentre
