"""Rank functions for the tests of the SyncReplicas chief's standby (``test_chief_standby``).

Every worker records each gradient it pushes (its tag) and whether it was accepted, so that
the test can replay the updates actually made in float64 (:func:`replay`).  The chief's rank
records its own worker's gradients in a file before each push: it may be killed."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gradfleet.distributed import ParameterServer, SyncReplicasOptimizer
from gradfleet.distributed.testing import RankContext
from tests.distributed.sync_ranks import _die, _joined, loss_of, make_model

LR = 0.1


def sgd(groups):
    return torch.optim.SGD(groups, lr=LR)


def _cut(ctx: RankContext, cut: str, lost_at: int, op: str = "step", worker: int = 2) -> None:
    """Make this (a server's) rank die at worker ``worker``'s request ``op`` (the chief's step
    request, a shard's push) number ``lost_at``: once its standby has handled the copy and
    before the answer leaves (``"applied"``), or before the copy leaves, the server having
    handled the request alone (``"unsent"``)."""
    from gradfleet.distributed.hosting import standby

    def lost(fields: dict) -> bool:
        return fields.get("worker") == worker and fields.get("number") == lost_at

    if cut == "applied":  # in the forwarder, after the standby's acknowledgement
        init = standby.Forwarder.__init__

        def init_then_watch(self, *args, **kwargs):
            init(self, *args, **kwargs)
            call = self.client.call

            def call_then_die(what, **fields):
                out = call(what, **fields)
                if any(c["copy_of"] == op and lost(c) for c in fields.get("copies", [])):
                    _die(ctx)
                return out

            self.client.call = call_then_die

        standby.Forwarder.__init__ = init_then_watch
    elif cut == "unsent":  # handled here, never forwarded
        from gradfleet.distributed.hosting import hosted_server

        handle = hosted_server.HostedServer._handle

        def handle_then_die(self, msg, reply):
            if msg["op"] == op and lost(msg) and self.forwarder is not None:
                self.machine.handle(msg, reply)  # the chief applies it; its copy never leaves
                _die(ctx)
            return handle(self, msg, reply)

        hosted_server.HostedServer._handle = handle_then_die


def _train(
    ctx: RankContext,
    model: torch.nn.Module,
    opt: SyncReplicasOptimizer,
    last_step: int,
    keep: Path | None = None,
) -> list[tuple[int, torch.Tensor, bool | None]]:
    """Train until ``last_step``: each step's tag, gradient and verdict, for :func:`replay`.
    ``keep``: where the records go before each step (a rank that may die in it; its last
    verdict is then unknown)."""
    records: list[tuple[int, torch.Tensor, bool | None]] = []
    count = 0
    while opt.global_step < last_step:
        opt.zero_grad()
        loss_of(model, ctx.rank, count).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        tag = opt.local_step
        if keep is not None:
            torch.save(records + [(tag, grads, None)], keep)
        opt.step()
        records.append((tag, grads, opt.last_gradient_accepted))
        count += 1
        time.sleep(0.01 * ctx.rank)  # workers at different paces: different R-sets
    return records


def chief_lost(
    ctx: RankContext,
    R: int,
    last_step: int,
    lost_at: int,
    cut: str,
    save_to: str,
    dedicated: bool = False,
    auto: bool = False,
) -> dict:
    """R of N workers train with plain SGD to ``last_step``; the chief is on rank 0 (its
    standby chosen: rank 1), or with ``dedicated`` on the last rank, which only serves (its
    standby: rank 0).  ``auto``: ``replicas_to_aggregate="auto"`` with ``standby=True``
    instead of a fixed R (the chief chooses each R from its clock; the standby takes them).
    ``lost_at`` > 0: the chief's rank is SIGKILLed at worker 2's step request of that number
    (:func:`_cut`).  ``lost_at=0``: no loss; the chief's rank and its
    standby's return their copies' state for a bit-for-bit comparison."""
    N = ctx.world_size - 1 if dedicated else ctx.world_size
    chief_rank = N if dedicated else 0
    if ctx.rank == chief_rank and lost_at:
        _cut(ctx, cut, lost_at)
    if dedicated and ctx.rank == chief_rank:
        server = ParameterServer(sgd)
        _joined(ctx)
        server.join()
        assert server._sync is not None and server._sync.chief is not None
        return _chief_state(server._sync.chief)
    model = make_model()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = SyncReplicasOptimizer(
        sgd(model.parameters()), "auto" if auto else R, N, timeout=30, last_step=last_step,
        transport="server", server_rank=chief_rank, standby=True if auto else None,
    )  # fmt: skip
    standby = opt.exchange.standby
    _joined(ctx)
    mine = Path(save_to) / f"rank{ctx.rank}.pt"  # it may die in a step: its records first
    records = _train(ctx, model, opt, last_step, mine if ctx.rank == chief_rank else None)
    out = {
        "records": records,
        "initial": initial,
        "final": [p.detach().clone() for p in model.parameters()],
        "global_step": opt.global_step,
        "standby": standby,
        "moved_from": opt.exchange.clients.moved_from,
        "withheld": opt.exchange.clients.withheld,  # pushes without gradients
    }
    ctx.signal("trained")  # the states are read once every live worker is done
    for r in range(N):
        if r != chief_rank or not lost_at:
            ctx.wait_signal(r, "trained", timeout=60)
    servers = opt.exchange.servers
    if servers is not None and servers.chief is not None and not lost_at:
        out |= _chief_state(servers.chief)
    if servers is not None and servers.standby_chief is not None:
        out["standby_state"] = _chief_state(servers.standby_chief)
        assert servers.standby_server is not None and servers.standby_server.standby is not None
        out["paired"] = servers.standby_server.standby.paired
        out["promoted"] = servers.standby_server.standby.promoted
        out["given"] = servers.standby_chief.shard.given_updates
        out["local_reads"] = servers.standby_server.local_reads
    opt.close()
    # a worker that had made its last step before the loss (a slow worker 2 is killed at a
    # step the others are already past) moves to the standby when it leaves
    out["moved_from"] = opt.exchange.clients.moved_from
    return out


def shard_lost(ctx: RankContext, last_step: int, lost: int, lost_at: int, cut: str,
               save_to: str) -> dict:  # fmt: skip
    """N = 3 workers in lockstep (R = N: every gradient joins its update on every shard) with
    plain SGD, the variables in two shards on dedicated ranks (3: the chief, 4: shard 1), each
    with a standby chosen for the job (the chief's on rank 0, shard 1's on rank 1).  Server
    rank ``lost`` is SIGKILLed at worker 2's request number ``lost_at`` to it (the chief's
    step request, shard 1's push; :func:`_cut`), or with ``lost_at=0`` nothing is lost."""
    N = 3
    if ctx.rank == lost and lost_at:
        _cut(ctx, cut, lost_at, "step" if lost == N else "push")
    if ctx.rank >= N:
        server = ParameterServer(sgd)
        _joined(ctx)
        server.join()
        return {"served": True}
    model = make_model()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = SyncReplicasOptimizer(
        sgd(model.parameters()), N, N, timeout=30, last_step=last_step, transport="server",
        server_ranks=[3, 4], standby=True,
    )  # fmt: skip
    standbys = {k: v[1] for k, v in opt.exchange.clients.standbys.items()}
    _joined(ctx)
    records = _train(ctx, model, opt, last_step)
    out = {
        "records": records,
        "initial": initial,
        "final": [p.detach().clone() for p in model.parameters()],
        "global_step": opt.global_step,
        "standbys": standbys,
        "moved": dict(opt.exchange.clients.moved),
    }
    ctx.signal("trained")
    for r in range(N):
        ctx.wait_signal(r, "trained", timeout=60)
    servers = opt.exchange.servers
    if servers is not None:
        out |= _standby_shards(servers)
        if servers.standby_chief is not None:
            out["chief"] = _chief_state(servers.standby_chief)
            assert servers.standby_server is not None and servers.standby_server.standby
            out["chief"]["promoted"] = servers.standby_server.standby.promoted
    opt.close()
    return out


def worker_with_a_shard_lost(
    ctx: RankContext,
    last_step: int,
    lost_at: int,
    cut: str,
    replicas: int | str = 2,
    lost: int = 1,
) -> dict:
    """N = 3 workers, R = 2 (or chosen per update), the variables in two shards on the
    workers (the chief on rank 0, shard 1 on rank 1), each with a standby chosen for the job
    (both on rank 2).  Rank ``lost`` -- a worker and a server: shard 1's (rank 1), or the
    chief's (rank 0) -- is SIGKILLed at its own request number ``lost_at`` to its server (a
    push; the chief's step request) (:func:`_cut`): its gradient of that step may be in one
    shard's update and not the other's.  The survivors must go on to ``last_step`` all the
    same."""
    N = 3
    if ctx.rank == lost:
        _cut(ctx, cut, lost_at, "push" if lost else "step", worker=lost)
    model = make_model()
    opt = SyncReplicasOptimizer(
        sgd(model.parameters()), replicas, N, timeout=30, last_step=last_step,
        transport="server", server_ranks=[0, 1], standby=True,
    )  # fmt: skip
    standbys = {k: v[1] for k, v in opt.exchange.clients.standbys.items()}
    _joined(ctx)
    _train(ctx, model, opt, last_step)
    out = {
        "final": [p.detach().clone() for p in model.parameters()],
        "global_step": opt.global_step,
        "standbys": standbys,
        "moved": dict(opt.exchange.clients.moved),
    }
    ctx.signal("trained")
    for r in set(range(N)) - {lost}:
        ctx.wait_signal(r, "trained", timeout=60)
    servers = opt.exchange.servers
    if servers is not None:
        out |= _standby_shards(servers)
        if servers.chief is not None:
            out["chief"] = _chief_state(servers.chief)
        if servers.standby_chief is not None:
            assert servers.standby_server is not None and servers.standby_server.standby
            out["chief copy"] = _chief_state(servers.standby_chief)
            out["chief copy"]["promoted"] = servers.standby_server.standby.promoted
        for k, (server, _) in servers.shards.items():
            out[f"shard{k} server"] = {
                "stats": {int(w): dict(v) for w, v in server.shard.aggregator.stats.items()},
                "lowered": server.lowered,
            }
    opt.close()
    return out


def _standby_shards(servers) -> dict:
    """``{"shard<k>": ...}``: each shard copy this rank holds, its variables and counters."""
    out = {}
    for k, (server, hosted) in servers.standby_shards.items():
        assert hosted.standby is not None
        out[f"shard{k}"] = {
            "indices": list(server.shard.indices),
            "params": [p.detach().clone() for p in server.shard.params],
            "stats": {int(w): dict(v) for w, v in server.shard.aggregator.stats.items()},
            "step": server.shard.step,
            "promoted": hosted.standby.promoted,
            "paired": hosted.standby.paired,
            "given_updates": server.shard.given_updates,
        }
    return out


def _chief_state(chief) -> dict:
    state = chief.state_dict()
    return {
        "global_step": chief.global_step,
        "params": [p.detach().clone() for p in chief.params],
        "slots": state["optimizer"],
        "stats": {int(w): dict(v) for w, v in chief.aggregator.stats.items()},
        "resent": dict(chief.resent),
        "history": list(chief.history),  # each update's R
        "choice": chief.choice.live_state(),
    }


def replay(
    initial: list[torch.Tensor],
    records: dict[int, list[tuple[int, torch.Tensor, bool | None]]],
    R: int | list[int],
    last_step: int,
) -> tuple[list[torch.Tensor], dict[int, int]]:
    """The variables after the updates ``records`` made (float64, from the spec: update ``t``
    averages the R gradients accepted with tag ``t`` and takes an SGD step; ``R``: each
    update's, or one for all), and each worker's accepted count.  A record whose verdict is
    unknown (``None``: its worker died) was accepted iff its update needs it to have R."""
    flat = torch.cat([p.reshape(-1) for p in initial]).clone()
    accepted = dict.fromkeys(records, 0)
    each = [R] * last_step if isinstance(R, int) else list(R)
    assert len(each) == last_step, f"{len(each)} R for {last_step} updates"
    for t, r in enumerate(each):
        known = [(w, g) for w, rs in records.items() for tag, g, ok in rs if tag == t and ok]
        unknown = [
            (w, g) for w, rs in records.items() for tag, g, ok in rs if tag == t and ok is None
        ]
        taken = known + unknown[: r - len(known)]
        assert len(taken) == r, f"update {t + 1}: {len(taken)} gradients, want {r}"
        for w, _ in taken:
            accepted[w] += 1
        mean = (taken[0][1] + taken[1][1]) / 2 if r == 2 else sum(g for _, g in taken) / r
        flat.add_(mean, alpha=-LR)
    out, start = [], 0
    for p in initial:
        out.append(flat[start : start + p.numel()].reshape(p.shape))
        start += p.numel()
    return out, accepted


def chief_second_loss(ctx: RankContext, last_step: int, save_to: str, told: bool = True) -> dict:
    """R = 2 of N = 3 workers (ranks 0-2), the chief on rank 0 and its standby on rank 1.
    Rank 0 is SIGKILLed after 4 steps; ranks 1 and 2 move to the standby.  Rank 3, a restarted
    worker 0, joins the new chief by address with ``standby=True``: it becomes its standby
    from its live state.  Once worker 2 sends its gradients there too, rank 1 is killed as
    well, and ranks 2 and 3 finish on rank 3's copy.  Every rank's records go to a file
    before each push (two ranks die), for :func:`replay`.

    ``told=False``: worker 2 has no answer naming rank 3's copy when rank 1 dies -- it waits
    from its move to rank 1 until rank 1 is dead, and rank 3 attaches only once it waits,
    rank 1 dies as soon as its record in the job's directory names rank 3 -- so it finds
    rank 3's copy through the directory alone (before it, the job stopped there)."""
    from tests.distributed.sync_ranks import _wait_dead

    N, R = 3, 2
    folder = Path(save_to)
    (folder / f"pid-{ctx.rank}").write_text(str(os.getpid()))
    model = make_model()
    worker = 0 if ctx.rank == 3 else ctx.rank
    if ctx.rank == 3:
        ctx.signal("joined")
        ctx.wait_signal(0, "die", timeout=60)
        _wait_dead(int((folder / "pid-0").read_text()))
        if not told:
            ctx.wait_signal(2, "waits", timeout=60)
        opened = []
        load = torch.load

        def watched(f, *a, **k):  # no checkpoint file read (a live peer's bytes are)
            if isinstance(f, (str, os.PathLike)):
                opened.append(str(f))
            return load(f, *a, **k)

        torch.load = watched
        opt = SyncReplicasOptimizer(
            sgd(model.parameters()), R, N, timeout=30, last_step=last_step,
            transport="server", server_address=(folder / "chief").read_text(), worker=0,
            server_rank=1, standby=True,
        )  # fmt: skip
        torch.load = load
        joined = {"serves": opt.standby_chief is not None, "opened": opened}
        ctx.signal("attached")
    else:  # the job's process group: ranks 0-2 (rank 3 restarts one of them, outside it)
        dist.init_process_group(
            "gloo", init_method=f"file://{ctx.workdir}/group", rank=ctx.rank, world_size=N,
            timeout=timedelta(seconds=30),
        )  # fmt: skip
        opt = SyncReplicasOptimizer(
            sgd(model.parameters()), R, N, timeout=30, last_step=last_step, transport="server"
        )
        joined = {"standby": opt.exchange.standby}
        if ctx.rank == 1:
            assert opt.exchange.servers is not None and opt.exchange.servers.standby_server
            (folder / "chief").write_text(opt.exchange.servers.standby_server.address)
        _joined(ctx)
    records: list[tuple[int, torch.Tensor, bool | None]] = []
    count = 0
    while opt.global_step < last_step:
        if ctx.rank == 0 and count == 4:
            _die(ctx)
        met = Path(ctx.workdir, "signal-2-met").exists() or not told
        if ctx.rank == 1 and met and Path(ctx.workdir, "signal-3-attached").exists():
            _wait_dead(int((folder / "pid-0").read_text()))
            directory = opt.exchange.directory
            assert directory is not None and directory.flush()
            (server, standby) = directory.read(0)
            assert standby is not None and standby.rank == 0  # rank 3's copy (worker 0)
            _die(ctx)
        if ctx.rank == 2 and not told and opt.chief_moved_from == 0:
            assert opt.exchange.clients.standby is None  # no answer named one
            ctx.signal("waits")
            ctx.wait_signal(1, "die", timeout=60)
            _wait_dead(int((folder / "pid-1").read_text()))
            told = True  # (once)
        opt.zero_grad()
        loss_of(model, worker, count + (100 if ctx.rank == 3 else 0)).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        tag = opt.local_step
        torch.save(records + [(tag, grads, None)], folder / f"rank{ctx.rank}.pt")
        opt.step()
        records.append((tag, grads, opt.last_gradient_accepted))
        count += 1
        standby = opt.exchange.clients.standby
        if ctx.rank == 2 and standby is not None and standby[1] == 0 and not met:
            ctx.signal("met")  # rank 3's copy gets this worker's gradients now
        time.sleep(0.02)
    out = {
        **joined,
        "records": records,
        "initial": [p.detach().clone() for p in make_model().parameters()],
        "final": [p.detach().clone() for p in model.parameters()],
        "global_step": opt.global_step,
        "moved_from": opt.chief_moved_from,
    }
    ctx.signal("trained")
    for r in (2, 3):
        ctx.wait_signal(r, "trained", timeout=60)
    if ctx.rank == 3:
        assert opt.standby_chief is not None
        out["state"] = _chief_state(opt.standby_chief)
        out["promoted"] = opt.exchange.servers.standby_server.standby.promoted
    opt.close()
    return out
