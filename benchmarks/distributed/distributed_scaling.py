"""Straggler benchmark for the distributed wrappers: 4 CPU workers (gloo), with/without a straggler.

For each wrapper it runs 4 ranks for ``--seconds`` seconds (a 3-64-64-1 MLP, batch 32, plain SGD)
and reports, from rank 0: optimizer steps per second (for SyncReplicas also global updates per
second), and bytes each worker sends per step.  With ``--delay`` rank 3 sleeps after every step.
The wrappers are strategies of the CLI's table (:data:`gradfleet.cli.strategy_table.TABLE`)
with the arguments of :data:`CONFIGS`, run by the table's adapters as ``gradfleet train
--strategy NAME:ARGS`` runs them, but for the model: sync-replicas is not given it (one server
holding every parameter, where the CLI lays the shards out for the model).

    python -m benchmarks.distributed.distributed_scaling [--seconds 4] [--delay 0.05]
                                                         [--out benchmarks/results]
    python -m benchmarks.distributed.distributed_scaling --params 1e5,1e6,1e7,1e8 [--seconds 4]

``--params``: the model-size sweep of ``distributed_sweep`` (data plane against gloo
all-reduce, reduce+broadcast and point-to-point baselines, straggler columns at every size),
written to ``distributed_sweep.{json,md,png}``.

Writes ``distributed_scaling.json``, ``distributed_scaling.md`` (table) and
``distributed_scaling.png`` (bar plot).  Byte counts: the server / centre paths count what this
worker sends (control JSON + tensor bytes on its pair groups); the all-reduce paths report the
ring all-reduce estimate ``2 (N-1)/N * parameter bytes`` per round (gloo is not instrumented).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

import gradfleet
from gradfleet.cli.strategies import Strategy
from gradfleet.cli.strategy_table import TABLE, tolerated_losses, validate_strategy
from gradfleet.distributed.testing import run_ranks

WORLD = 4
# row -> (table strategy, its arguments)
CONFIGS: dict[str, tuple[str, dict]] = {
    "allreduce": ("allreduce", {}),
    "sync_replicas_backup1": ("sync-replicas", {"replicas_to_aggregate": 3, "transport": "server"}),
    "model_average": ("model-average", {"interval": 4}),
    "async_easgd": ("easgd", {"mode": "async", "period": 4, "rho": 0.0}),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _ring_bytes(model: nn.Module) -> float:
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return 2 * (WORLD - 1) / WORLD * size


def _worker(ctx, config: str, seconds: float, delay: float) -> dict:
    name, args = CONFIGS[config]
    last_step = int(seconds * 60)
    # the launcher's arguments (the strategies that take none ignore them): last_step releases
    # every worker at the end (a clock would strand late workers); with_model: module doc
    launcher = {"timeout": 30, "last_step": last_step, "with_model": False}
    strategy = TABLE[name].adapter({**args, **launcher}, ctx.rank, WORLD)
    model = _model()
    strategy.setup(model, gradfleet.GradientDescentOptimizer(model.parameters(), 0.01))
    gen = torch.Generator().manual_seed(ctx.rank)
    # collectives in lockstep need the same step count on every rank: a fixed budget, not a
    # clock; sync-replicas runs until its last update
    budget = None
    if tolerated_losses(name, args, WORLD) == 0:
        budget = int(seconds / (delay + 0.01)) if delay else int(seconds * 100)
    steps, start = 0, time.monotonic()
    while not _finished(name, strategy, steps, budget, start, seconds, last_step):
        x = torch.randn(32, 3, generator=gen)
        strategy.train_step(x, x.sum(1, keepdim=True), _loss)
        steps += 1
        if ctx.rank == 3 and delay:
            time.sleep(delay)
    elapsed = time.monotonic() - start
    out = {"steps": steps, "elapsed": elapsed}
    if name == "sync-replicas":
        out["bytes_per_step"] = strategy.bytes_sent / steps
        out["global_steps"] = strategy.updates(steps)
    elif name == "easgd":
        out["bytes_per_step"] = strategy.centre.bytes_sent / steps
    else:
        interval = int(args.get("interval", 1))  # model-average: a round every interval steps
        out["bytes_per_step"] = _ring_bytes(model) / interval
    strategy.finish()
    strategy.close()
    return out


def _finished(
    name: str,
    strategy: Strategy,
    steps: int,
    budget: int | None,
    start: float,
    seconds: float,
    last_step: int,
) -> bool:
    if name == "sync-replicas":
        return strategy.updates(steps) >= last_step  # the global step
    if budget is not None:
        return steps >= budget
    return time.monotonic() - start >= seconds


def measure(config: str, seconds: float, delay: float) -> dict:
    out = run_ranks(_worker, WORLD, args=(config, seconds, delay), timeout=seconds * 10 + 60)
    r0 = out[0]
    row = {
        "config": config,
        "straggler_delay_s": delay,
        "steps_per_s_rank0": r0["steps"] / r0["elapsed"],
        "steps_per_s_mean": sum(o["steps"] / o["elapsed"] for o in out) / WORLD,
        "bytes_per_worker_step": sum(o["bytes_per_step"] for o in out) / WORLD,
    }
    if "global_steps" in r0:
        row["global_updates_per_s"] = r0["global_steps"] / r0["elapsed"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--delay", type=float, default=0.05)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    ap.add_argument("--params", default="", help="comma-separated sizes: the sweep")
    args = ap.parse_args()
    if args.params:
        return run_sweep(args)
    for name, strategy_args in CONFIGS.values():  # a clear error before any rank starts
        validate_strategy(name, strategy_args, WORLD, TABLE)
    rows = []
    for config in CONFIGS:
        for delay in (0.0, args.delay):
            rows.append(measure(config, args.seconds, delay))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta(args.seconds)
    (out / "distributed_scaling.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2)
    )
    (out / "distributed_scaling.md").write_text(table(rows, args.delay))
    plot(rows, args.delay, out / "distributed_scaling.png")
    print(table(rows, args.delay))


def _meta(seconds: float) -> dict:
    return {
        "world": WORLD,
        "seconds": seconds,
        "torch": torch.__version__,
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "machine": __import__("platform").processor() or __import__("platform").machine(),
        # 1/5/15-minute load averages when the run ended: > cpus means it shared the machine
        "load_average": list(__import__("os").getloadavg()),
    }


def run_sweep(args: argparse.Namespace) -> None:
    from benchmarks.distributed import distributed_sweep as sweep

    counts = [int(float(c)) for c in args.params.split(",")]
    rows = sweep.sweep(counts, args.seconds, log=lambda line: print(line, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "distributed_sweep.json").write_text(
        json.dumps({"meta": _meta(args.seconds), "rows": rows}, indent=2)
    )
    (out / "distributed_sweep.md").write_text(sweep.table(rows))
    sweep.plot(rows, out / "distributed_sweep.png")
    print(sweep.table(rows))


def table(rows: list[dict], delay: float) -> str:
    by = {(r["config"], r["straggler_delay_s"] > 0): r for r in rows}
    lines = [
        f"| wrapper (4 workers) | steps/s rank 0 | steps/s rank 0, straggler {delay * 1000:.0f} ms "
        "| kept | global updates/s (no straggler / straggler) | bytes/worker/step |",
        "|---|---|---|---|---|---|",
    ]
    for c in CONFIGS:
        a, b = by[(c, False)], by[(c, True)]
        upd = (
            f"{a['global_updates_per_s']:.1f} / {b['global_updates_per_s']:.1f}"
            if "global_updates_per_s" in a
            else "-"
        )
        lines.append(
            f"| {c} | {a['steps_per_s_rank0']:.1f} | {b['steps_per_s_rank0']:.1f} | "
            f"{_kept(a, b):.0%} | {upd} | "
            f"{a['bytes_per_worker_step']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _kept(a: dict, b: dict) -> float:
    """Straggler/no-straggler ratio: global updates for SyncReplicas, rank 0's steps else."""
    key = "global_updates_per_s" if "global_updates_per_s" in a else "steps_per_s_rank0"
    return b[key] / a[key]


def plot(rows: list[dict], delay: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["config"], r["straggler_delay_s"] > 0): r for r in rows}
    xs = range(len(CONFIGS))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(
        [x - 0.2 for x in xs],
        [by[(c, False)]["steps_per_s_rank0"] for c in CONFIGS],
        0.4,
        label="no straggler",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [by[(c, True)]["steps_per_s_rank0"] for c in CONFIGS],
        0.4,
        label=f"rank 3 sleeps {delay * 1000:.0f} ms/step",
    )
    ax.set_xticks(list(xs), CONFIGS)
    ax.set_ylabel("steps/s (rank 0)")
    ax.set_title("4 CPU workers (gloo, 2 cores): throughput with and without a straggler")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
