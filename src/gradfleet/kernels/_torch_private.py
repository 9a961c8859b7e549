"""Every private PyTorch entry point gradfleet uses, behind one small adapter.

PyTorch gives no stability promise for these, so each is looked up here, on first use (they
pull in inductor, dynamo and sympy: seconds of import that ``import gradfleet`` must not
pay), and a release that lacks one gets a ``TorchPrivateAPIError`` naming it, the installed
release and the releases it was checked on, instead of a wrong number from a changed
behaviour.

Entry points (all used by the fused path, ``kernels/fused.py``):

* ``torch.fx.experimental.proxy_tensor.make_fx``: traces the step into an FX graph.
* ``torch._inductor.decomposition.select_decomp_table``: inductor's decompositions,
  applied while tracing as AOTAutograd would.
* ``torch._inductor.compile_fx.compile_fx_inner``: inductor's graph compiler.
* ``torch.utils._triton.has_triton``: whether Triton can compile for this machine's GPU
  (``fused_by_default_on_cuda``).
* ``torch._inductor.config`` options ``INDUCTOR_OPTIONS``; ``emulate_precision_casts``
  decides the half-precision bits (float16/bfloat16 intermediates rounded like eager).
  ``fused.CUDA_OPTIONS`` (``combo_kernels`` from torch 2.11 on, plus what the benchmark's
  ``--fused-option`` sets) and ``exact_division_option()`` are checked the same way when a
  CUDA kernel compiles.

Checked on: torch 2.8.0, 2.11.0, 2.12.1, 2.13.0 and 2.14.1 (Linux x86-64, CPU wheels and CUDA wheels
run on the CPU; CI runs the oldest supported release, 2.8.0, and 2.13.0, see docs/testing.md).
The options exist from 2.8 on (``alignment_asserts`` is the newest of them).

``torch._foreach_*`` (the foreach path, ``kernels/tensorlist.py``) are ATen operators that
``torch.optim`` itself is built on; the same fast-path tests exercise them on both CI releases,
and they are not wrapped here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

#: Releases these entry points were checked on (the fast-path tests passed there).
CHECKED_RELEASES = ("2.8.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1")
#: Inductor config options the fused path sets; every one must exist on the running torch.
INDUCTOR_OPTIONS = (
    "size_asserts",
    "alignment_asserts",
    "score_fusion_memory_threshold",
    "emulate_precision_casts",
    "cpp.threads",  # 1 for the CPU kernel of small parameters (``fused.SMALL_NUMEL``)
)


#: Whether CUDA buckets compile with ``combo_kernels`` (fused.CUDA_OPTIONS): measured faster
#: and checked against the reference loop on torch 2.11 on an H200; older releases keep one
#: launch per parameter, as they were before.
COMBO_KERNELS = torch.__version__ >= "2.11"
#: Inductor's switch for correctly rounded float32 division in Triton kernels, by release (the
#: first the running torch has is used).  Triton's own ``/`` is ``div.full.f32``, up to 2 ulp
#: off, where eager CUDA and TF's kernels divide exactly; FTRL's linear slot accumulates
#: quotients with cancellation, so the approximate one put it past the fused tolerance on an
#: H200 (tests/kernels/test_cuda.py).  Torch 2.8 has neither (2.9 not checked): there the CUDA
#: kernels divide approximately.
_DIVISION_ROUNDING = ("eager_numerics.division_rounding", "emulate_divison_rounding")


def exact_division_option() -> dict[str, bool]:
    """The inductor option that makes Triton kernels divide with IEEE rounding, as a one-entry
    dict, or an empty one where the running torch has no such option."""
    config = inductor_config()
    for name in _DIVISION_ROUNDING:
        if hasattr(config, name):
            return {name: True}
    return {}


#: Whether inductor's CPU code generator keeps the float16/bfloat16 round trips that
#: ``emulate_precision_casts`` puts after each operation, making fused half-precision results
#: the loop's bits.  In torch 2.11 and 2.12.1 the C++ backend converts to half precision and
#: then goes on computing with the float32 value (seen in its generated code; 2.13.0 uses the
#: rounded value), so fused float16/bfloat16 results differ from the loop there, within the
#: bound docs/releases.md states (tests/kernels/test_fast_paths.py checks both).
HALF_PRECISION_EXACT = torch.__version__ >= "2.13"
#: Up to torch 2.10 the vectorised C++ backend names the keyword the precision-cast round trip
#: passes ``use_compute_dtypes`` (a TypeError on the first float16/bfloat16 kernel; fixed in
#: 2.11), so there the option is left off: half precision is then computed in float32 and
#: rounded when stored, within the same bound as on 2.11 and 2.12.
_PRECISION_CASTS_COMPILE = torch.__version__ >= "2.11"


@functools.cache
def fused_by_default_on_cuda() -> bool:
    """Whether a CUDA group without ``fused=``/``foreach=`` takes the fused path
    (``dispatch.resolve_path``): Triton compiles for this machine's GPU, and inductor can be
    asked for correctly rounded division, so the kernel keeps eager CUDA's numbers (torch 2.8
    cannot: there the default stays foreach).  Asked once per process, on the first CUDA step,
    when the compile it leads to loads inductor anyway."""
    try:
        from torch.utils._triton import has_triton

        return bool(has_triton() and exact_division_option())
    except (ImportError, TorchPrivateAPIError):
        return False


class TorchPrivateAPIError(RuntimeError):
    """The running torch lacks a private entry point (or option) gradfleet relies on."""


def _missing(what: str, cause: BaseException | None = None) -> TorchPrivateAPIError:
    return TorchPrivateAPIError(
        f"gradfleet's fused path needs {what}, which torch {torch.__version__} does not have "
        f"(checked on torch {', '.join(CHECKED_RELEASES)}). Use foreach=True or the loop "
        f"(fused=False), or a torch release gradfleet supports (see docs/releases.md)."
        + (f" Cause: {type(cause).__name__}: {cause}" if cause is not None else "")
    )


def make_fx(fn, decomposition_table: dict[Any, Any], tracing_mode: str = "fake"):
    """``make_fx(fn, decomposition_table, tracing_mode=...)``: a function returning the
    traced ``torch.fx.GraphModule`` for its inputs."""
    try:
        from torch.fx.experimental.proxy_tensor import make_fx as _make_fx
    except ImportError as exc:
        raise _missing("torch.fx.experimental.proxy_tensor.make_fx", exc) from exc
    return _make_fx(fn, decomposition_table, tracing_mode=tracing_mode)


def decomposition_table() -> dict[Any, Any]:
    """Inductor's decomposition table (what AOTAutograd applies before inductor)."""
    try:
        from torch._inductor.decomposition import select_decomp_table
    except ImportError as exc:
        raise _missing("torch._inductor.decomposition.select_decomp_table", exc) from exc
    return select_decomp_table()


def compile_fx_inner(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]):
    """Inductor's compiler for an inference graph; returns ``f(list_of_inputs)``."""
    try:
        from torch._inductor.compile_fx import compile_fx_inner as _compile
    except ImportError as exc:
        raise _missing("torch._inductor.compile_fx.compile_fx_inner", exc) from exc
    fake_mode, fakes = _traced_inputs(graph)
    if fake_mode is None or fake_mode.shape_env is None:
        return _compile(graph, inputs)
    # As AOTAutograd hands graphs to inductor: inside a tracing context holding the fake mode
    # ``make_fx`` traced in, with that mode's fake inputs.  Without the context's shape
    # environment inductor's on-disk FX graph cache bypasses the graph ("No shape env"), and
    # every process compiles it from scratch.
    try:
        from torch._guards import TracingContext, tracing
    except ImportError as exc:
        raise _missing("torch._guards.tracing and TracingContext", exc) from exc
    with tracing(TracingContext(fake_mode)):
        return _compile(graph, fakes)


def _traced_inputs(graph: torch.fx.GraphModule) -> tuple[Any, list[Any]]:
    """The fake mode ``make_fx`` traced ``graph`` in, and its placeholders' fake values."""
    try:
        from torch._guards import detect_fake_mode
    except ImportError as exc:
        raise _missing("torch._guards.detect_fake_mode", exc) from exc
    fakes = [n.meta.get("val") for n in graph.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode(fakes), fakes


def inductor_config() -> Any:
    """``torch._inductor.config`` (imported on first call)."""
    try:
        from torch._inductor import config
    except ImportError as exc:
        raise _missing("torch._inductor.config", exc) from exc
    return config


@contextlib.contextmanager
def inductor_options(options: dict[str, Any]) -> Iterator[None]:
    """Set inductor config ``options`` for the block; an unknown option name is an error
    (a silently ignored option would change the kernel's numbers)."""
    config = inductor_config()
    unknown = [name for name in options if not hasattr(config, name)]
    if unknown:
        raise _missing(f"the inductor config option(s) {', '.join(unknown)}")
    if not _PRECISION_CASTS_COMPILE:
        options = {k: v for k, v in options.items() if k != "emulate_precision_casts"}
    with config.patch(options):
        yield
