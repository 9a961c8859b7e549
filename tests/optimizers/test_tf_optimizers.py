"""TF-verified numbers, validation and step counting for the TF1 optimizers beyond Adam,
Momentum and GradientDescent (numbers from ../shared/reference/optimizer-semantics.md,
sections 5-7 and 9-12; float64 numpy rules written from the same spec)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradfleet as gf
from tests.conformance.references import f32


def _param(values, dtype=torch.float64):
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype))


def _steps(opt, w, grads):
    for g in grads:
        w.grad = torch.tensor(g, dtype=w.dtype)
        opt.step()


def _close(actual, expected, rtol):
    np.testing.assert_allclose(actual.detach().numpy(), expected, rtol=rtol, atol=0)


# ----------------------------------------------------------------------------- Adadelta
def test_adadelta_tf_numbers():
    w = _param([1.0, 2.0], torch.float32)
    opt = gf.AdadeltaOptimizer([w], learning_rate=0.1)
    _steps(opt, w, [[0.1, 0.2]])
    _close(w, [0.9999553, 1.9999553], 1e-7)
    _close(opt.get_slot(w, "accum"), [0.0005, 0.002], 1e-6)
    _close(opt.get_slot(w, "accum_update"), [9.999799e-09, 9.999948e-09], 1e-6)


# ----------------------------------------------------------------------------- Adagrad
def test_adagrad_sums_duplicate_rows_before_squaring():
    w = _param([1.0, 2.0])
    opt = gf.AdagradOptimizer([w], learning_rate=0.1)
    w.grad = torch.sparse_coo_tensor([[0, 0]], torch.tensor([0.1, 0.3], dtype=torch.float64), (2,))
    opt.step()
    acc = opt.get_slot(w, "accumulator")
    # 0.1 + (0.1 + 0.3)^2 = 0.26, not 0.1 + 0.01 + 0.09 (section 5)
    assert acc[0].item() == pytest.approx(0.1 + 0.4**2, rel=1e-15)
    assert acc[1].item() == 0.1  # untouched row, filled in float64 without a float32 detour
    expected_w0 = 1.0 - f32(0.1) * 0.4 / np.sqrt(0.1 + 0.4**2)
    assert w[0].item() == pytest.approx(expected_w0, rel=1e-14)
    assert w[1].item() == 2.0


@pytest.mark.parametrize("cls", [gf.AdagradOptimizer, gf.ProximalAdagradOptimizer])
def test_adagrad_family_rejects_non_positive_initial_accumulator(cls):
    with pytest.raises(ValueError, match=r"^initial_accumulator_value must be positive: 0.0$"):
        cls([_param([1.0])], 0.1, initial_accumulator_value=0.0)


# ----------------------------------------------------------------------------- AdagradDA
_DA = dict(learning_rate=0.1, l2_regularization_strength=0.02)
_DA_GRADS = [[0.1, 0.2], [0.3, -0.4]]
_DA_TF = {0.0: [-0.0886498124, 0.0362501044], 0.01: [-0.0842173219, 0.032625094]}


def _adagrad_da_numpy(grads, t_values, l1):
    """Section 6's dense closed form in float64 for ``_DA``, with each step's T given."""
    lr, l2 = f32(0.1), f32(0.02)
    ga, gg = np.zeros(2), np.full(2, 0.1)
    for g, t in zip(grads, t_values):
        ga, gg = ga + np.array(g), gg + np.square(g)
        shrunk = np.sign(ga) * np.maximum(np.abs(ga) - t * l1, 0) if l1 > 0 else ga
        w = -lr * shrunk / (l2 * t * lr + np.sqrt(gg))
    return w


@pytest.mark.parametrize("l1", [0.0, 0.01])
def test_adagrad_da_counts_its_own_steps_like_tf_with_global_step(l1):
    w = _param([1.0, -2.0])
    opt = gf.AdagradDAOptimizer([w], l1_regularization_strength=l1, **_DA)
    _steps(opt, w, _DA_GRADS)
    _close(w, _DA_TF[l1], 1e-8)
    assert opt.param_groups[0]["non_slot"]["step"].item() == 2


@pytest.mark.parametrize("l1", [0.0, 0.01])
def test_adagrad_da_explicit_global_step_advanced_by_apply_gradients(l1):
    w = _param([1.0, -2.0])
    gs = torch.zeros((), dtype=torch.int64)
    opt = gf.AdagradDAOptimizer([w], global_step=gs, l1_regularization_strength=l1, **_DA)
    for g in _DA_GRADS:
        opt.apply_gradients([(torch.tensor(g, dtype=torch.float64), w)], global_step=gs)
    _close(w, _DA_TF[l1], 1e-8)
    assert gs.item() == 2
    assert opt.param_groups[0]["non_slot"] == {}


def test_adagrad_da_explicit_global_step_is_read_not_advanced_by_step():
    w = _param([1.0, -2.0])
    gs = torch.tensor(4, dtype=torch.int64)
    opt = gf.AdagradDAOptimizer([w], global_step=gs, l1_regularization_strength=0.01, **_DA)
    _steps(opt, w, _DA_GRADS)  # nobody advances gs: T = 5 at both steps, as in TF
    assert gs.item() == 4
    _close(w, _adagrad_da_numpy(_DA_GRADS, [5, 5], f32(0.01)), 1e-13)
    gs.fill_(9)  # T is read at apply time
    _steps(opt, w, [[0.5, 0.5]])
    _close(w, _adagrad_da_numpy(_DA_GRADS + [[0.5, 0.5]], [5, 5, 10], f32(0.01)), 1e-13)


def test_adagrad_da_validation():
    with pytest.raises(
        ValueError, match=r"^initial_gradient_squared_accumulator_value must be positive: 0.0$"
    ):
        gf.AdagradDAOptimizer([_param([1.0])], 0.1, initial_gradient_squared_accumulator_value=0.0)
    with pytest.raises(TypeError, match="int64"):
        gf.AdagradDAOptimizer([_param([1.0])], 0.1, global_step=torch.tensor(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="l1_regularization_strength"):
        gf.AdagradDAOptimizer([_param([1.0])], 0.1, l1_regularization_strength=-0.1)


# ----------------------------------------------------------------------------- FTRL
_FTRL_V2 = dict(
    learning_rate=3.0,
    l1_regularization_strength=0.001,
    l2_shrinkage_regularization_strength=0.5,
)


@pytest.mark.parametrize("sparse", [False, True])
def test_ftrl_v2_shrinkage_tf_numbers(sparse):
    w = _param([1.0, 2.0])
    opt = gf.FtrlOptimizer([w], **_FTRL_V2)
    g = torch.tensor([0.1, 0.2], dtype=torch.float64)
    w.grad = g.to_sparse() if sparse else g
    opt.step()
    _close(opt.get_slot(w, "accum"), [0.11, 0.14], 1e-14)
    _close(opt.get_slot(w, "linear"), [1.0948551, 2.16137468], 1e-7)
    _close(w, [-9.89429162, -17.32153264], 1e-9)


def test_ftrl_general_path_with_beta_tf_numbers():
    w = _param([1.0, -2.0])
    opt = gf.FtrlOptimizer(
        [w],
        learning_rate=0.5,
        learning_rate_power=-0.3,
        initial_accumulator_value=0.2,
        l1_regularization_strength=0.01,
        l2_regularization_strength=0.05,
        beta=0.7,
    )
    _steps(opt, w, [[0.3, -0.1], [0.2, 0.4]])
    _close(w, [-0.1183374027, -0.1078597707], 1e-9)
    _close(opt.get_slot(w, "linear"), [0.3572156236, 0.3318744198], 1e-9)


def test_ftrl_zero_gradient_at_step_one_sets_w_to_zero():
    w = _param([1.0, 2.0])
    opt = gf.FtrlOptimizer([w], learning_rate=0.1)
    _steps(opt, w, [[0.0, 0.0]])
    assert w.tolist() == [0.0, 0.0]


def test_ftrl_rounds_its_power_to_float32_on_the_host_as_torch_does():
    """FTRL's choice of the sqrt path tests ``learning_rate_power`` in float32.  Where the
    float32 copy lives on an accelerator (``meta`` stands in: not on the CPU), it rounds the
    Python number on the host instead of reading the copy back; torch's float32 conversion
    is the reference, ties, subnormals and overflow included."""
    from gradfleet.optimizers.ftrl import _float32_test, _round_to_float32

    rng = np.random.default_rng(3)
    near = -0.5 + rng.uniform(-1e-7, 1e-7, 200)  # within a few float32 ulps of -0.5
    special = [0.0, -0.0, 1e-45, -3e-39, 3.4028235e38, 3.5e38, -1e39, 1.0 + 2**-24]
    for x in [*near.tolist(), *rng.standard_normal(200).tolist(), *special]:
        want = float(torch.tensor(x, dtype=torch.float32))
        assert _round_to_float32(x) == want, x
    away = torch.empty((), device="meta")
    for x in near.tolist():
        want = float(torch.tensor(x, dtype=torch.float32)) == -0.5
        assert _float32_test(x, away, lambda v: v == -0.5) is want, x


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_ftrl_sqrt_path_is_bit_exact_with_tensorflow_in_float32(mode):
    # The conformance row's float32 tolerance is loosened for the pow path only; the
    # sqrt path must agree to the bit (it relies on a correctly rounded sqrt).
    from tests.conformance.references import TFReference

    tf = pytest.importorskip("tensorflow")
    config = dict(learning_rate=0.1, l1_regularization_strength=0.05, beta=0.3)
    rng = np.random.default_rng(7)
    init = rng.standard_normal((50, 20)).astype(np.float32)
    ref = TFReference(
        lambda c, gs: tf.compat.v1.train.FtrlOptimizer(**c),
        dict(config),
        [init.copy()],
        [mode],
        ["accum", "linear"],
    )
    w = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = gf.FtrlOptimizer([w], **config)
    try:
        for _ in range(5):
            g = rng.standard_normal(init.shape).astype(np.float32)
            idx = np.arange(0, 50, 3)
            if mode == "dense":
                w.grad, fed = torch.from_numpy(g.copy()), ("dense", g)
            else:
                vals = g[idx]
                w.grad = torch.sparse_coo_tensor(
                    torch.from_numpy(idx).reshape(1, -1), torch.from_numpy(vals), init.shape
                )
                fed = ("sparse", idx, vals)
            opt.step()
            ref.step([fed])
            np.testing.assert_array_equal(w.detach().numpy(), ref.params()[0])
            np.testing.assert_array_equal(opt.get_slot(w, "linear").numpy(), ref.slot(0, "linear"))
    finally:
        ref.close()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"initial_accumulator_value": -0.1}, "initial_accumulator_value -0.100000 needs to"),
        ({"learning_rate_power": 0.1}, "learning_rate_power 0.100000 needs to be negative"),
        ({"l1_regularization_strength": -1.0}, "l1_regularization_strength -1.000000 needs"),
        ({"l2_regularization_strength": -1.0}, "l2_regularization_strength -1.000000 needs"),
        (
            {"l2_shrinkage_regularization_strength": -1.0},
            "l2_shrinkage_regularization_strength -1.000000 needs to be positive or zero",
        ),
        ({"learning_rate": 0.0}, "learning_rate must be > 0"),
    ],
)
def test_ftrl_validation_messages(kwargs, message):
    config = dict({"learning_rate": 0.1}, **kwargs)
    with pytest.raises(ValueError, match=message):
        gf.FtrlOptimizer([_param([1.0])], **config)


def test_ftrl_accepts_zero_initial_accumulator_and_keeps_slot_names():
    w = _param([1.0])
    opt = gf.FtrlOptimizer([w], 0.1, initial_accumulator_value=0.0, accum_name="a")
    assert opt.get_slot_names() == ["accum", "linear"]
    _steps(opt, w, [[0.5]])
    assert opt.get_slot(w, "accum").item() == 0.25


# ----------------------------------------------------------------------------- Proximal*
def test_proximal_adagrad_tf_numbers():
    w = _param([1.0, -2.0], torch.float32)
    opt = gf.ProximalAdagradOptimizer(
        [w], 0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.02
    )
    _steps(opt, w, [[0.1, 0.2]])
    _close(w, [0.96103853, -2.039876], 1e-6)


def test_proximal_gradient_descent_tf_numbers():
    w = _param([1.0, -2.0], torch.float32)
    opt = gf.ProximalGradientDescentOptimizer(
        [w], 0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.02
    )
    _steps(opt, w, [[0.1, 0.2]])
    _close(w, [0.987026, -2.01497], 1e-6)


@pytest.mark.parametrize(
    "cls,key,value",
    [
        (gf.ProximalAdagradOptimizer, "learning_rate", -0.1),
        (gf.ProximalAdagradOptimizer, "l1_regularization_strength", -0.1),
        (gf.ProximalAdagradOptimizer, "l2_regularization_strength", -0.1),
        (gf.ProximalGradientDescentOptimizer, "l1_regularization_strength", -0.1),
        (gf.ProximalGradientDescentOptimizer, "l2_regularization_strength", -0.1),
    ],
)
def test_proximal_validation_names_the_argument(cls, key, value):
    config = dict({"learning_rate": 0.1}, **{key: value})
    with pytest.raises(ValueError, match=key):
        cls([_param([1.0])], **config)


def _numpy_proximal(w, g, lr_t, l1, l2):
    prox = w - g * lr_t
    if l1 > 0:
        return np.sign(prox) * np.maximum(np.abs(prox) - lr_t * l1, 0) / (1 + l2 * lr_t)
    return prox / (1 + l2 * lr_t)


def _dense_rows(shape, idx, vals):
    """A sparse gradient as TF sees it after de-duplication: summed rows, listed rows."""
    g = np.zeros(shape)
    np.add.at(g, idx, vals)
    return g, np.unique(idx)


@pytest.mark.parametrize("adagrad", [False, True])
@pytest.mark.parametrize("l1", [0.0, 0.05])
@pytest.mark.parametrize("sparse", [False, True])
def test_proximal_float64_against_numpy(adagrad, l1, sparse):
    """TF refuses float64 here; gradfleet runs the same rule with float32-rounded
    hyperparameters (section 1.4), checked against a float64 numpy rule."""
    rng = np.random.default_rng(3)
    lr, l2, k = 0.3, 0.1, 0.2
    shapes = [(6, 3), (5,)]
    init = [rng.standard_normal(s) for s in shapes]
    params = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in init]
    kw = dict(l1_regularization_strength=l1, l2_regularization_strength=l2)
    if adagrad:
        opt = gf.ProximalAdagradOptimizer(params, lr, initial_accumulator_value=k, **kw)
    else:
        opt = gf.ProximalGradientDescentOptimizer(params, lr, **kw)
    ws = [x.copy() for x in init]
    accs = [np.full(s, k) for s in shapes]
    for _ in range(8):
        for i, (p, shape) in enumerate(zip(params, shapes)):
            if sparse:
                idx = rng.integers(0, shape[0], size=shape[0])
                vals = rng.standard_normal((len(idx), *shape[1:]))
                p.grad = torch.sparse_coo_tensor(
                    torch.from_numpy(idx).reshape(1, -1), torch.from_numpy(vals), shape
                )
                g, rows = _dense_rows(shape, idx, vals)
            else:
                g = rng.standard_normal(shape)
                p.grad, rows = torch.from_numpy(g.copy()), np.arange(shape[0])
            acc = accs[i][rows] + g[rows] ** 2
            lr_t = f32(lr) / np.sqrt(acc) if adagrad else f32(lr)
            ws[i][rows] = _numpy_proximal(ws[i][rows], g[rows], lr_t, f32(l1), f32(l2))
            accs[i][rows] = acc
        opt.step()
        for i, p in enumerate(params):
            np.testing.assert_allclose(p.detach().numpy(), ws[i], rtol=1e-12, atol=1e-14)
            if adagrad:
                np.testing.assert_allclose(opt.get_slot(p, "accumulator").numpy(), accs[i])


# ----------------------------------------------------------------------------- RMSProp
def test_rmsprop_centered_tf_numbers():
    w = _param([1.0, 2.0], torch.float32)
    opt = gf.RMSPropOptimizer([w], 0.1, momentum=0.5, centered=True)
    _steps(opt, w, [[0.1, 0.2]])
    _close(w, [0.98946434, 1.9789602], 1e-7)
    _close(opt.get_slot(w, "rms"), [0.901, 0.904], 1e-6)
    _close(opt.get_slot(w, "mg"), [0.01, 0.02], 1e-6)
    _close(opt.get_slot(w, "momentum"), [0.01053566, 0.02103982], 1e-6)


def test_rmsprop_mg_slot_only_for_centered_groups():
    a, b = _param([1.0, 2.0]), _param([3.0])
    opt = gf.RMSPropOptimizer([{"params": [a]}, {"params": [b], "centered": True}], 0.1)
    _steps(opt, a, [[0.1, 0.2]])
    b.grad = torch.tensor([0.5], dtype=torch.float64)
    opt.step()
    assert opt.get_slot_names() == ["mg", "momentum", "rms"]
    assert opt.get_slot(a, "mg") is None
    assert opt.get_slot(b, "mg") is not None
    assert len(opt.variables()) == 2 + 3
    plain = gf.RMSPropOptimizer([_param([1.0])], 0.1)
    assert plain.get_slot_names() == ["momentum", "rms"]
