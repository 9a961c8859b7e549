"""SyncReplicas through servers: the chief alone, or shards over several ranks.

:class:`ServerExchange` joins the three folders for one worker: the parameters' layout over
the shards (:class:`~.layout.shard_layout.ShardLayout`), the servers this rank hosts
(:class:`~.server.servers.SyncServers`), and the worker's side (:mod:`.worker`): its links to
every server, chosen once -- TF's protocol for one server
(:class:`~.worker.plain_links.PlainLinks`), reading ahead for several shards
(:class:`~.worker.ahead_links.ReadAheadLinks`), both over the same
:class:`~.worker.shard_clients.ShardClients` -- the worker's
:class:`~.worker.error_latch.ErrorLatch`, and the two policies over a step: overlap's gradient
hooks (:class:`~.worker.overlap.ShardReadiness`) and streamed reads
(:class:`~.worker.streaming.StreamedReads`).  A step, from ``step()`` to the wire::

    ServerExchange.step -> links.push (every shard's gradients; the token request)
                        -> links.token_and_reads (the token; the step's pending reads)
    the step's reads:   waited for in step(), or held for the next forward (streamed)

TF's worker train op: push ``(local_step, grads)``, dequeue a token (``local_step := token``),
read the variables.  Beyond TF: a non-finite gradient in a sharded job is pushed as stale to
every shard (``nonfinite="raise"``/``"drop"``: no shard applies part of a rejected set).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..hosting.dedicated import HyperparameterPusher, announce, sync_spec
from ..hosting.hosted_server import env_server_host, gather_addresses, server_host, share_address
from ..hosting.server_directory import ServerDirectory, job_directory
from ..hosting.standby import standby_ranks
from ..hosting.sync_servers import SyncServers, start_standby
from ..transport import ServerUnreachable
from .common.finite import all_finite_list
from .common.job import Job
from .common.outcome import Outcome
from .layout.shard_layout import ShardLayout
from .worker.ahead_links import ReadAheadLinks
from .worker.error_latch import ErrorLatch
from .worker.overlap import ShardReadiness
from .worker.pending_step import Step
from .worker.plain_links import PlainLinks
from .worker.shard_clients import ShardClients
from .worker.streaming import StreamedReads

__all__ = ["ServerExchange", "as_addresses"]

log = logging.getLogger(__name__)

_OWNER = "SyncReplicasOptimizer"
Grads = list[torch.Tensor | None]
# this process's n-th exchange: the name of its servers' directory, alike on every rank (each
# builds its optimizers in the same order, a restarted process too)
_MADE = itertools.count(1)


class ServerExchange:
    """SyncReplicas with servers for one worker (module docstring).

    ``ranks``: the server ranks (shard ``k`` on ``ranks[k]``; the first is the chief);
    ``given``: the running servers' addresses, for a process outside the process group;
    ``settle(accepted, global_step)``: records a streamed step's verdict in the books."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        job: Job,
        *,
        worker: int,
        ranks: list[int],
        shard_assignment: str,
        overlap: bool,
        host: str | None,
        given: list[str] | None,
        settle: Callable[[bool, int], None],
    ) -> None:
        self.optimizer, self.job, self.worker, self.ranks = optimizer, job, worker, ranks
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.dedicated = sorted({r for r in ranks if r >= job.N})  # ranks that only serve
        if job.global_step and self.dedicated:
            raise ValueError(
                f"{_OWNER}: global_step={job.global_step} with dedicated server ranks "
                f"{self.dedicated} is not supported (they start at 0; restart them with "
                "serve(state=...))"
            )
        # dedicated servers, and a replicated chief, take the hyperparameters from the pushes
        self.hyper = HyperparameterPusher(optimizer, bool(self.dedicated) or bool(job.standby))
        self.layout = ShardLayout(optimizer, shard_assignment, job.ema, ranks)
        self.servers: SyncServers | None = None
        self.standby: int | None = None  # the chief's standby's rank
        # where the replicated servers are now, for those that find one lost before an
        # answer named where it went (none without standbys)
        self.directory: ServerDirectory | None = None
        self._directory_name: str | None = None
        if job.standby is not False and job.standby is not None:
            self._directory_name = f"sync/{next(_MADE)}"
            self.directory = job_directory(
                self._directory_name, joining=given is not None, timeout=job.timeout
            )
        self.is_chief = given is None and worker == ranks[0]
        self.server_addresses = self._start_servers(host) if given is None else list(given)
        self.server_address = self.server_addresses[0]
        self.settle = settle
        self.latch = ErrorLatch(worker)  # its threads' errors, raised at the step boundary
        clients = ShardClients(
            self.server_addresses, ranks, worker, job.timeout, job.N, self.directory
        )
        self.clients = clients
        targets, load = self.layout.shard_params, self.layout.load_shard
        self.links: PlainLinks | ReadAheadLinks | None
        take_answers = None
        # several shards: each answers its push with its new values (read-ahead), unless they
        # are replicated: TF's protocol then, whose every step a worker can send again whole
        if len(clients) > 1 and not job.standby:
            ahead = ReadAheadLinks(clients, targets, load, self.latch)
            self.links, take_answers = ahead, ahead.start_taking
        else:
            self.links = PlainLinks(clients, targets, load)
        shards = [self.layout.shard_params(k) for k in range(len(self.layout))]
        self.start_step, values = clients.hello(shards)  # TF's local_step_init_op
        for k, shard_values in values.items():
            self.layout.load_shard(k, shard_values)
        if given is not None and job.standby is True:
            self._become_standby(host)
        # the last step, while its values are still coming in (streamed reads), and this
        # worker's part of its verdict
        self._pending: Step | None = None
        self._own = True
        self.streamed = StreamedReads(
            self.layout.shards_of, self.index, worker, self.wait_reads, take_answers
        )
        self.readiness: ShardReadiness | None = None
        if overlap:
            self.readiness = ShardReadiness(
                self.params, self.layout.owners, self.layout.shards_of, self._push_early, _OWNER
            )
        self._extra: dict[str, Any] | None = None  # what this step's pushes carry
        self._local_step = self.start_step
        self._replicas: int | None = clients.replicas

    def _start_servers(self, host: str | None) -> list[str]:
        """Start the servers this rank hosts, tell every rank their addresses (collective)."""
        placement = self.layout.placement
        if self.dedicated:  # they learn the job from rank 0 (see ..serving)
            spec = sync_spec(self.params, self.optimizer, self.job, placement, self._directory_name)
            announce(
                spec, self.layout.views(self.params), placement.ranks, placement.parts, self.job.N
            )
        host = server_host(host, _OWNER)  # collective: every rank of the group calls it
        # each server's standby (collective where one is asked for: the ranks' hosts)
        standbys = standby_ranks(self.job.standby, placement.ranks, range(self.job.N))
        if self.worker in placement.ranks or self.worker in standbys:
            self.servers = SyncServers(
                self.optimizer, self.job, placement, self.worker, host, standbys=standbys,
                directory=self.directory,
            )  # fmt: skip
        mine = self.servers.addresses() if self.servers is not None else {}
        if len(placement.ranks) == 1:  # one server: its rank tells the others
            addresses = {0: share_address(mine.get(0), placement.ranks[0])}
        else:
            addresses = gather_addresses(mine)
        if self.servers is not None:
            self.servers.connect(addresses)
        self.standby = standbys[0]
        start_standby(self.servers, standbys, addresses)
        return [addresses[k] for k in range(len(placement.ranks))]

    def _become_standby(self, host: str | None) -> None:
        """A restarted process that joined by address with ``standby=True``: for each server
        that has no standby (its own took over after a loss, or was lost: the chief, or a
        shard this rank held or stood by for), serve a copy and ask the server to take it;
        its first copy is its whole state (a live peer's, never a checkpoint file), so a
        second loss is survived as the first.  A server that refuses (it has a standby
        again) keeps its own: for it this process is a worker only."""
        # a standby a server names on this very rank was this process's earlier self, lost
        # with it (the server may not have found out yet): this process takes its place
        for k, (_, rank) in list(self.clients.standbys.items()):
            if rank == self.worker:
                self.clients.standby_lost(
                    k, ServerUnreachable("lost with this rank's last process")
                )
        missing = [k for k in range(len(self.server_addresses)) if k not in self.clients.standbys]
        if not missing:
            return
        servers = SyncServers(
            self.optimizer, self.job, self.layout.placement, self.worker,
            host or env_server_host(), standby_of=missing, directory=self.directory,
        )  # fmt: skip
        chief_standby = self.clients.standby
        taken = servers.rejoin(
            self.server_addresses, chief_standby[0] if chief_standby is not None else None
        )
        if not taken:
            servers.close(time.monotonic())
            return
        what = (
            "the chief's standby, from its live state" if taken == [0]
            else f"the standby of shard(s) {taken} (0: the chief), from their live state"
        )  # fmt: skip
        log.info("worker rank %d: %s", self.worker, what)
        self.servers = servers
        for k, address in servers.standby_addresses().items():
            self.clients.follow_standby(address, self.worker, k)

    # ----------------------------------------------------------------- the step
    def _open_links(self) -> PlainLinks | ReadAheadLinks:
        if self.links is None:
            raise RuntimeError(f"{_OWNER}: the optimizer is closed")
        return self.links

    def step(self, local_step: int, grads: Grads, stream: bool = True) -> Outcome:
        """Push ``grads`` tagged ``local_step``, take a token, read the variables (streamed,
        unless ``stream`` is False: left to the next forward)."""
        links = self._open_links()
        self.wait_reads()
        self.latch.raise_if_failed()  # a thread's error since the last step boundary
        self._local_step = local_step
        # what every push of this step carries is decided once, by its first push (overlap's
        # may leave during backward), and forgotten when the step ends
        try:
            try:
                return self._step_once(local_step, grads, stream)
            except ServerUnreachable as exc:  # a server is lost: to its standby, if any
                lost = exc
            # the same step again, under the same number (never applied twice); a host that
            # held several servers (its shard and one it took over) is found lost once per
            # server: each moves to its standby (fail_over raises where one has none)
            for _ in range(len(self.clients)):
                self.clients.fail_over(lost)
                links.reset()
                self.server_addresses = list(self.clients.addresses)
                self.server_address = self.server_addresses[0]
                try:
                    accepted = links.push(local_step, self.layout.grad_parts(grads),
                                          self._extras())  # fmt: skip
                    return self._finish_step(local_step, accepted, stream)
                except ServerUnreachable as again:
                    lost = again
            raise lost
        except ServerUnreachable as exc:
            decided = self.latch.decide(f"step {local_step}", exc)
            if decided is exc:
                raise
            raise decided from exc
        finally:
            self._extra = None
            self.clients.number += 1  # (a step sent again keeps its number)

    def _step_once(self, local_step: int, grads: Grads, stream: bool) -> Outcome:
        links = self._open_links()
        if self.readiness is not None:
            try:
                return self._overlapped_step(grads, stream)
            finally:
                self.readiness.reset()
        tag = local_step
        judged_apart = len(self.layout) > 1 and self.job.nonfinite != "apply"
        if judged_apart and not all_finite_list(grads):
            log.warning(
                "worker rank %d: non-finite gradient, pushed as stale to every shard (the "
                "shard holding it reports it)", self.worker,
            )  # fmt: skip
            tag = -1
        accepted = links.push(tag, self.layout.grad_parts(grads), self._extras())
        return self._finish_step(tag, accepted, stream)

    def _finish_step(self, tag: int, accepted: bool, stream: bool) -> Outcome:
        """Take the token (answers to the pushes meanwhile), then the shards' values, each
        loaded as its reply arrives; with streamed reads a step whose values are still coming
        is held for the next forward (:meth:`wait_reads`), its verdict decided then."""
        links = self._open_links()
        own = accepted and tag == self._local_step
        step = links.token_and_reads(tag)
        if stream and self.streamed.on and step.left:
            self._pending, self._own = step, own
            token = step.token
            outcome = Outcome(None, int(token["token"]), int(token["global_step"]))
        else:
            token = step.finish()
            accepted = bool(token["accepted"]) and own
            outcome = Outcome(accepted, int(token["token"]), int(token["global_step"]))
        self._replicas = token.get("r", self._replicas)  # the R of the update it may join
        self._local_step = outcome.local_step  # the tag of the pushes backward makes next
        return outcome

    def _extras(self) -> dict[str, Any]:
        """What every push of this step carries (changed hyperparameters), decided once."""
        if self._extra is None:
            hyper = self.hyper.changed()
            self._extra = {} if hyper is None else {"hyper": hyper}
            if self.job.policy is not None and self._replicas is not None:
                self._extra["r"] = int(self._replicas)
        return self._extra

    def _push_early(self, shards: list[int]) -> None:
        """Overlap: a gradient hook found ``shards`` complete: push them now (shard 0 with
        the token request).  The answers are taken from ``step()`` on; with streamed reads at
        once, so these shards' values may land while backward computes the earlier layers."""
        if self.links is None:
            return  # closed: the step will say so
        self.wait_reads()  # the last step's streamed reads use the links and parameters
        jobs = {}
        for k in shards:
            whole: Grads = [None] * len(self.params)
            for j in self.layout.parts[k]:  # only this shard's parameters: once per shard
                i = self.layout.pieces[j].index
                g = self.params[i].grad
                whole[i] = None if g is None else g.detach()
            jobs[k] = self.layout.shard_grads(k, whole)
        self.links.push_early(jobs, self._local_step, self._extras())
        self.streamed.pushed_early()

    def _overlapped_step(self, grads: Grads, stream: bool) -> Outcome:
        """Push the shards backward did not complete (``grads``), then the token and read.
        No bad-input tagging here: ``check_overlap`` allows overlap only where each shard
        judges its own gradients (one shard, or ``nonfinite="apply"``)."""
        links = self._open_links()
        assert self.readiness is not None
        tag, sent = self._local_step, self.readiness.sent
        log.debug("worker rank %d: shards %s pushed during backward", self.worker, sorted(sent))
        parts = self.layout.grad_parts(grads)
        rest = {k: part for k, part in enumerate(parts) if k not in sent}
        links.push_rest(rest, tag, self._extras() if rest else {})
        return self._finish_step(tag, True, stream)

    def check_own_gradients(self) -> None:
        """``apply_gradients`` brings gradients of its own: not after backward pushed some."""
        if self.readiness is not None and self.readiness.sent:
            raise RuntimeError(
                f"{_OWNER}.apply_gradients: with overlap=True backward already pushed shards "
                f"{sorted(self.readiness.sent)} from .grad; use step(), or overlap=False to "
                "push gradients of your own"
            )

    # ----------------------------------------------------------------- streamed reads
    def stream_reads(self, model: torch.nn.Module) -> None:
        self.streamed.stream_reads(model)

    def wait_reads(self, shards: Iterable[int] | None = None) -> None:
        """Until the last step's values of ``shards`` (None: all) are loaded; once every
        shard's are, its verdict goes to the books (``settle``).  Nothing to do unless the
        step was held for streamed reads."""
        step = self._pending
        if step is None:
            return
        if shards is not None:
            step.wait(shards)
            if step.left:
                return
        try:
            result = step.finish()
        except ServerUnreachable as exc:
            decided = self.latch.decide("the streamed reads", exc)
            if decided is exc:
                raise
            raise decided from exc
        finally:
            self._pending = None
        self.settle(bool(result["accepted"]) and self._own, int(result["global_step"]))

    @property
    def streaming(self) -> bool:
        """Does ``step()`` leave the reads to the next forward (:meth:`stream_reads`)?"""
        return self.streamed.on

    @property
    def reads_pending(self) -> bool:
        """Are values of the last step still coming in (streamed reads)?"""
        return self._pending is not None

    @property
    def reads_ahead(self) -> bool:
        """Does each shard answer this worker's push with its values (several shards)?"""
        return self.streamed.streamable

    # ----------------------------------------------------------------- questions
    def _settled_links(self, what: str) -> PlainLinks | ReadAheadLinks:
        """The links, once the last step's streamed reads are in (they share the links)."""
        if self.links is None:
            raise RuntimeError(f"{_OWNER}.{what}: the optimizer is closed")
        self.wait_reads()
        return self.links

    def _ask(self, what: str, shard: int, op: str) -> dict[str, Any]:
        """Shard ``shard``'s answer to the query ``op`` (``what``: the asking method)."""
        links = self._settled_links(what)
        if shard not in links.clients:
            raise ValueError(f"{_OWNER}.{what}: no shard {shard!r}")
        links.check_idle(op)
        return links.clients.call(shard, op)

    def replicas_history(self) -> list[int]:
        """The R of every update made so far (the chief's record)."""
        return [int(r) for r in self._ask("replicas_history", 0, "stats")["replicas"]]

    def worker_counters(self, shard: int = 0) -> dict[int, dict[str, int]]:
        stats = self._ask("worker_counters", shard, "stats")["stats"]
        return {int(k): v for k, v in stats.items()}

    def averaged_variables(self) -> list[torch.Tensor | None]:
        chief = self.servers.chief if self.servers is not None else None
        if len(self.layout) == 1 and chief is not None:
            if chief.ema is None:
                raise RuntimeError(f"{_OWNER}: no variable_averages here (read them on the chief)")
            return [chief.ema.shadows.get(i) for i in range(len(self.params))]
        links = self._settled_links("averaged_variables")
        links.check_idle("ema")
        replies = links.clients.call_all("ema").values()
        pairs = [p for reply in replies for p in reply["shadows"]]
        found = {int(i): s for i, s in pairs}
        return [found.get(i) for i in range(len(self.params))]

    @property
    def bytes_sent(self) -> int:
        return self.links.bytes_out if self.links is not None else 0

    @property
    def withheld_pushes(self) -> int:
        return self.links.clients.withheld if self.links is not None else 0

    def worker_silence(self) -> dict[int, float]:
        report = self._ask("worker_silence", 0, "members")
        return {int(w): float(s) for w, s in report["silence"].items()}

    def forget_workers(self, ranks: Sequence[int]) -> None:
        self._settled_links("forget_workers").clients.forget(ranks)

    # ----------------------------------------------------------------- checkpoints
    @property
    def _chief(self) -> Any:
        return self.servers.chief if self.servers is not None else None

    @property
    def _hosted(self) -> dict[int, Any]:
        return self.servers.shards if self.servers is not None else {}

    def state(self) -> dict[str, Any]:
        """The servers' part of this rank's checkpoint: the chief's (``"server"``) and,
        sharded, the other shards this rank hosts (``"shards"``)."""
        self.wait_reads()
        state: dict[str, Any] = {
            "server": self._chief.state_dict() if self._chief is not None else None
        }
        if len(self.ranks) > 1:  # unsharded checkpoints keep their old layout
            state["shards"] = {k: srv.shard.state_dict() for k, (srv, _) in self._hosted.items()}
        return state

    def check_state(self, counters: dict[str, Any]) -> None:
        if counters.get("allreduce") is not None:
            raise ValueError(
                f"{_OWNER}.load_state_dict: the checkpoint is of the all-reduce exchange "
                "(transport='allreduce'), this optimizer has servers"
            )
        if (counters["server"] is None) != (self._chief is None):
            raise ValueError(f"{_OWNER}.load_state_dict: load the chief's checkpoint on the chief")
        if set(counters.get("shards", {})) != set(self._hosted):
            raise ValueError(
                f"{_OWNER}.load_state_dict: checkpoint holds shards "
                f"{sorted(counters.get('shards', {}))}, this rank hosts {sorted(self._hosted)} "
                "(load each server rank's own checkpoint, same server_ranks)"
            )

    def load_state(self, state: dict[str, Any]) -> None:
        self.wait_reads()
        self._local_step = int(state["local_step"])
        if self._chief is not None:
            self._chief.load_state_dict(state["server"])
        for k, shard_state in state.get("shards", {}).items():
            self._hosted[int(k)][0].shard.load_state_dict(shard_state)
        if self.links is not None:  # the next step reloads the variables from the server(s)
            self.links.clients.forget_versions()

    def applied_state(self) -> tuple[Any, dict[int, Any], int] | None:
        """The chief's optimizer copy and variables with one server; None elsewhere (a plain
        worker, or any rank of a sharded job, whose variables are spread over the shards)."""
        chief = self._chief
        if chief is None or len(self.ranks) > 1:
            return None
        variables = dict(zip(chief.shard.indices, chief.params, strict=True))
        return chief.opt, variables, int(chief.global_step)

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Leave: tell every server; a server rank keeps serving until every worker (also one
        that has not said hello yet) left or has been silent for ``timeout`` seconds, then
        stops its servers (shards, then chief)."""
        try:
            self.wait_reads()
        except Exception as exc:  # leaving must not fail: the step's error was the user's
            log.info("worker rank %d: streamed reads failed at close: %s", self.worker, exc)
        self.streamed.remove_hooks()
        if self.readiness is not None:
            self.readiness.remove()
            self.readiness = None
        if self.links is not None:
            # leaving because a server is gone: the chief tells the workers still waiting that
            # cause, not that this worker left (which made their update unfillable)
            lost = self.latch.last_raised
            self.links.leave(str(lost) if isinstance(lost, ServerUnreachable) else None)
            self.links = None
        if self.servers is not None:
            self.servers.close()


def as_addresses(server_address: str | Sequence[str] | None) -> list[str] | None:
    """``server_address`` (one, or the shards' list) as a list; None inside the job."""
    if server_address is None:
        return None
    return [server_address] if isinstance(server_address, str) else list(server_address)
