import os
import sys

# Make `tests.*` importable (the conformance table is shared by several test modules).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import inspect  # noqa: E402

import pytest  # noqa: E402

# `slow` (docs/testing.md: the fast subset is `-m "not slow"`), found from the test's own source
# (and the same module's helpers it calls) so that new tests are classified too:
# * a test that starts processes (ranks through run_ranks, a subprocess) pays seconds of
#   interpreter start and torch import per process (tests/cli marks its launches explicitly);
# * a test that compiles fused kernels pays seconds of inductor compile per kernel.
_SLOW_SOURCE = ("run_ranks(", "subprocess.", "fused=True", "torch.compile(")
# Slow for another reason, marked in their modules: the benchmarks end to end (the speed
# benchmark is about 50 s on 2 cores), RETURNN's engine (about 1 s of set-up per training run).
# The markers of CI's second stage (docs/testing.md; README.md's command leaves them out) are
# given in the test modules, but for one rule: a case of a test parametrized over the step paths
# (`path`, gradfleet.kernels.PATHS) on the fused path compiles its kernels. A test carrying one
# is slow too, so that `-m "not slow"` stays the fast subset.
SECOND_STAGE = ("multihost", "compile", "faults")


def _source(fn, depth: int = 2) -> str:
    """``fn``'s source and that of the same module's functions it calls (``depth`` levels)."""
    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
    if depth:
        for name in fn.__code__.co_names:
            helper = fn.__globals__.get(name)
            if inspect.isfunction(helper) and helper.__module__ == fn.__module__:
                text += _source(helper, depth - 1)
    return text


def pytest_collection_modifyitems(config, items):
    sources: dict = {}
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        if fn not in sources:
            sources[fn] = _source(fn)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("path") == "fused":
            item.add_marker(pytest.mark.compile)
        starts = any(s in sources[fn] for s in _SLOW_SOURCE)
        if starts or any(item.get_closest_marker(m) for m in SECOND_STAGE):
            item.add_marker(pytest.mark.slow)
