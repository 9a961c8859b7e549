"""Rank functions for the SyncReplicas / async EASGD / failure tests (run by ``run_ranks``)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradfleet
from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.testing import RankContext

F64 = torch.float64


def make_model(seed: int = 7, width: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 1)).double()


def data(worker: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * worker + count)
    return torch.randn(8, 3, generator=gen, dtype=F64), torch.randn(8, 1, generator=gen, dtype=F64)


def loss_of(model: nn.Module, worker: int, count: int) -> torch.Tensor:
    x, y = data(worker, count)
    return ((model(x) - y) ** 2).mean()


def _die(ctx: RankContext) -> None:
    """Ask the harness to SIGKILL this rank (``kill_on={rank: "die"}``) and wait for it."""
    ctx.signal("die")
    time.sleep(60)
    os.kill(os.getpid(), signal.SIGKILL)


def _joined(ctx: RankContext) -> None:
    """Wait until every rank got here (e.g. built its optimizer)."""
    ctx.signal("joined")
    for r in range(ctx.world_size):
        ctx.wait_signal(r, "joined", timeout=60)


# --------------------------------------------------------------------- SyncReplicas
def sync_oracle(
    ctx: RankContext, num_workers: int, R: int, server_ranks: list[int] | None = None
) -> list[tuple]:
    """TF's oracle (section 1.10) over real processes, ordered with signals."""
    v0 = torch.tensor(0.0, requires_grad=True)
    v1 = torch.tensor(1.0, requires_grad=True)
    vs = torch.tensor([[3.0], [4.0]], requires_grad=True)
    gs = torch.zeros((), dtype=torch.int64)
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer([v0, v1, vs], 2.0),
        R,
        num_workers,
        num_tokens=num_workers,
        timeout=20,
        server_ranks=server_ranks,
    )
    k = ctx.rank
    # TF's oracle creates every session (local_step_init_op) before any worker runs: a
    # worker that joined after round one would start at global_step 1 and not be late
    _joined(ctx)
    grads = [
        (torch.tensor(0.1 + 0.2 * k), v0),
        (torch.tensor(0.9 + 0.2 * k), v1),
        (torch.sparse_coo_tensor([[1]], [[0.1 + 0.2 * k]], (2, 1)), vs),
    ]
    trace = []

    def run(tag: str) -> None:
        opt.apply_gradients(grads, gs)
        trace.append(
            (
                tag,
                int(gs),
                opt.local_step,
                opt.last_gradient_accepted,
                v0.item(),
                v1.item(),
                vs.detach().reshape(-1).tolist(),
            )
        )

    order = [0, 1] if num_workers == 2 else [0, 2, 1]
    for rnd in ("a", "b"):  # two sequential rounds in ``order``
        pos = order.index(k)
        if pos:
            ctx.wait_signal(order[pos - 1], rnd, timeout=20)
        run(rnd)
        ctx.signal(rnd)
        ctx.wait_signal(order[-1], rnd, timeout=20)
    if num_workers == 3 and k == 2:
        ctx.wait_signal(1, "c", timeout=20)
    else:  # 3 workers: worker 0 blocks until worker 1 pushes; 2 workers: concurrent round
        if num_workers == 3 and k == 1:
            ctx.wait_signal(0, "c-started", timeout=20)
            time.sleep(0.3)
        if k == 0:
            ctx.signal("c-started")
        run("c")
        ctx.signal("c")
    if num_workers == 3:
        ctx.wait_signal(1, "c", timeout=20)
        if k != 2:
            ctx.wait_signal(0, "c", timeout=20)
    opt.close()
    return trace


def sync_train(
    ctx: RankContext,
    R: int,
    N: int,
    steps: int,
    transport: str = "server",
    slow: int | None = None,
    delay: float = 0.0,
    width: int = 4,
    die_at: int | None = None,
    timeout: float = 20.0,
    server_ranks: list[int] | None = None,
    num_tokens: int = -1,
    adam: bool = False,
    forget_dead: bool = False,
    assignment: str = "bytes",
    tokens: str | None = None,
) -> dict:
    """Train until global_step == steps; rank ``slow`` sleeps ``delay`` after each step;
    rank 1 SIGKILLs itself after ``die_at`` of its own steps (right after getting a token);
    ``forget_dead``: rank 0 tells every server that rank 1 is gone, then all ranks close."""
    model = make_model(width=width)
    inner = (
        gradfleet.AdamOptimizer(model.parameters(), 0.01)
        if adam
        else gradfleet.GradientDescentOptimizer(model.parameters(), 0.05)
    )
    opt = SyncReplicasOptimizer(
        inner,
        R,
        N,
        transport=transport,
        last_step=steps,
        timeout=timeout,
        server_ranks=server_ranks,
        num_tokens=num_tokens,
        shard_assignment=assignment,
        tokens=tokens,
    )
    if die_at is not None:  # every worker joined before any trains: rank 1 starts with them
        _joined(ctx)
    count, start = 0, time.monotonic()
    while opt.global_step < steps:
        opt.zero_grad()
        loss_of(model, ctx.rank, count).backward()
        opt.step()
        count += 1
        # with backup workers the others may still finish before a descheduled rank 1 made
        # die_at steps: it dies then all the same, never leaving as if it had survived
        if ctx.rank == 1 and die_at is not None and (count == die_at or opt.global_step >= steps):
            _die(ctx)
        if ctx.rank == slow:
            time.sleep(delay)
    elapsed = time.monotonic() - start
    out = {
        "global_step": opt.global_step,
        "count": count,
        "elapsed": elapsed,
        "counters": dict(opt.counters),
        "bytes": opt.bytes_sent,
        "withheld": opt.withheld_pushes,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    if ctx.rank == 0:
        out["server_counters"] = opt.worker_counters()
    if forget_dead:
        if ctx.rank == 0:
            opt.forget_workers([1])
        ctx.signal("trained")  # the forgetting is done before any server rank closes
        for r in range(ctx.world_size):
            if r != 1:
                ctx.wait_signal(r, "trained", timeout=60)
    start = time.monotonic()
    opt.close()
    out["close_s"] = time.monotonic() - start
    return out


def forget_bad_rank(ctx: RankContext) -> str:
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer(make_model().parameters(), 0.1), 2, 2, timeout=10
    )
    dist.barrier()  # both workers said hello before either closes
    try:
        opt.forget_workers([0, 2, -1])
    except ValueError as exc:
        return str(exc).split(".", 1)[1]
    finally:
        opt.close()
    return "accepted"


def sync_rejoin(ctx: RankContext, steps: int) -> dict:
    """R=2 of N=3 outside any process group: rank 0 is the chief, ranks 1-2 connect by address;
    rank 2 is SIGKILLed after 5 steps and rank 3 restarts it (a fresh process, worker 2)."""
    model = make_model()
    addr = Path(ctx.workdir, "address")
    worker = 2 if ctx.rank == 3 else ctx.rank
    if ctx.rank == 3:
        ctx.wait_signal(2, "die", timeout=30)
        time.sleep(0.5)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(123.0)  # garbage: the hello must overwrite it with the server's values
    elif ctx.rank:
        ctx.wait_signal(0, "up", timeout=30)
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer(model.parameters(), 0.05),
        2,
        3,
        timeout=10,
        last_step=steps,
        worker=worker,
        server_address=None if ctx.rank == 0 else addr.read_text(),
    )
    if ctx.rank == 0:
        addr.write_text(opt.server_address)
        ctx.signal("up")
    hello = {
        "local_step": opt.local_step,
        "global_step": opt.global_step,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    count = 0
    while opt.global_step < steps:
        opt.zero_grad()
        loss_of(model, worker, count).backward()
        opt.step()
        count += 1
        if ctx.rank == 2 and count == 5:
            _die(ctx)
        time.sleep(0.02)
    out = {
        "hello": hello,
        "global_step": opt.global_step,
        "counters": dict(opt.counters),
        "params": [p.detach().clone() for p in model.parameters()],
    }
    if ctx.rank == 0:
        out["server_counters"] = opt.worker_counters()
    opt.close()
    return out


def sync_error(
    ctx: RankContext,
    R: int,
    N: int,
    die_at: int,
    kill_server: bool,
    server_ranks: list[int] | None = None,
    victim: int | None = None,
) -> str:
    """Rank 1 (or the server, rank 0, or ``victim``) dies; the survivors must raise naming it."""
    model = make_model()
    if victim is None:
        victim = 0 if kill_server else 1
    count = 0
    start = time.monotonic()
    try:
        opt = SyncReplicasOptimizer(
            gradfleet.GradientDescentOptimizer(model.parameters(), 0.05),
            R,
            N,
            timeout=3.0,
            server_ranks=[0] if server_ranks is None else server_ranks,
        )
        # the victim trains (and dies) only once every rank is connected: else, with R of N
        # gradients from any workers, a rank slow to start (a loaded host) meets the dead
        # server in its constructor, whose store connection retries for its whole timeout.
        # The time measured is from here: training, then the loss noticed, not the start-up
        ctx.signal("connected")
        if ctx.rank == victim:
            for r in set(range(ctx.world_size)) - {victim}:
                ctx.wait_signal(r, "connected", timeout=60.0)
        start = time.monotonic()
        while True:
            opt.zero_grad()
            loss_of(model, ctx.rank, count).backward()
            opt.step()
            count += 1
            if ctx.rank == victim and count == die_at:
                _die(ctx)
    except Exception as exc:
        said = f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    # A rank that serves takes its servers with it when it exits: a survivor still waiting on
    # this rank's server would then be told of this rank's loss, not the victim's. So each
    # survivor keeps serving until every survivor has had its own error.
    ctx.signal("erred")
    for r in range(ctx.world_size):
        if r not in (ctx.rank, victim):
            ctx.wait_signal(r, "erred", timeout=30.0)
    return said


def _plant_bug(where: str) -> None:
    """Rank 0's bug: in the chief's handling of token requests from global step 2
    (``"handler"``), or in its probe of the other server rank from the third probe on
    (``"probe"``)."""
    if where == "handler":
        from gradfleet.distributed.sync.server.chief import SyncChief

        token_request = SyncChief._token_request

        def buggy(chief, worker, msg, ticket):
            if chief.global_step >= 2:
                raise KeyError(f"bug planted in the chief at global step {chief.global_step}")
            return token_request(chief, worker, msg, ticket)

        SyncChief._token_request = buggy  # type: ignore[method-assign]
        return
    from gradfleet.distributed.hosting import sync_servers

    real = sync_servers.probe

    def buggy_probe(address, seconds, connect_s=None):
        check, calls = real(address, seconds, connect_s), []

        def buggy_check():
            calls.append(1)
            if len(calls) >= 3:
                raise KeyError("bug planted in the probe")
            check()

        return buggy_check

    sync_servers.probe = buggy_probe


def sync_server_bug(ctx: RankContext, where: str) -> dict:
    """R=2 of N=2; a bug planted on rank 0 (:func:`_plant_bug`; ``"probe"``: shards on ranks 0
    and 1).  Each worker trains until its step raises; it reports what it raised, and rank 0
    the chief's ERROR records (message, and whether they carry a traceback)."""
    records: list[tuple[str, bool]] = []
    if ctx.rank == 0:
        _plant_bug(where)

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append((record.getMessage(), record.exc_info is not None))

        chief_log = logging.getLogger("gradfleet.distributed.sync.server.chief")
        chief_log.addHandler(Keep(logging.ERROR))
    model = make_model()
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer(model.parameters(), 0.05),
        2,
        2,
        timeout=20.0,
        server_ranks=[0] if where == "handler" else [0, 1],
    )
    _joined(ctx)
    said, count, start = "finished", 0, time.monotonic()
    try:
        while time.monotonic() - start < 30.0:
            opt.zero_grad()
            loss_of(model, ctx.rank, count).backward()
            opt.step()
            count += 1
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    # the servers go with their rank: each worker waits until the other had its error
    ctx.signal("erred")
    ctx.wait_signal(1 - ctx.rank, "erred", timeout=45.0)
    return {"said": said, "chief_errors": records}


def sync_bad_shapes(ctx: RankContext) -> str:
    model = make_model(width=4 if ctx.rank == 0 else 5)
    try:
        opt = SyncReplicasOptimizer(
            gradfleet.GradientDescentOptimizer(model.parameters(), 0.05),
            2,
            2,
            timeout=5,
            server_rank=0,
        )
    except ValueError as exc:
        ctx.signal("answered")
        return f"ValueError: {exc}"
    # the chief serves until rank 1 had its answer: a rank slow to start (a loaded machine)
    # may connect later than the chief's close would wait for a silent worker (timeout)
    ctx.wait_signal(1, "answered", timeout=45.0)
    opt.close()
    return "ok"


def sync_nonfinite(ctx: RankContext) -> dict:
    """R=2 of N=3: rank 2 pushes a NaN once and gets FloatingPointError; the others go on."""
    model = make_model()
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer(model.parameters(), 0.05),
        2,
        3,
        last_step=6,
        timeout=10,
        transport="server",
    )
    errors, count = [], 0
    if ctx.rank != 2:  # R = 2 of 3: without this, ranks 0 and 1 could finish before rank 2 steps
        ctx.wait_signal(2, "pushed-nan", timeout=60)
    while opt.global_step < 6:
        opt.zero_grad()
        loss_of(model, ctx.rank, count).backward()
        if ctx.rank == 2 and count == 0:
            model[0].weight.grad[0, 0] = float("nan")
        try:
            opt.step()
        except FloatingPointError as exc:
            errors.append(str(exc))
            opt.local_step = opt.global_step  # this worker skips the batch and resyncs its tag
        if ctx.rank == 2 and count == 0:
            ctx.signal("pushed-nan")
        count += 1
    out = {
        "errors": errors,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }
    if ctx.rank == 0:
        out["server"] = opt.worker_counters()
    opt.close()
    return out


def sync_checkpoint(
    ctx: RankContext,
    transport: str,
    split: int,
    steps: int,
    path: str,
    server_ranks: list[int] | None = None,
    assignment: str = "bytes",
) -> list:
    """Run ``steps`` updates, checkpointing after ``split`` (phase "a") or resuming from it
    (phase "b" when ``path`` exists): returns the parameters after every update."""
    model = make_model()
    R = ctx.world_size
    ckpt = Path(path, f"rank{ctx.rank}.pt")
    resume = ckpt.exists()
    opt = SyncReplicasOptimizer(
        gradfleet.AdamOptimizer(model.parameters(), 0.01),
        R,
        R,
        transport=transport,
        last_step=steps,
        timeout=10,
        server_ranks=server_ranks,
        shard_assignment=assignment,
    )
    count = 0
    if resume:
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        count = state["count"]
    traj = []
    while opt.global_step < steps:
        opt.zero_grad()
        loss_of(model, ctx.rank, count).backward()
        opt.step()
        count += 1
        traj.append((opt.global_step, [p.detach().clone() for p in model.parameters()]))
        if not resume and opt.global_step == split and opt.local_step == split:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "count": count}, ckpt)
            break
    opt.close()
    return traj


# --------------------------------------------------------------------- asynchronous EASGD
def _easgd(params, num_worker, tau, alpha, strategy, lr=1.0, synchronous=False, group=None):
    from gradfleet.distributed import ElasticAverageOptimizer

    return ElasticAverageOptimizer(
        gradfleet.GradientDescentOptimizer(params, lr),
        num_worker,
        tau,
        alpha,
        rho=0.0,
        synchronous=synchronous,
        mode=strategy,
        process_group=group,
    )


def easgd_oracle(ctx: RankContext) -> dict:
    """TF's oracle (3.7): 2 workers, tau 1, alpha 0.5, gradients -1, worker 0 then worker 1."""
    from gradfleet.distributed import AsyncCentre

    v0 = torch.tensor(0.0, requires_grad=True)
    v1 = torch.tensor(1.0, requires_grad=True)
    strategy = AsyncCentre(timeout=20)
    opt = _easgd([v0, v1], 2, 1, 0.5, strategy)
    gs = torch.zeros((), dtype=torch.int64)
    ctx.signal("joined")  # both start from the initial centre, as in TF's oracle
    ctx.wait_signal(1 - ctx.rank, "joined", timeout=20)
    if ctx.rank == 1:
        ctx.wait_signal(0, "stepped", timeout=20)
    opt.apply_gradients([(torch.tensor(-1.0), v0), (torch.tensor(-1.0), v1)], gs)
    ctx.signal("stepped")
    ctx.wait_signal(1, "stepped", timeout=20)
    out = {
        "v": (v0.item(), v1.item()),
        "centre": [c.item() for c in opt.centre()],
        "global_step": int(gs),
        "local_centre": [c.item() for c in opt.local_centre()],
    }
    strategy.close()
    return out


def easgd_round_robin(ctx: RankContext, steps: int, tau: int, alpha: float) -> list:
    """Workers take turns (rank order) for every local step: a deterministic order that the
    float64 simulation replays.  Returns the parameters after each local step."""
    from gradfleet.distributed import AsyncCentre

    model = make_model()
    strategy = AsyncCentre(timeout=20)
    opt = _easgd(model.parameters(), ctx.world_size, tau, alpha, strategy, lr=0.1)
    ctx.signal("joined")  # every worker starts from the initial centre, as the replay does
    for r in range(ctx.world_size):
        ctx.wait_signal(r, "joined", timeout=20)
    traj = []
    for s in range(steps):
        if ctx.rank:
            ctx.wait_signal(ctx.rank - 1, f"s{s}", timeout=20)
        elif s:
            ctx.wait_signal(ctx.world_size - 1, f"s{s - 1}", timeout=20)
        opt.zero_grad()
        loss_of(model, ctx.rank, s).backward()
        opt.step()
        traj.append([p.detach().clone() for p in model.parameters()])
        ctx.signal(f"s{s}")
    ctx.wait_signal(ctx.world_size - 1, f"s{steps - 1}", timeout=20)
    centre = [c.clone() for c in opt.centre()]
    strategy.close()
    return [traj, centre]


def easgd_centre_lost(
    ctx: RankContext,
    steps: int,
    tau: int,
    alpha: float,
    lost_at: int,
    cut: str = "applied",
    dedicated: bool = False,
) -> dict:
    """Workers take turns as in :func:`easgd_round_robin`; the centre is on rank 0, its
    standby on rank 1 (``dedicated``: the centre on the last rank, which only serves, its
    standby on rank 0).  The centre's rank is SIGKILLed (``kill_on={rank: "die"}``) at worker
    2's exchange number ``lost_at``: once the standby has applied it and before worker 2 hears
    back (``cut="applied"``), or before the server handles it (``"unsent"``).  Worker 2 sends
    it again to the standby, and the live workers go on taking turns.  ``lost_at=0``: no
    loss; the server's rank and the standby's then return their copy of the centre after the
    last turn, for a bit-for-bit comparison."""
    from gradfleet.distributed import AsyncCentre, ParameterServer
    from gradfleet.distributed.hosting import standby

    workers = ctx.world_size - 1 if dedicated else ctx.world_size
    server_rank = workers if dedicated else 0

    def lost(fields: dict) -> bool:
        return fields.get("worker") == 2 and fields.get("number") == lost_at

    if ctx.rank == server_rank and lost_at and cut == "applied":  # in the forwarder
        init = standby.Forwarder.__init__

        def init_then_watch(self, *args, **kwargs):
            init(self, *args, **kwargs)
            call = self.client.call

            def call_then_die(op, **fields):
                out = call(op, **fields)  # the standby has applied the copies
                if any(c["copy_of"] == "exchange_add" and lost(c) for c in fields["copies"]):
                    _die(ctx)
                return out

            self.client.call = call_then_die

        standby.Forwarder.__init__ = init_then_watch
    if ctx.rank == server_rank and lost_at and cut == "unsent":
        forward = standby.Forwarder.forward

        def die_then_forward(self, msg):
            if msg["op"] == "exchange_add" and lost(msg):
                _die(ctx)
            return forward(self, msg)

        standby.Forwarder.forward = die_then_forward
    if dedicated and ctx.rank == server_rank:  # only serves, until every worker left
        server = ParameterServer()
        _joined(ctx)
        server.join()
        assert server._centre is not None
        return {"copy": [c.clone() for c in server._centre.centre],
                "applied": dict(server._centre.exchanges)}  # fmt: skip
    model = make_model()
    strategy = AsyncCentre(server_rank=server_rank, timeout=20, standby=True)
    opt = _easgd(model.parameters(), workers, tau, alpha, strategy, lr=0.1)
    _joined(ctx)  # every worker starts from the initial centre, as the replay does
    lost_step = lost_at * tau - 1  # the local step whose exchange is worker 2's number lost_at
    gone = 0 if lost_at and not dedicated else None  # the worker lost with the centre
    alive = [r for r in range(workers) if r != gone]
    traj = []
    for s in range(steps):
        live = [r for r in range(workers) if not (r == gone and s > lost_step)]
        if ctx.rank not in live:  # rank 0 is about to be killed, from its server's thread
            time.sleep(60)
        turn = live.index(ctx.rank)
        if turn:
            ctx.wait_signal(live[turn - 1], f"s{s}", timeout=30)
        elif s:
            ctx.wait_signal(live[-1], f"s{s - 1}", timeout=30)
        opt.zero_grad()
        loss_of(model, ctx.rank, s).backward()
        opt.step()
        traj.append([p.detach().clone() for p in model.parameters()])
        ctx.signal(f"s{s}")
    ctx.wait_signal(2, f"s{steps - 1}", timeout=30)
    out = {"traj": traj, "standby": strategy.standby, "moved": strategy.server_rank}
    if not lost_at and ctx.rank in (server_rank, strategy.standby):  # the two copies
        server = strategy._server if ctx.rank == server_rank else strategy._standby_server
        out["copy"] = [c.clone() for c in server.centre]
        out["applied"] = dict(server.exchanges)
        if ctx.rank == strategy.standby:  # copies completed with the workers' own data
            assert strategy._standby_hosted is not None
            out["paired"] = strategy._standby_hosted.standby.paired
    if lost_at and ctx.rank == strategy.standby:  # now the centre
        out["applied"] = strategy.counters()["exchanges"]
        out["resent"] = dict(strategy._standby_server.resent)
        out["centre"] = [c.clone() for c in strategy.centre()]
    ctx.signal("read")
    for r in alive:
        ctx.wait_signal(r, "read", timeout=30)
    strategy.close()
    return out


def easgd_rejoin(ctx: RankContext, restarted_steps: int, standby: bool = False) -> dict:
    """3 workers (ranks 0-2) train; rank 2 is SIGKILLed after 10 steps and rank 3 restarts it:
    a fresh process that joins as worker 2 through the server address, makes
    ``restarted_steps`` steps and says so; ranks 0 and 1 train until then.  Counted in steps
    and events, never in seconds (a loaded machine steps slowly).  ``standby``: the centre
    keeps one on rank 1, which the restarted worker learns from its hello."""
    from gradfleet.distributed import AsyncCentre

    group = torch.distributed.new_group([0, 1, 2])
    model = make_model()
    if ctx.rank == 3:  # the restarted worker 2: no process group, explicit address
        ctx.wait_signal(2, "die", timeout=30)
        time.sleep(0.5)
        address = Path(ctx.workdir, "address").read_text()
        strategy = AsyncCentre(timeout=10, address=address, worker=2)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(123.0)  # garbage: the join must overwrite it with the centre
    else:
        strategy = AsyncCentre(timeout=10, standby=standby)
    opt = _easgd(
        model.parameters(), 3, 2, 0.2, strategy, lr=0.05, group=None if ctx.rank == 3 else group
    )
    joined_with = [p.detach().clone() for p in model.parameters()]
    if ctx.rank == 0:
        Path(ctx.workdir, "address").write_text(strategy.address)
    killed, trained = Path(ctx.workdir, "signal-2-die"), Path(ctx.workdir, "signal-3-trained")
    steps, kill_seen, rejoin_seen = 0, None, None
    while not (trained.exists() if ctx.rank < 2 else ctx.rank == 3 and steps == restarted_steps):
        opt.zero_grad()
        loss_of(model, ctx.rank, steps).backward()
        opt.step()
        steps += 1
        if ctx.rank == 2 and steps == 10:
            _die(ctx)
        if ctx.rank == 0 and kill_seen is None and killed.exists():
            kill_seen = steps
        if ctx.rank == 0 and rejoin_seen is None and strategy.counters()["joins"].get(2) == 2:
            rejoin_seen = steps
        if steps > 100_000:
            raise RuntimeError("the restarted worker never trained")
        time.sleep(0.01)
    if ctx.rank == 3:
        ctx.signal("trained")
    out = {
        "steps": steps,
        "local_step": opt.local_step,
        "kill_seen_at": kill_seen,
        "rejoin_seen_at": rejoin_seen,
        "joined_with": joined_with,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }
    if ctx.rank == 0:
        out["counters"] = strategy.counters()
    if ctx.rank == 3:
        out["standby"] = (strategy.standby, strategy.standby_address is not None)
    if ctx.rank in (0, 1):  # the centre and its standby, once every worker is done
        ctx.signal("counted")
        for r in (0, 1):
            ctx.wait_signal(r, "counted", timeout=30)
        if standby:
            server = strategy._server if ctx.rank == 0 else strategy._standby_server
            out["copy"] = [c.clone() for c in server.centre]
    strategy.close()
    return out


def easgd_server_dies(ctx: RankContext) -> str:
    from gradfleet.distributed import AsyncCentre

    model = make_model()
    start = time.monotonic()
    try:
        # built inside the try: rank 0 makes its 6 steps without waiting for rank 1, so a
        # rank 1 slow to connect meets the dead centre here, and must name it all the same
        strategy = AsyncCentre(timeout=5)  # no standby: the centre's loss ends the job
        opt = _easgd(model.parameters(), 2, 1, 0.2, strategy, lr=0.05)
        for s in range(10_000):
            opt.zero_grad()
            loss_of(model, ctx.rank, s).backward()
            opt.step()
            if ctx.rank == 0 and s == 5:
                _die(ctx)
            time.sleep(0.01)
    except Exception as exc:
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    return "no error"


def easgd_barrier(ctx: RankContext, late: float) -> dict:
    """synchronous=True: the start-up barrier holds the others until rank 1 arrives."""
    from gradfleet.distributed import AsyncCentre

    if ctx.rank == 1:
        time.sleep(late)
    model = make_model()
    strategy = AsyncCentre(timeout=10)
    arrived = time.time()  # wall clock: comparable across the ranks' processes
    _easgd(model.parameters(), 2, 1, 0.2, strategy, lr=0.05, synchronous=True)
    passed = time.time()
    strategy.close()
    return {"arrived": arrived, "passed": passed, "waited": passed - arrived}


def _wait_dead(pid: int, timeout: float = 30.0) -> None:
    """Until process ``pid`` is gone (killed by the harness, a zombie at most)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.02)
    raise TimeoutError(f"process {pid} still alive after {timeout} s")


def easgd_second_loss(ctx: RankContext, k1: int, k2: int, k3: int, save_to: str) -> dict:
    """3 workers (ranks 0-2), tau 1, the centre on rank 0 with its standby on rank 1.  Each
    makes ``k1`` steps; rank 0 is SIGKILLed and ranks 1 and 2 move to the standby.  Rank 3
    restarts worker 0 by the standby's address with ``standby=True``: it becomes the new
    centre's standby, from its live state.  Ranks 1-3 make ``k2`` steps each; the two copies
    are then compared; rank 1, the centre now, is SIGKILLed, and ranks 2 and 3 make ``k3``
    steps each on rank 3's copy.  Steps are ordered by signals only at the phases' ends.
    Rank 1's copy, before it is killed, goes to the file ``save_to``."""
    from gradfleet.distributed import AsyncCentre

    model = make_model()
    workdir = Path(ctx.workdir)
    if ctx.rank == 1:
        (workdir / "pid-1").write_text(str(os.getpid()))
    if ctx.rank == 3:  # the restarted worker 0: no process group, the running centre's address
        ctx.wait_signal(0, "die", timeout=60)
        ctx.wait_signal(1, "moved", timeout=60)
        address = (workdir / "standby-address").read_text()
        strategy = AsyncCentre(timeout=20, address=address, worker=0, server_rank=1, standby=True)
        group = None
    else:
        group = dist.new_group([0, 1, 2])
        strategy = AsyncCentre(timeout=20, standby=True)
    opt = _easgd(model.parameters(), 3, 1, 0.3, strategy, lr=0.1, group=group)
    if ctx.rank == 1:
        (workdir / "standby-address").write_text(strategy.standby_address)

    def steps(count: int, start: int) -> None:
        for s in range(start, start + count):
            opt.zero_grad()
            loss_of(model, ctx.rank, s).backward()
            opt.step()

    pid_of_1 = int((workdir / "pid-1").read_text()) if ctx.rank != 1 else 0
    out: dict = {}
    if ctx.rank < 3:  # phase A
        steps(k1, 0)
        ctx.signal("a")
        for r in range(3):
            ctx.wait_signal(r, "a", timeout=60)
        if ctx.rank == 0:
            _die(ctx)
        steps(1, k1)  # ranks 1 and 2: this exchange moves them to rank 1's copy
        ctx.signal("moved")
        ctx.wait_signal(3, "attached", timeout=60)
        steps(k2 - 1, k1 + 1)
    else:
        out["standby_after_join"] = strategy.standby_address is None  # it is the standby
        out["serves"] = strategy._standby_server is not None
        ctx.signal("attached")
        steps(k2, 0)
    ctx.signal("b")
    for r in (1, 2, 3):
        ctx.wait_signal(r, "b", timeout=60)
    if ctx.rank in (1, 3):  # the centre (rank 1's promoted copy) and its new standby
        state = {
            "copy": [c.clone() for c in strategy._standby_server.centre],
            "applied": dict(strategy._standby_server.exchanges),
        }
        if ctx.rank == 1:  # about to be killed: its copy goes through a file
            torch.save(state, save_to)
        else:  # copies completed with data the workers sent here, once they learnt of it
            assert strategy._standby_hosted is not None
            state["paired"] = strategy._standby_hosted.standby.paired
        out.update(state)
    ctx.signal("compared")
    for r in (1, 2, 3):
        ctx.wait_signal(r, "compared", timeout=60)
    if ctx.rank == 1:
        _die(ctx)
    _wait_dead(pid_of_1)  # its next exchange finds the centre gone
    steps(k3, k1 + k2 if ctx.rank < 3 else k2)  # ranks 2 and 3: on rank 3's copy
    ctx.signal("c")
    for r in (2, 3):
        ctx.wait_signal(r, "c", timeout=60)
    out["moved"] = strategy.server_rank
    if ctx.rank == 3:
        out["final"] = strategy.counters()["exchanges"]
    ctx.signal("read")
    for r in (2, 3):
        ctx.wait_signal(r, "read", timeout=60)
    strategy.close()
    return out
