"""Every optimizer x config x dtype x gradient mode, 10 steps, parameters and slots compared
after every step against an independent reference (TensorFlow itself, or a float64 numpy
rule written from the spec)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import gradfleet as gf
from tests.conformance.specs import SPECS, Spec
from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS

STEPS = 10
SHAPES = [(6, 3), (5,), (4, 2, 3)]
N_RANDOM_CONFIGS = 2

# float32: both sides run the same float32 kernel maths, so they agree to a few ulps; the
# residue comes from operation order (Eigen vs ATen vectorisation, summation order of
# duplicate rows) accumulated over 10 steps.  float64: hyperparameters are float32-rounded
# identically on both sides, so only last-bit differences of sqrt/rsqrt/division remain.
TOLERANCE = {"float32": (2e-6, 2e-7), "float64": (1e-12, 1e-14)}

ALL_SPECS = SPECS + RETURNN_SPECS


def _cases():
    for spec in ALL_SPECS:
        rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
        configs = list(spec.configs)
        if spec.random_config:
            configs += [spec.random_config(rng) for _ in range(N_RANDOM_CONFIGS)]
        for ci, config in enumerate(configs):
            # The randomised configs widen the coverage of the fixed ones; the fast subset
            # (-m "not slow") keeps every optimizer x fixed config x dtype x gradient mode.
            marks = [pytest.mark.slow] if ci >= len(spec.configs) else []
            for dtype in spec.dtypes:
                for mode in spec.modes:
                    yield pytest.param(
                        spec,
                        config,
                        dtype,
                        mode,
                        id=f"{spec.name}-c{ci}-{dtype}-{mode}",
                        marks=marks,
                    )


def _gradients(rng, shapes, mode, step, dtype):
    """One step's gradients, as (torch gradient, reference gradient) pairs per parameter."""
    out = []
    for shape in shapes:
        if mode == "dense":
            g = rng.standard_normal(shape).astype(dtype)
            out.append((torch.from_numpy(g.copy()), ("dense", g)))
            continue
        rows = shape[0]
        if mode == "sparse_empty" and step % 2 == 0:
            idx = np.zeros(0, dtype=np.int64)
        elif mode == "sparse_duplicates":
            idx = rng.integers(0, rows, size=rows + 2)
            idx[-1] = idx[0]  # at least one duplicate
        else:
            idx = rng.choice(rows, size=int(rng.integers(1, rows)), replace=False)
        vals = rng.standard_normal((len(idx), *shape[1:])).astype(dtype)
        g = torch.sparse_coo_tensor(
            torch.from_numpy(idx).reshape(1, -1), torch.from_numpy(vals.copy()), shape
        )
        out.append((g, ("sparse", idx, vals)))
    return out


@pytest.mark.parametrize("spec,config,dtype,mode", list(_cases()))
def test_matches_reference(spec: Spec, config: dict, dtype: str, mode: str):
    seed = zlib.crc32(f"{spec.name}{sorted(config.items())}{dtype}{mode}".encode())
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    params = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in init]
    opt = spec.build(params, dict(config))
    ref = spec.reference(
        dict(config),
        [x.copy() for x in init],
        ["dense" if mode == "dense" else "sparse"] * len(SHAPES),
    )
    rtol, atol = spec.tolerance.get(dtype, TOLERANCE[dtype])
    try:
        for step in range(STEPS):
            grads = _gradients(rng, SHAPES, mode, step, dtype)
            for p, (g, _) in zip(params, grads):
                p.grad = g
            opt.step()
            ref.step([r for _, r in grads])
            expected = ref.params()
            for i, p in enumerate(params):
                where = f"step {step + 1}, param {i}"
                np.testing.assert_allclose(
                    p.detach().numpy(), expected[i], rtol=rtol, atol=atol, err_msg=where
                )
                for ours, theirs in spec.slots.items():
                    np.testing.assert_allclose(
                        opt.get_slot(p, ours).numpy(),
                        ref.slot(i, theirs),
                        rtol=rtol,
                        atol=atol,
                        err_msg=f"{where}, slot {ours}",
                    )
    finally:
        ref.close()


def test_returnn_resource_variables_drop_sparse_updates():
    """Why the RETURNN rows run on reference variables (docs/optimizers.md, catalog): on resource
    variables RETURNN's sparse GradVarianceScaled never updates ``v`` nor the parameter (the
    gather after its ``scatter_*`` does not depend on it), where reference variables, the
    numpy rule and gradfleet all do."""
    pytest.importorskip("returnn.tf.updater")
    from tests.conformance.references import ReturnnTFReference

    class OnResourceVariables(ReturnnTFReference):
        use_resource = True

    def make(config, variables):
        import returnn.tf.updater as updater

        return updater.GradVarianceScaledOptimizer(**config)

    init = np.ones((4, 2), np.float32)
    grad = ("sparse", np.array([1, 3]), np.full((2, 2), 0.5, np.float32))
    w = torch.nn.Parameter(torch.from_numpy(init.copy()))
    ours = gf.GradVarianceScaledOptimizer([w], learning_rate=0.1)
    w.grad = torch.sparse_coo_tensor([[1, 3]], torch.from_numpy(grad[2].copy()), (4, 2))
    ours.step()
    results = {}
    for cls in (OnResourceVariables, ReturnnTFReference):
        ref = cls(make, {"learning_rate": 0.1}, [init.copy()], ["sparse"], ["m", "v"])
        try:
            ref.step([grad])
            results[cls] = ref.params()[0], ref.slot(0, "v")
        finally:
            ref.close()
    stale_w, stale_v = results[OnResourceVariables]
    np.testing.assert_array_equal(stale_w, init)
    np.testing.assert_array_equal(stale_v, np.zeros_like(init))
    ref_w, ref_v = results[ReturnnTFReference]
    assert (ref_w[[1, 3]] < 1).all() and (ref_v[[1, 3]] > 0).all()
    np.testing.assert_allclose(w.detach().numpy(), ref_w, rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(ours.get_slot(w, "v").numpy(), ref_v, rtol=2e-6, atol=2e-7)
