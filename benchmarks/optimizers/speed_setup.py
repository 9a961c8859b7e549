"""What the optimizer speed benchmarks (``optimizer_speed``, ``step_overhead``) measure and how:
the parameter sets, the optimizers and their paths, device clocks, the machine.

Presets (``--preset``), all float32 and shaped like transformer parameters:

* ``default``: 16.8M parameters in 41 tensors (d=512, 4 layers, 8192 rows of embedding;
  per layer the q/k/v/o and MLP matrices, the MLP biases and two norm scales).
* ``transformer-134m``: the same shape at d=1024, 8 layers, 32768 rows: 134M parameters in
  81 tensors, the set the GPU figures (docs/speed.md) were measured on.
* ``small-tensors``: a complete pre-norm transformer block stack at d=256 (6 layers, 8192
  rows): every projection has its bias and every norm its scale and shift, so 62 of the
  99 tensors hold 256 or 1024 elements (6.8M parameters): the regime where per-tensor costs
  (kernel launches, parallel regions, Python per parameter) show.

``--params N`` rescales the width ``d`` of the chosen preset (layers and embedding rows
kept) to the multiple of 8 whose parameter count is nearest to ``N``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

# name -> (width, layers, vocab, full): ``full`` adds every bias and norm shift
PRESETS = {
    "default": (512, 4, 8192, False),
    "transformer-134m": (1024, 8, 32768, False),
    "small-tensors": (256, 6, 8192, True),
}


def parameter_shapes(d: int, layers: int, vocab: int, full: bool = False) -> list[tuple]:
    """Shapes of an embedding plus ``layers`` attention/MLP blocks of width ``d``."""
    shapes: list[tuple] = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]  # q, k, v, o; MLP in/out
        shapes += [(4 * d,), (d,)]  # MLP in/out biases
        if full:
            shapes += [(d,)] * 4  # q, k, v, o biases
            shapes += [(d,)] * 4  # two norms: scale and shift each
        else:
            shapes += [(d,)] * 2  # two norm scales
    if full:
        shapes += [(d,), (d,)]  # final norm
    return shapes


def preset_shapes(preset: str, params: int | None = None, **override: int) -> list[tuple]:
    """The shapes of ``preset``; ``override`` replaces width/layers/vocab, ``params``
    picks the width giving the nearest parameter count."""
    d, layers, vocab, full = PRESETS[preset]
    d = override.get("width") or d
    layers = override.get("layers") or layers
    vocab = override.get("vocab") or vocab
    if params is not None:

        def count(width: int) -> int:
            return sum(_numel(s) for s in parameter_shapes(width, layers, vocab, full))

        d = min(range(8, 16385, 8), key=lambda w: abs(count(w) - params))
    return parameter_shapes(d, layers, vocab, full)


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def parse_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; a clear error naming ``--device`` otherwise."""
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise ValueError(f"--device {text!r}: expected cpu, cuda or cuda:N ({exc})") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {text!r}: CUDA is not available to this torch "
                f"({torch.__version__}); use --device cpu or a CUDA build on a GPU machine"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {text!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    return device


def parse_options(items: list[str]) -> dict[str, bool | int | float | str]:
    """``["combo_kernels=1", ...]`` -> ``{"combo_kernels": True, ...}`` (true/false/1/0 are
    booleans, other numbers numbers, the rest strings)."""
    out: dict[str, bool | int | float | str] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--fused-option {item!r}: expected NAME=VALUE")
        words = {"true": True, "1": True, "false": False, "0": False}
        value: bool | int | float | str = words.get(text.lower(), text)
        if isinstance(value, str):
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        out[name] = value
    return out


def step_clock(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """``timed(fn)``: seconds one call of ``fn`` takes on ``device``.

    CPU: wall clock around the call (the kernels run inside it).  CUDA: the queue is drained
    first, then CUDA events on the current stream around the call, so the figure is the GPU
    time from the step's first launch to its last kernel's end, including any gap where the
    GPU waited for the host to launch the next kernel.
    """
    if device.type != "cuda":

        def timed_cpu(fn: Callable[[], object]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return timed_cpu

    def timed_cuda(fn: Callable[[], object]) -> float:
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # ms -> s

    return timed_cuda


def wall_clock(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds from calling ``fn`` until its work on ``device`` is done (first steps: the
    compile happens on the host, before any kernel is queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def peak_extra_cuda_mib(step: Callable[[], object], device: torch.device) -> float:
    """Peak of the caching allocator's live bytes during one step above those before (MiB)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def device_name(device: torch.device) -> str | None:
    """The GPU's name for CUDA devices, else None."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


# ------------------------------------------------------------------ the optimizers
def gradfleet_configs() -> dict[type, tuple[dict, Any]]:
    """(config, make) per optimizer: the conformance suite's first config where known."""
    import gradfleet as gf

    specs: dict[type, Any] = {}
    try:
        from tests.conformance.specs import SPECS
        from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS

        specs = {s.cls: s for s in SPECS + RETURNN_SPECS}
    except ImportError:
        pass
    out = {}
    for cls in gf.optimizers.ALL:
        spec = specs.get(cls)
        config = dict(spec.configs[0]) if spec else {"learning_rate": 1e-3}
        out[cls] = (config, spec.make if spec else None)
    return out


def build(cls, config, make, params, path: str):
    """Optimizer ``cls`` with ``config`` on ``params``, on ``path`` (loop, foreach, fused, or
    default: no flag), built by the conformance spec's ``make`` where it has one."""
    options = {
        "loop": {"foreach": False},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "default": {},  # what a user gets without flags (gradfleet.kernels.resolve_path)
    }
    if make is None:
        return cls(params, **config, **options[path])
    opt = make(params, dict(config))
    for group in opt.param_groups:
        group.update(options[path])
    return opt


def fresh_parameters(params, grads):
    """Copies of ``params`` as new Parameters, each holding its gradient of ``grads``."""
    out = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(out, grads):
        p.grad = g  # shared, read-only for every optimizer
    return out


# ------------------------------------------------------------------ the machine
def machine(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on: CPU model and cores, torch, the GPU, the load."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": device_name(device),
        "load_average": os.getloadavg(),
    }
