"""Model-size sweep of the distributed data plane against gloo baselines measured in the same run.

4 gloo ranks on one host, plain GradientDescent, synthetic gradients (fixed per rank, no model
compute), float32 parameters in 9 tensors of unequal sizes.  Per parameter count and path:
updates per second (rank 0, after ``WARM`` warm-up updates):

* ``allreduce``: one flat all-reduce of the gradients per update (DDP's traffic);
* ``reduce_broadcast``: reduce to rank 0 + broadcast from it (a server's traffic, gloo's way);
* ``sync_server``: SyncReplicas R=N=4 through one server (rank 0);
* ``sync_sharded``: SyncReplicas R=N=4, a shard on each rank;
* ``sync_backup`` / ``sync_backup_straggler``: R=3 of N=4, rank 3 sleeping as long as a
  straggler-free step takes; ``allreduce_straggler``: all-reduce with the same sleeper;
* ``p2p_roundtrip``: ranks 1-3 each send the parameters to rank 0 and get them back (gloo
  send/recv), round trips per second served by rank 0; ``async_easgd``: exchanges per second
  served by the centre (4 workers, tau=1, only the exchange and a local SGD step);
* ``sync_ceiling``: SyncReplicas R=N=4 with one server written directly on gloo: rank 0
  receives ranks 1-3's gradients at once, sums them with its own, applies the update and sends
  the variables back (no snapshot, no staleness or finiteness checks): the most a one-server
  transport could reach on this machine;
* ``easgd_ceiling``: the same exchanges written directly on gloo send/recv with the centre's
  and the workers' arithmetic and nothing else (rank 0 serves ranks 1-3 in turn, then its own
  worker in memory): what asynchronous EASGD can reach on this machine with any transport.

Ratios: ``sync_server / reduce_broadcast``, ``sync_sharded / allreduce``, ``sync_backup_straggler
/ sync_backup`` and ``/ allreduce_straggler``, ``async_easgd / p2p_roundtrip``.

The wrappers' paths (:data:`STRATEGIES`) are strategies of the CLI's table
(:data:`gradfleet.cli.strategy_table.TABLE`), run by its adapters on the fixed gradients
(``apply_gradients``, no forward or backward); the others are gloo baselines and ceilings written
here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

import gradfleet
from gradfleet.cli.strategies import Strategy
from gradfleet.cli.strategy_table import TABLE, validate_strategy
from gradfleet.distributed.testing import run_ranks

WORLD, WARM = 4, 2
FRACTIONS = [0.3, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.015, 0.005]
PATHS = [
    "allreduce",
    "reduce_broadcast",
    "sync_server",
    "sync_sharded",
    "sync_backup",
    "sync_backup_straggler",
    "allreduce_straggler",
    "sync_ceiling",
    "p2p_roundtrip",
    "async_easgd",
    "easgd_ceiling",
]
# the wrappers' paths: (table strategy, its arguments). Sync-replicas is given no model, so its
# layout is the arguments' alone: one server holding every parameter (named: the default
# would be the exchange without a server), or a shard on each rank.
STRATEGIES: dict[str, tuple[str, dict]] = {
    "sync_server": ("sync-replicas", {"replicas_to_aggregate": WORLD, "transport": "server"}),
    "sync_sharded": ("sync-replicas", {"replicas_to_aggregate": WORLD, "shards": WORLD}),
    "sync_backup": ("sync-replicas", {"replicas_to_aggregate": WORLD - 1, "transport": "server"}),
    "sync_backup_straggler": (
        "sync-replicas",
        {"replicas_to_aggregate": WORLD - 1, "transport": "server"},
    ),
    "async_easgd": ("easgd", {"mode": "async", "period": 1, "moving_rate": 0.2, "rho": 0.0}),
}
RATIOS = {
    "sync_server/reduce_broadcast": ("sync_server", "reduce_broadcast"),
    "sync_sharded/allreduce": ("sync_sharded", "allreduce"),
    "backup_kept": ("sync_backup_straggler", "sync_backup"),
    "backup_straggler/allreduce_straggler": ("sync_backup_straggler", "allreduce_straggler"),
    "sync_server/ceiling": ("sync_server", "sync_ceiling"),
    "easgd/p2p": ("async_easgd", "p2p_roundtrip"),
    "easgd/ceiling": ("async_easgd", "easgd_ceiling"),
}


Result = tuple[float, float]  # (this rank's rate, cores it kept busy)


class _Clock:
    """One rank's timed window: wall time and the CPU time of the whole process (every thread:
    the wrapper's server and receiving threads and gloo's event loop included)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.elapsed: float | None = None

    def stop(self) -> None:
        self.elapsed = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu

    def result(self, units: float) -> Result:
        """``(units per second, cores busy)`` over the window."""
        if self.elapsed is None:
            self.stop()
        assert self.elapsed is not None
        return units / self.elapsed, self.cpu / self.elapsed


def _params(count: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    sizes = [max(1, int(count * f)) for f in FRACTIONS]
    gen = torch.Generator().manual_seed(rank)
    params = [torch.zeros(n, requires_grad=True) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    return params, grads


def _collective(ctx, path: str, count: int, steps: int, delay: float) -> Result:
    params, grads = _params(count, ctx.rank)
    sgd = gradfleet.GradientDescentOptimizer(params, 0.01)
    flat = torch.empty(sum(p.numel() for p in params))
    for s in range(WARM + steps):
        if s == WARM:
            dist.barrier()
            clock = _Clock()
        torch.cat(grads, out=flat)
        if path.startswith("allreduce"):
            dist.all_reduce(flat)
        else:
            dist.reduce(flat, 0)
            dist.broadcast(flat, 0)
        flat /= WORLD
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p)
        sgd.step()
        if ctx.rank == 3 and delay:
            time.sleep(delay)
    return clock.result(steps)


def _strategy(ctx, path: str, params: list[torch.Tensor], last_step: int) -> Strategy:
    """The table's adapter of wrapper path ``path`` around plain SGD on ``params``, with the
    launcher's timeout and last update."""
    name, args = STRATEGIES[path]
    launcher = {"timeout": 120, "last_step": last_step, "with_model": False}
    strategy = TABLE[name].adapter({**args, **launcher}, ctx.rank, WORLD)
    module = nn.ParameterList(params)
    strategy.setup(module, gradfleet.GradientDescentOptimizer(module.parameters(), 0.01))
    return strategy


def _step(strategy: Strategy, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    strategy.apply_gradients()


def _sync(ctx, path: str, count: int, steps: int, delay: float) -> Result | None:
    """Global updates per second over the updates after the warm-up, as this worker saw them;
    None if it saw none of them: TF hands tokens to whoever asks first, so a worker (often
    the chief, busy serving) can go many updates without one and first see the global step
    past the end (seen for sharded servers at 1e6 parameters)."""
    params, grads = _params(count, ctx.rank)
    strategy = _strategy(ctx, path, params, last_step=WARM + steps)
    clock, local = None, 0
    while strategy.updates(local) < WARM + steps:
        if clock is None and strategy.updates(local) >= WARM:
            clock, first = _Clock(), strategy.updates(local)
        _step(strategy, params, grads)
        local += 1
        if ctx.rank == 3 and delay:
            time.sleep(delay)
    result = None if clock is None else clock.result(strategy.updates(local) - first)
    strategy.finish()
    strategy.close()
    return result


def _p2p(ctx, count: int, steps: int) -> Result:
    params, _ = _params(count, ctx.rank)
    flat = torch.cat([p.detach() for p in params])
    dist.barrier()
    clock = _Clock()
    for _ in range(WARM + steps):
        if ctx.rank == 0:
            for peer in range(1, WORLD):
                dist.recv(flat, peer)
                dist.send(flat, peer)
        else:
            dist.send(flat, 0)
            dist.recv(flat, 0)
    return clock.result((WORLD - 1) * (WARM + steps))


def _easgd(ctx, count: int, steps: int) -> Result:
    params, grads = _params(count, ctx.rank)
    strategy = _strategy(ctx, "async_easgd", params, last_step=steps)
    dist.barrier()
    clock = _Clock()
    for _ in range(steps):
        _step(strategy, params, grads)
    clock.stop()
    dist.barrier()  # every worker done: the centre's exchange count is final
    total = sum(strategy.centre.counters()["exchanges"].values()) if ctx.rank == 0 else 0
    strategy.close()
    return clock.result(WORLD * steps if ctx.rank else total)


def _sync_ceiling(ctx, count: int, steps: int) -> Result:
    """One server's step with no framework: every worker's flat gradient to rank 0 (received
    concurrently), their average applied there, the new variables sent to every worker."""
    params, grads = _params(count, ctx.rank)
    flat = torch.cat([p.detach() for p in params])
    grad = torch.cat(grads)
    if ctx.rank == 0:
        total = torch.empty_like(flat)
        inbox = {peer: torch.empty_like(flat) for peer in range(1, WORLD)}
    dist.barrier()
    for s in range(WARM + steps):
        if s == WARM:
            clock = _Clock()
        if ctx.rank == 0:
            works = {peer: dist.irecv(buf, peer) for peer, buf in inbox.items()}
            total.copy_(grad)
            for peer, work in works.items():  # summed as they arrive, in rank order
                work.wait()
                total.add_(inbox[peer])
            flat.sub_(total, alpha=0.01 / WORLD)
            for work in [dist.isend(flat, peer) for peer in inbox]:
                work.wait()
        else:
            dist.send(grad, 0)
            dist.recv(flat, 0)
    return clock.result(steps)


def _easgd_ceiling(ctx, count: int, steps: int, alpha: float = 0.2) -> Result:
    """Asynchronous EASGD's exchanges with no framework: gloo send/recv of one flat buffer and
    the maths of ``CentreServer``/``AsyncCentre`` (reply the centre read, ``c += alpha (x -
    c)``; worker ``x -= alpha (x - c_read)``), each worker's local SGD step included.  The
    centre overlaps all it can while keeping exchanges atomic: the next worker's parameters
    are received and the reply sent while the centre updates."""
    params, grads = _params(count, ctx.rank)
    flat = torch.cat([p.detach() for p in params])
    grad = torch.cat(grads)
    diff = torch.empty_like(flat)

    def local_step() -> None:
        flat.sub_(grad, alpha=0.01)

    def pull(read: torch.Tensor) -> None:  # the worker's half of one exchange
        flat.sub_(torch.sub(flat, read, out=diff), alpha=alpha)

    dist.barrier()
    clock = _Clock()
    if ctx.rank == 0:
        centre = flat.clone()
        inbox = [torch.empty_like(flat) for _ in range(2)]
        replies = {peer: torch.empty_like(flat) for peer in range(WORLD)}
        sending: dict[int, dist.Work] = {}
        order = [peer for _ in range(steps) for peer in range(WORLD)]  # 0: own worker
        remote = [peer for peer in order if peer]  # the i-th remote exchange uses inbox[i % 2]
        receiving = {0: dist.irecv(inbox[0], remote[0])}
        i = 0
        for peer in order:
            if peer == 0:
                local_step()
                x = flat
            else:
                receiving.pop(i).wait()
                x = inbox[i % 2]
                if i + 1 < len(remote):  # the next one arrives while this one is served
                    receiving[i + 1] = dist.irecv(inbox[(i + 1) % 2], remote[i + 1])
                i += 1
            if peer in sending:
                sending.pop(peer).wait()
            replies[peer].copy_(centre)  # the snapshot the worker gets
            if peer:
                sending[peer] = dist.isend(replies[peer], peer)
            centre.add_(torch.sub(x, centre, out=diff), alpha=alpha)
            if peer == 0:
                pull(replies[0])
        for work in sending.values():
            work.wait()
    else:
        read = torch.empty_like(flat)
        for _ in range(steps):
            local_step()
            dist.send(flat, 0)
            dist.recv(read, 0)
            pull(read)
    return clock.result(WORLD * steps if ctx.rank == 0 else steps)


def _rank(ctx, path: str, count: int, steps: int, delay: float) -> Result | None:
    torch.set_num_threads(1)  # one process per worker on a shared host, as torchrun sets it
    if path in ("allreduce", "allreduce_straggler", "reduce_broadcast"):
        return _collective(ctx, path, count, steps, delay)
    if path == "p2p_roundtrip":
        return _p2p(ctx, count, steps)
    if path == "async_easgd":
        return _easgd(ctx, count, steps)
    if path == "sync_ceiling":
        return _sync_ceiling(ctx, count, steps)
    if path == "easgd_ceiling":
        return _easgd_ceiling(ctx, count, steps)
    return _sync(ctx, path, count, steps, delay)


def sweep(counts: list[int], seconds: float, log=print, paths=PATHS, min_steps=6) -> list[dict]:
    """One row per parameter count: updates/s of every path and the ratios."""
    for path in paths:  # a clear error before any rank starts
        if path in STRATEGIES:
            validate_strategy(*STRATEGIES[path], WORLD)
    rows = []
    for count in counts:
        steps = max(min_steps, int(seconds * 2e7 / count))
        row: dict = {"params": count, "steps": steps}
        for path in paths:
            delay = row.get("straggler_delay_s", 0.0) if path.endswith("straggler") else 0.0
            out = run_ranks(
                _rank, WORLD, args=(path, count, steps, delay), timeout=600, pg_timeout=300
            )
            # rank 0's figure; a SyncReplicas worker that saw no update after the warm-up
            # has none, and then the next rank's counts (they count the same global updates)
            value = next((r[0] for r in out if r is not None), None)
            if value is None:
                raise RuntimeError(f"{path} at {count:.0e}: no worker saw an update after warm-up")
            row[path] = value
            # CPU per counted unit: the cores all ranks kept busy over their windows, divided
            # by the rate (ranks without a window are left out)
            row.setdefault("cpu_ms", {})[path] = 1e3 * sum(r[1] for r in out if r) / value
            if path == "sync_backup":  # the straggler sleeps as long as a step takes
                row["straggler_delay_s"] = 1.0 / value
            log(f"params={count:.0e} {path}: {value:.2f}/s")
        row["ratios"] = {
            k: row[a] / row[b] for k, (a, b) in RATIOS.items() if a in row and b in row
        }
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rates and ratios, then the CPU milliseconds all ranks spent per counted unit."""
    head = "| parameters | " + " | ".join(PATHS) + " | " + " | ".join(RATIOS) + " |"
    lines = [head, "|" + "---|" * (1 + len(PATHS) + len(RATIOS))]
    for r in rows:
        cells = [f"{r[p]:.2f}" for p in PATHS] + [f"{r['ratios'][k]:.2f}" for k in RATIOS]
        lines.append(f"| {r['params']:.0e} | " + " | ".join(cells) + " |")
    lines += ["", "CPU ms per update (round trip, exchange), all 4 ranks:", ""]
    lines += ["| parameters | " + " | ".join(PATHS) + " |", "|" + "---|" * (1 + len(PATHS))]
    for r in rows:
        cells = [f"{r['cpu_ms'][p]:.2f}" if p in r.get("cpu_ms", {}) else "-" for p in PATHS]
        lines.append(f"| {r['params']:.0e} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [r["params"] for r in rows]
    for p in PATHS:
        ax.plot(xs, [r[p] for r in rows], marker="o", label=p)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("float32 parameters (9 tensors)")
    ax.set_ylabel("updates/s (EASGD, p2p: round trips/s at rank 0)")
    ax.set_title("4 gloo ranks on one host: data plane vs gloo baselines")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
