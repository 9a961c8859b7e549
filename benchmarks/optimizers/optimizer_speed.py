"""Step time, effective bandwidth and peak extra memory of every optimizer on every path.

Run from the repository root::

    python -m benchmarks.optimizers.optimizer_speed --out benchmarks/results

It writes ``optimizer_speed.json`` and ``optimizer_speed.png`` under ``--out`` and prints
the table.  Method:

* Device: ``--device cpu`` (default), ``cuda`` or ``cuda:N``.
* Parameters: ``--preset`` (``benchmarks/optimizers/speed_setup.py``): ``default``, a
  transformer-like set of ~16.8M float32 parameters in 41 tensors; ``transformer-134m`` (134M
  in 81); ``small-tensors`` (6.8M in 99, 62 of them biases and norm weights of 256-1024
  elements).
  ``--params N`` rescales the preset's width.  Gradients are fixed random tensors, so every
  path of every optimizer moves the same data.
* Step time: median of ``--reps`` steps after ``--warmup`` steps; on CPU the wall clock
  around ``step()``, on CUDA CUDA events around it after draining the queue.  Effective
  bandwidth: minimal bytes a step must move (read+write the parameter and each
  parameter-sized slot, read the gradient) / step time.
* Baselines, on copies of the same tensors in the same run: ``torch.optim.Adam(fused=True)``,
  timed in alternation with every row (step, Adam step, step, ...); ratios to it are the
  median of the per-pair ratios, so a slow spell of a shared machine cancels.  For the
  optimizers torch also has, torch's fastest implementation (of fused / foreach /
  for-loop) of the nearest equivalent.
* Memory ceilings: the eager ``p += a * g`` update (GradientDescent's shape) and a
  read-only pass over the gradients, each against fused Adam the same way.
* Peak extra memory: the peak of torch's live CPU allocations during one step above the
  allocations alive before it, from ``torch.profiler`` memory events (allocator-agnostic:
  glibc's caching cannot hide a temporary); on CUDA the caching allocator's peak.
* Fused compile time: first step minus a steady step, in a fresh inductor cache directory
  (a cold compile, as a new machine sees it); inductor's one-time start-up in a process
  (CPU feature probes) is measured first and reported on its own.

``--overhead N`` measures instead the per-parameter cost of a fused ``step()`` on N tiny
parameters, beside torch's fused Adam's (``benchmarks/optimizers/step_overhead.py``; writes
``step_overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.optimizers import speed_setup, step_overhead
from benchmarks.optimizers.speed_setup import fresh_parameters, parameter_shapes
from gradfleet import kernels

__all__ = ["main", "parameter_shapes", "peak_extra_mib"]

TORCH_EQUIVALENT = {  # gradfleet class -> (torch class, extra kwargs)
    "AdadeltaOptimizer": ("Adadelta", {"lr": 1.0}),
    "AdagradOptimizer": ("Adagrad", {}),
    "AdamOptimizer": ("Adam", {}),
    "RMSPropOptimizer": ("RMSprop", {}),
    "MomentumOptimizer": ("SGD", {"momentum": 0.9}),
}


def make_tensors(shapes, seed: int = 0, device: torch.device | str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for s in shapes]
    return params, grads


# ------------------------------------------------------------------ measurement
def peak_extra_mib(step, device: torch.device | None = None) -> float:
    """Peak of torch's live CPU allocations during one ``step()`` above those before (MiB).

    From the profiler's allocation/free events, so cached or reused memory cannot hide a
    temporary; allocations outside torch's allocator (e.g. compiler scratch) are not seen.
    On a CUDA ``device``: the CUDA caching allocator's peak above what was live before.
    """
    if device is not None and device.type == "cuda":
        return speed_setup.peak_extra_cuda_mib(step, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def time_steps(step, warmup: int, reps: int, partner=None, device=None) -> dict[str, float]:
    """Median step time; with ``partner`` (torch's fused Adam) timed in alternation, so
    both see the same load on a shared machine and their ratio stays meaningful."""
    device = torch.device("cpu") if device is None else device
    timed = speed_setup.step_clock(device)
    first = speed_setup.wall_clock(device, step)
    for _ in range(max(warmup - 1, 0)):
        step()
    times, partner_times = [], []
    for _ in range(reps):
        times.append(timed(step))
        if partner is not None:
            partner_times.append(timed(partner))
    median = statistics.median(times)
    out = {"first_s": first, "median_s": median, "min_s": min(times), "max_s": max(times)}
    if partner_times:
        out["partner_median_s"] = statistics.median(partner_times)
        # Paired: each step against the partner step right after it, so a slow spell of a
        # shared machine slows both sides of a pair and cancels in the ratio.
        ratios = [t / p for t, p in zip(times, partner_times)]
        out["time_ratio_to_partner"] = statistics.median(ratios)
    return out


def memory_ceilings(params, grads, warmup: int, reps: int, partner, device) -> dict[str, Any]:
    """What this machine's memory system gives ATen's own eager kernels (no optimizer), each
    as bandwidth and as a fraction of torch fused Adam's, timed in alternation with it:

    * ``p += a*g``: one multiply-add update, GradientDescent's minimal traffic;
    * a read-only pass over the gradients (BLAS dot), the extra pass a whole-tensor norm
      needs when the gradient does not stay in cache;
    * NormalizedSGD's minimal work, per tensor: ``dot(g, g)`` then ``p += a*g``; its
      bandwidth counts the same 3 passes as NormalizedSGD's rows, so it is the ceiling
      those rows can reach on this machine.
    """
    ps = [p.clone() for p in params]
    flat = [g.reshape(-1) for g in grads]
    nbytes = sum(g.numel() * g.element_size() for g in grads)

    def norm_then_update():
        for p, g in zip(ps, flat):
            torch.dot(g, g)
            p.view(-1).add_(g, alpha=-1e-3)

    probes = {  # name -> (kernel, counted passes over a parameter-sized tensor)
        "update p += a*g": (lambda: torch._foreach_add_(ps, grads, alpha=-1e-3), 3),
        "read-only pass over g": (lambda: [torch.dot(g, g) for g in flat], 1),
        "norm then update (NormalizedSGD's work)": (norm_then_update, 3),
    }
    out = {}
    for name, (fn, passes) in probes.items():
        stats = time_steps(fn, warmup, reps, partner, device)
        gbps = nbytes * passes / stats["median_s"] / 1e9
        ratio = passes / 7 / stats["time_ratio_to_partner"]  # Adam moves 7 passes
        out[name] = {"median_s": stats["median_s"], "gbps": gbps, "vs_torch_fused_adam": ratio}
    return out


def inductor_startup_s(device: torch.device) -> float:
    """The one-time cost of the first fused compile in a process (inductor probes the CPU's
    vector instruction sets by building test programs), measured on a one-tensor step so
    that each row's compile time is its own."""
    import gradfleet as gf

    p = torch.nn.Parameter(torch.zeros(8, device=device))
    p.grad = torch.ones(8, device=device)
    opt = gf.GradientDescentOptimizer([p], 0.1, fused=True)
    return speed_setup.wall_clock(device, opt.step)


def minimal_bytes(params, state_tensors_per_param: int) -> int:
    per_element = 3 + 2 * state_tensors_per_param  # p r/w, g r, each slot r/w
    return sum(p.numel() * p.element_size() for p in params) * per_element


def measure(opt, params, warmup: int, reps: int, partner=None) -> dict[str, Any]:
    device = params[0].device
    stats = time_steps(opt.step, warmup, reps, partner, device)
    big = params[0]
    slots = sum(1 for t in opt.state[big].values() if torch.is_tensor(t) and t.shape == big.shape)
    stats["bytes"] = minimal_bytes(params, slots)
    stats["gbps"] = stats["bytes"] / stats["median_s"] / 1e9
    stats["peak_extra_mib"] = peak_extra_mib(opt.step, device)
    return stats


# ------------------------------------------------------------------ baselines
def torch_best(name: str, kwargs: dict, params, grads, warmup, reps) -> dict[str, Any]:
    """torch's fastest implementation of ``torch.optim.<name>`` on these tensors."""
    best: dict[str, Any] | None = None
    impls = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}
    for impl, flags in impls.items():
        try:
            opt = getattr(torch.optim, name)(fresh_parameters(params, grads), **kwargs, **flags)
            stats = measure(opt, opt.param_groups[0]["params"], warmup, reps)
        except (RuntimeError, TypeError, ValueError):
            continue  # this implementation does not exist for this class on this device
        stats["impl"] = impl
        if best is None or stats["median_s"] < best["median_s"]:
            best = stats
    assert best is not None
    return best


def run(args) -> dict[str, Any]:
    torch.manual_seed(0)
    device = args.device
    if device.type == "cuda":
        torch.cuda.set_device(device)  # events record on this device's current stream
    override = {"width": args.width, "layers": args.layers, "vocab": args.vocab}
    shapes = speed_setup.preset_shapes(args.preset, args.params, **override)
    params, grads = make_tensors(shapes, device=device)
    n = sum(p.numel() for p in params)
    small = sum(1 for p in params if p.numel() <= 4096)
    print(
        f"{n / 1e6:.1f}M float32 parameters in {len(shapes)} tensors ({small} of <= 4096 "
        f"elements) on {device}; {torch.get_num_threads()} threads",
        flush=True,
    )
    compiles = {"fused", "default"} & set(args.paths)
    startup = inductor_startup_s(device) if compiles else None
    adam = torch.optim.Adam([*fresh_parameters(params, grads)], fused=True)
    ref = measure(adam, adam.param_groups[0]["params"], args.warmup, args.reps)
    baselines = {"Adam(fused=True)": ref}
    if "default" in args.paths:  # what a torch user gets without flags (foreach on CUDA)
        plain = torch.optim.Adam([*fresh_parameters(params, grads)])
        plain_params = plain.param_groups[0]["params"]
        baselines["Adam()"] = measure(plain, plain_params, args.warmup, args.reps)
    ceilings = memory_ceilings(params, grads, args.warmup, args.reps, adam.step, device)
    rows = []
    for cls, (config, make) in speed_setup.gradfleet_configs().items():
        if args.only and cls.__name__ not in args.only:
            continue
        equiv = TORCH_EQUIVALENT.get(cls.__name__)
        if equiv is not None:
            key = f"{equiv[0]}{equiv[1] or ''}"
            if key not in baselines:
                baselines[key] = torch_best(*equiv, params, grads, args.warmup, args.reps)
        for path in args.paths:
            ps = fresh_parameters(params, grads)
            try:
                opt = speed_setup.build(cls, config, make, ps, path)
                stats = measure(opt, ps, args.warmup, args.reps, adam.step)
            except NotImplementedError:
                break  # abstract base class
            stats.update(optimizer=cls.__name__, path=path, config=repr(config))
            if path == "default":
                stats["resolved"] = kernels.resolve_path(opt, opt.param_groups[0])
            if "fused" in (path, stats.get("resolved")):
                stats["compile_s"] = stats["first_s"] - stats["median_s"]
            # Ratios against torch's fused Adam timed in alternation with this row.
            ratio = stats["time_ratio_to_partner"]
            stats["time_vs_torch_fused_adam"] = ratio
            stats["bw_vs_torch_fused_adam"] = stats["bytes"] / ref["bytes"] / ratio
            if equiv is not None:
                best = baselines[key]
                stats["torch_equivalent"] = f"{key} [{best['impl']}]"
                stats["time_vs_torch_equivalent"] = stats["median_s"] / best["median_s"]
            rows.append(stats)
            print(format_row(stats), flush=True)
    return {
        "machine": speed_setup.machine(device),
        "device": str(device),
        "preset": args.preset,
        "parameters": n,
        "tensors": len(shapes),
        "small_tensors": small,
        "warmup": args.warmup,
        "reps": args.reps,
        "baselines": baselines,
        "ceilings": ceilings,
        "inductor_startup_s": startup,
        "fused_cuda_options": args.fused_options,
        # FX graph cache hits, misses and bypasses of this process's compiles: whether a
        # first step's time was a compile or a load from inductor's on-disk cache
        "inductor_counters": _inductor_counters(),
        "full_steps": args.full_steps,
        "rows": rows,
    }


def _inductor_counters() -> dict[str, int]:
    if "torch._dynamo.utils" not in sys.modules:  # nothing compiled in this process
        return {}
    from torch._dynamo.utils import counters

    return {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph")}


# ------------------------------------------------------------------ output
HEADER = (
    f"{'optimizer':<34}{'path':<9}{'ms/step':>9}{'GB/s':>7}{'x Adam':>8}{'bw/Adam':>8}"
    f"{'x torch eq':>11}{'peak MiB':>9}{'compile s':>10}"
)


def format_row(r: dict[str, Any]) -> str:
    def num(key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "-"

    return (
        f"{r['optimizer']:<34}{r['path']:<9}{r['median_s'] * 1e3:>9.1f}{r['gbps']:>7.1f}"
        f"{r['time_vs_torch_fused_adam']:>8.2f}{r['bw_vs_torch_fused_adam']:>8.2f}"
        f"{num('time_vs_torch_equivalent', '.2f'):>11}{num('peak_extra_mib', '.0f'):>9}"
        f"{num('compile_s', '.1f'):>10}"
    )


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    gpu = f"{m['gpu']} ({result['device']}), " if m.get("gpu") else ""
    print(f"\n{gpu}{m['cpu']}, {m['cores']} cores, torch {m['torch']}, load {m['load_average']}")
    print(
        f"preset {result['preset']}: {result['parameters'] / 1e6:.1f}M parameters in "
        f"{result['tensors']} tensors ({result['small_tensors']} of <= 4096 elements)"
    )
    for name, b in result["baselines"].items():
        impl = f" [{b['impl']}]" if "impl" in b else ""
        print(
            f"torch {name}{impl}: {b['median_s'] * 1e3:.1f} ms, {b['gbps']:.1f} GB/s, "
            f"peak extra {b['peak_extra_mib']:.0f} MiB"
        )
    if result.get("inductor_startup_s") is not None:
        print(
            f"one-time inductor start-up (first fused compile in a process, fresh cache): "
            f"{result['inductor_startup_s']:.1f} s"
        )
    if result.get("inductor_counters"):
        print(f"inductor FX graph cache: {result['inductor_counters']}")
    for name, c in result.get("ceilings", {}).items():
        print(
            f"ceiling, {name}: {c['median_s'] * 1e3:.1f} ms, {c['gbps']:.1f} GB/s, "
            f"{c['vs_torch_fused_adam']:.2f} x torch fused Adam's bandwidth"
        )
    print(HEADER)
    for row in result["rows"]:
        print(format_row(row))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = sorted({r["optimizer"] for r in rows}, key=[r["optimizer"] for r in rows].index)
    every = ("loop", "foreach", "fused", "default")
    paths = [p for p in every if any(r["path"] == p for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.8), 5))
    width = 0.8 / max(len(paths), 1)
    for k, p in enumerate(paths):
        xs, ys = [], []
        for i, name in enumerate(names):
            hit = [r for r in rows if r["optimizer"] == name and r["path"] == p]
            if hit:
                xs.append(i + k * width)
                ys.append(hit[0]["bw_vs_torch_fused_adam"])
        ax.bar(xs, ys, width, label=p)
    ax.axhline(1.0, color="k", ls="--", label="torch Adam(fused=True)")
    ax.axhline(0.8, color="gray", ls=":", label="0.8 x torch fused Adam (target)")
    ceiling = result.get("ceilings", {}).get("norm then update (NormalizedSGD's work)")
    if ceiling is not None and "NormalizedSGD" in names:
        i = names.index("NormalizedSGD")
        ax.hlines(
            ceiling["vs_torch_fused_adam"],
            i - 0.1,
            i + 0.9,
            color="r",
            label="ATen eager ceiling for NormalizedSGD's work",
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels([n.replace("Optimizer", "") for n in names], rotation=45, ha="right")
    ax.set_ylabel("effective bandwidth / torch fused Adam's\n(paired steps, same tensors)")
    m = result["machine"]
    size = result["parameters"] / 1e6
    where = m["gpu"] or f"{m['cores']} CPU cores"
    ax.set_title(f"{size:.1f}M params in {result['tensors']} tensors, {where}, torch {m['torch']}")
    ax.set_ylim(0, 1.5)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", type=Path)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--paths", nargs="+", default=["loop", "foreach", "fused"])
    parser.add_argument("--only", nargs="*", help="optimizer class names to run")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--preset", default="default", choices=sorted(speed_setup.PRESETS))
    parser.add_argument("--params", type=int, help="rescale the preset's width to ~N params")
    parser.add_argument("--width", type=int, help="model width d (overrides the preset)")
    parser.add_argument("--layers", type=int, help="blocks (overrides the preset)")
    parser.add_argument("--vocab", type=int, help="embedding rows (overrides the preset)")
    parser.add_argument(
        "--overhead",
        type=int,
        metavar="N",
        help="instead: per-parameter step() cost on N tiny parameters (step_overhead.py)",
    )
    parser.add_argument("--overhead-numel", type=int, default=16, metavar="ELEMENTS")
    parser.add_argument(
        "--full-steps",
        action="store_true",
        help="fused path without replayed steps (gradfleet.kernels.plan), for comparison",
    )
    parser.add_argument(
        "--fused-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="inductor option for the fused path's CUDA kernels, e.g. combo_kernels=0",
    )
    args = parser.parse_args(argv)
    try:
        args.device = speed_setup.parse_device(args.device)
        args.fused_options = speed_setup.parse_options(args.fused_option)
    except ValueError as exc:
        parser.error(str(exc))
    if args.overhead is not None and (args.overhead <= 0 or args.overhead_numel <= 0):
        parser.error("--overhead N / --overhead-numel: expected positive counts")
    if args.params is not None and args.params <= 0:
        parser.error(f"--params {args.params}: expected a positive parameter count")
    if args.fused_options:
        if args.device.type != "cuda":
            parser.error("--fused-option: the options apply to CUDA kernels only (--device cuda)")
        from gradfleet.kernels import _torch_private, fused

        config = _torch_private.inductor_config()
        unknown = [name for name in args.fused_options if not hasattr(config, name)]
        if unknown:
            parser.error(f"--fused-option: no inductor option {', '.join(unknown)} in this torch")
        fused.CUDA_OPTIONS.update(args.fused_options)
    # A fresh inductor cache: the reported compile time is a cold compile.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gradfleet-bench-"))
    if args.full_steps:
        from gradfleet.kernels import plan

        plan.build = lambda opt, record: None  # every step takes the full bookkeeping
    if args.overhead is not None:
        if args.device.type != "cpu":
            parser.error("--overhead: measured on --device cpu")
        result = step_overhead.run(args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_overhead.json").write_text(json.dumps(result, indent=1, default=str))
        step_overhead.print_table(result)
        print(f"\nwrote {args.out / 'step_overhead.json'}")
        return
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer_speed.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    plot(result, args.out / "optimizer_speed.png")
    print(f"\nwrote {args.out / 'optimizer_speed.json'} and {args.out / 'optimizer_speed.png'}")


if __name__ == "__main__":
    main()
