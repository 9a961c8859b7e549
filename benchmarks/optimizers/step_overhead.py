"""Per-parameter cost of ``step()`` where the kernels' work is negligible (``--overhead N``).

``python -m benchmarks.optimizers.optimizer_speed --overhead 200`` runs every fused optimizer on N
float32 parameters of ``--overhead-numel`` elements (16 by default: a few nanoseconds of
maths each), so a step's time is its per-step and per-parameter bookkeeping plus the calls
into the compiled kernels.  Reported per parameter (step time / N), as the median of the
timed steps after warm-up, beside ``torch.optim.Adam(fused=True)`` on copies of the same
tensors, timed in alternation with each row (so a busy machine slows both alike):

* wall clock around ``step()``;
* CPU time of the calling thread (``time.thread_time``), which other jobs on a shared
  machine distort less than the wall clock (both kernels here run on the calling thread).

The figure includes the fixed per-step costs (hyperparameters, ``_finish``), spread over N.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.optimizers.speed_setup import build, fresh_parameters, gradfleet_configs, machine


def _timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def time_pair(step, partner, warmup: int, reps: int) -> dict[str, float]:
    """Medians of ``step`` and ``partner`` (wall and thread CPU seconds), in alternation."""
    for _ in range(warmup):
        step()
        partner()
    mine, theirs = [], []
    for _ in range(reps):
        mine.append(_timed(step))
        theirs.append(_timed(partner))
    return {
        "wall_s": statistics.median(t[0] for t in mine),
        "cpu_s": statistics.median(t[1] for t in mine),
        "partner_wall_s": statistics.median(t[0] for t in theirs),
        "partner_cpu_s": statistics.median(t[1] for t in theirs),
        "wall_ratio": statistics.median(a[0] / b[0] for a, b in zip(mine, theirs)),
    }


def run(args) -> dict[str, Any]:
    n, numel = args.overhead, args.overhead_numel
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(numel, generator=gen) for _ in range(n)]
    grads = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(n)]
    adam = torch.optim.Adam(fresh_parameters(params, grads), fused=True)
    print(f"{n} float32 parameters of {numel} elements; fused path", flush=True)
    rows = []
    for cls, (config, make) in gradfleet_configs().items():
        if args.only and cls.__name__ not in args.only:
            continue
        try:
            opt = build(cls, config, make, fresh_parameters(params, grads), "fused")
            opt.step()  # compiles
        except NotImplementedError:
            continue  # abstract base class
        stats = time_pair(opt.step, adam.step, args.warmup, args.reps)
        row = {"optimizer": cls.__name__, **stats}
        for key in ("wall_s", "cpu_s", "partner_wall_s", "partner_cpu_s"):
            row[key.replace("_s", "_us_per_param")] = stats[key] / n * 1e6
        rows.append(row)
        print(format_row(row), flush=True)
    return {
        "machine": machine(torch.device("cpu")),
        "mode": "overhead",
        "parameters": n,
        "numel": numel,
        "full_steps": args.full_steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "rows": rows,
    }


HEADER = (
    f"{'optimizer':<34}{'us/param wall':>14}{'CPU':>8}{'torch fused Adam wall':>23}{'CPU':>8}"
    f"{'time / Adam':>13}"
)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['optimizer']:<34}{r['wall_us_per_param']:>14.2f}{r['cpu_us_per_param']:>8.2f}"
        f"{r['partner_wall_us_per_param']:>23.2f}{r['partner_cpu_us_per_param']:>8.2f}"
        f"{r['wall_ratio']:>13.2f}"
    )


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"\n{m['cpu']}, {m['cores']} cores, torch {m['torch']}, load {m['load_average']}")
    print(f"{result['parameters']} parameters of {result['numel']} elements; per parameter:")
    print(HEADER)
    for row in result["rows"]:
        print(format_row(row))
