"""One worker of the cluster benchmark, started by torchrun on each emulated host.

The workload is a real model: an MLP (3 hidden layers, width chosen for ``--params``) learning
the labels of a fixed linear teacher (4 classes, Gaussian inputs), trained with Adam.  Each
rank draws its own batches.  Phases:

1. calibrate: two forward/backward passes of the bare model; the second's time is this host's
   compute time ``c``.  ``--device-time S`` adds ``S`` seconds of emulated accelerator time
   to every forward/backward (:class:`DeviceTime`: sleeps, a third in forward and two thirds
   in backward, spread over the layers), during which the CPU is free, as while a GPU
   computes; ``c`` includes it.  ``--slowdown`` names a compute slowdown schedule
   (:mod:`benchmarks.cluster.cluster_slowdown`): at its local training step ``s``, host ``h`` sleeps
   ``(f - 1) * c`` before the forward, ``f = factor_at(h, s)`` (a machine ``f`` times slower
   for that step).
2. transfer-only: ``warmup_updates`` updates of communication alone on zero gradients, not
   timed (connections, first messages, TCP's slow start), then ``transfer_updates`` timed.
3. training: ``--updates`` more updates; every step's wall clock, loss and update count
   is recorded, with its slowdown factor; at the end, where the optimizer keeps it
   (``SyncReplicasOptimizer.replicas_history()``), the number of gradients each update so far
   applied.

The rows of ``--rows`` run one after the other in the same job: start-up (interpreters, torch
imports, rendezvous) costs about a minute on the shared 2 cores, paid once per scenario.
A host from ``--workers`` on is a dedicated server host: for each row it runs
:class:`gradfleet.distributed.ParameterServer` (built with the workers' wrappers, serving until
they leave), taking part in the same barriers, and writes no record.

Writes ``<out>/rank-<r>.json`` (one record per row, workers only).  ``faulthandler`` dumps
every thread's traceback and exits if the worker overruns ``--deadline`` seconds: a hang is
reported.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script by torchrun

import gradfleet.distributed as gfd  # noqa: E402
from benchmarks.cluster.cluster_slowdown import Slowdown, from_spec  # noqa: E402
from benchmarks.cluster.cluster_table import Context, RowStrategy  # noqa: E402

INPUTS, CLASSES, HIDDEN_LAYERS = 256, 4, 3


def width_for(params: float, layers: int = HIDDEN_LAYERS) -> int:
    """Hidden width w with D*w + (L-1)*w^2 + w*C (+ biases) closest to ``params``."""
    a, b = layers - 1, INPUTS + CLASSES + layers
    return max(1, round((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)))


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class DeviceTime(nn.Module):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward: a layer's
    time on an accelerator, during which this host's CPU is free (on 2 shared cores, real
    compute would take the CPU that the emulated hosts' transfers need)."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.forward_s, self.backward_s)


def build_model(params: float, seed: int, device_time: float = 0.0) -> nn.Module:
    """The MLP; ``device_time`` seconds of emulated accelerator time per forward/backward,
    a third in forward and two thirds in backward, an equal share after every layer."""
    torch.manual_seed(seed)
    w = width_for(params)
    layers: list[nn.Module] = [nn.Linear(INPUTS, w), nn.ReLU()]
    for _ in range(HIDDEN_LAYERS - 1):
        layers += [nn.Linear(w, w), nn.ReLU()]
    layers.append(nn.Linear(w, CLASSES))
    if device_time > 0:
        share = device_time / (HIDDEN_LAYERS + 1)
        with_time: list[nn.Module] = []
        for layer in layers:
            with_time.append(layer)
            if isinstance(layer, nn.Linear):
                with_time.append(DeviceTime(share / 3, 2 * share / 3))
        layers = with_time
    return nn.Sequential(*layers)


class Teacher:
    """Labels from a fixed random linear map: learnable, and the same on every rank."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed + 7919)
        self.weight = torch.randn(INPUTS, CLASSES, generator=gen)

    def batch(self, size: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
        x = torch.randn(size, INPUTS, generator=gen)
        return x, (x @ self.weight).argmax(dim=1)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", required=True, help="JSON list of {key, strategy, options, "
                   "transfer_updates}: run one after the other in this job")  # fmt: skip
    p.add_argument("--params", type=float, default=10e6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device-time", type=float, default=0.0,
                   help="seconds of emulated accelerator time per forward/backward")  # fmt: skip
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--slowdown", default="", help="JSON of a compute slowdown schedule "
                   "(benchmarks.cluster.cluster_slowdown.to_spec; default: none)")  # fmt: skip
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--fast-hosts", default="", help="comma-separated host indices for servers")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="hosts 0..W-1 train, the others only serve (default: every host trains)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=300.0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for stacks
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    torch.set_num_threads(1)  # four hosts share two cores: no oversubscription
    info = gfd.init(backend="gloo", timeout=args.deadline)
    host = int(os.environ["GF_CLUSTER_HOST"])
    hosts: list[int] = [0] * info.world_size
    dist.all_gather_object(hosts, host)
    workers = args.workers or info.world_size
    servers = [r for r in range(info.world_size) if hosts[r] >= workers]  # ranks N.. (static)
    fast = [int(h) for h in args.fast_hosts.split(",") if h] or sorted(set(hosts))
    ctx = Context(info.rank, workers, host, hosts, os.environ["GF_CLUSTER_ADDR"], fast,
                  server_ranks=servers)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for row in json.loads(args.rows):
        if host >= workers:
            serve_row(ctx, args)
            continue
        records.append({"key": row["key"], **run_row(ctx, row, args)})
        (args.out / f"rank-{info.rank}.json").write_text(json.dumps(records))
    faulthandler.cancel_dump_traceback_later()
    gfd.shutdown()


def run_row(ctx: Context, row: dict, args: argparse.Namespace) -> dict:
    """One strategy from a fresh model: transfer-only phase, then the timed training phase."""
    model, teacher = build_model(args.params, args.seed, args.device_time), Teacher(args.seed)
    compute_s = calibrate(model, teacher, args.batch)
    slowdown: Slowdown | None = from_spec(json.loads(args.slowdown)) if args.slowdown else None
    options = dict(row.get("options", {}))
    scale = int(options.pop("steps_scale", 1))
    warmup = int(row.get("warmup_updates", 1))
    first = warmup + int(row.get("transfer_updates", 2))
    total = first + args.updates * scale
    strategy = RowStrategy(row["strategy"], options, ctx, model, args.lr, last_step=total)
    record = {"rank": ctx.rank, "host": ctx.host, "compute_s": compute_s}
    dist.barrier()
    while strategy.updates() < warmup:  # not timed: a transfer of a job already running
        strategy.transfer_step()
    start, done = time.time(), strategy.updates()
    while strategy.updates() < first:
        strategy.transfer_step()
    record["transfer"] = {"seconds": time.time() - start, "updates": strategy.updates() - done}
    dist.barrier()
    steps, factors, local = [], [], 0
    record["train_start"] = time.time()
    while strategy.updates() < total:
        factor = slowdown.factor_at(ctx.host, local) if slowdown else 1.0
        if factor > 1:
            time.sleep((factor - 1) * compute_s)
        x, y = teacher.batch(args.batch, ctx.rank, local)
        loss = strategy.train_step(x, y)
        local += 1
        steps.append((time.time(), loss, strategy.updates()))
        factors.append(factor)
    record.update(steps=steps, factors=factors, first_update=first, last_update=total)
    history = replicas_history(strategy)
    if history is not None:
        record["replicas_history"] = history
    exchange = getattr(strategy.opt, "exchange", None)
    members = getattr(exchange, "history", None)
    if members is not None:  # backups without a server: the ranks in each update, the waits
        record["members"] = [list(map(int, m)) for m in members]
        rule = exchange.deference
        record["deference"] = {"waits": rule.waits, "waited": rule.waited, "pace": rule.pace(),
                               "grace": rule.grace()}  # fmt: skip
    strategy.close()
    dist.barrier()
    return record


def replicas_history(strategy: RowStrategy) -> list[int] | None:
    """The gradients each update so far applied (index: update number), where the strategy's
    optimizer keeps them (``SyncReplicasOptimizer.replicas_history()``); None elsewhere."""
    history = getattr(strategy.opt, "replicas_history", None)
    return None if history is None else [int(r) for r in history()]


def serve_row(ctx: Context, args: argparse.Namespace) -> None:
    """A dedicated server host's part of one row: the server is built together with the
    workers' wrapper; it serves until they close, through the same barriers as ``run_row``."""
    server = gfd.ParameterServer(lambda groups: torch.optim.Adam(groups, lr=args.lr),
                                 host=ctx.address)  # fmt: skip
    dist.barrier()  # set up
    dist.barrier()  # transfer-only phase done
    server.join()  # the workers' close()
    dist.barrier()


def calibrate(model: nn.Module, teacher: Teacher, batch: int) -> float:
    """Seconds of one forward+backward of the bare model (the second of two passes)."""
    seconds = 0.0
    for i in range(2):
        x, y = teacher.batch(batch, -1, i)
        start = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


if __name__ == "__main__":
    main()
