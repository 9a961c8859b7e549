"""RETURNN's own optimizers: the spec's TF-verified numbers (optimizer-semantics.md section 13),
the BaseCustomOptimizer extension point, and argument checking."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import gradfleet as gf
from gradfleet import _hyper

F32 = np.float32
GRADS = [[0.4, -0.6], [-0.1, -0.1], [0.2, 0.3]]  # the spec's 3-step dense example


def _dense_run(cls, **kwargs):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = cls([w], learning_rate=0.1, **kwargs)
    for g in GRADS:
        w.grad = torch.tensor(g)
        opt.step()
    return w, opt


def _sparse(idx, values, shape):
    values = torch.as_tensor(values, dtype=torch.float32)
    return torch.sparse_coo_tensor(torch.tensor([idx]), values, shape)


def _close(actual, expected, rtol=1e-6):
    np.testing.assert_allclose(actual.detach().numpy(), np.asarray(expected, F32), rtol=rtol)


# ------------------------------------------------------------------ verified numbers


def test_normalized_sgd_sparse_norm_counts_duplicates_13_3():
    w = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    opt = gf.NormalizedSGD([w], learning_rate=0.1)
    w.grad = _sparse([0, 0], [[0.3, 0.4], [0.3, 0.4]], (2, 2))
    opt.step()
    _close(w[0], [0.9151472, 1.886863])
    _close(w[1], [3.0, 4.0], rtol=0)
    # the dense gradient [0.6, 0.8] of the same rows is normalised as a whole instead
    w = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    opt = gf.NormalizedSGD([w], learning_rate=0.1)
    w.grad = torch.tensor([[0.6, 0.8], [0.0, 0.0]])
    opt.step()
    _close(w[0], [0.94, 1.92])


def test_normalized_sgd_zero_gradient_changes_nothing():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = gf.NormalizedSGD([w], learning_rate=0.1)
    w.grad = torch.zeros(2)
    opt.step()
    _close(w, [1.0, 2.0], rtol=0)


def test_neural_optimizer1_dense_13_4():
    w, opt = _dense_run(gf.NeuralOptimizer1)
    _close(w, [0.941, 2.067])
    _close(opt.get_slot(w, "m"), [0.0434, -0.0276])


def test_neural_optimizer1_sparse_decays_m_everywhere_moves_listed_rows():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    opt = gf.NeuralOptimizer1([w], learning_rate=0.1)
    w.grad = torch.tensor([0.4, -0.6, 0.5])
    opt.step()  # m = [0.04, -0.06, 0.05]
    w.grad = _sparse([1, 1], [0.2, 0.3], (3,))
    opt.step()
    # m decays on all rows, then both occurrences are added: m1 = -0.054 + 0.02 + 0.03
    _close(opt.get_slot(w, "m"), [0.036, -0.004, 0.045])
    # sign(m1) < 0 disagrees with both gradients: each step shrinks by decrease_factor
    _close(w, [0.96, 2.06 - 0.1 * 0.2 * 0.1 - 0.1 * 0.3 * 0.1, 2.95])


def test_grad_variance_scaled_dense_13_5():
    w, opt = _dense_run(gf.GradVarianceScaledOptimizer)
    _close(w, [0.9999131, 2.002206])
    _close(opt.get_slot(w, "m"), [0.0434, -0.0276])
    _close(opt.get_slot(w, "v"), [0.0001697224, 0.0003996284])


def test_custom_adam_dense_equals_tf_adam_13_6():
    w, opt = _dense_run(gf.CustomAdamOptimizer)
    _close(w, [0.7925065, 2.2043486], rtol=2e-7)
    shared = opt.param_groups[0]["non_slot"]
    expected = F32(0.9)
    for _ in range(3):
        expected = F32(expected * F32(0.9))
    assert shared["beta1_power"].dtype == torch.float32
    assert shared["beta1_power"].item() == float(expected)


def test_custom_adam_sparse_is_lazy_and_duplicates_step_per_occurrence_13_6():
    w = torch.nn.Parameter(torch.tensor([[1.0], [2.0], [3.0]]))
    opt = gf.CustomAdamOptimizer([w], learning_rate=0.1)
    w.grad = _sparse([0, 0], [[0.3], [0.5]], (3, 1))
    opt.step()
    # scatter_update keeps the last occurrence: m0 = (1 - 0.9) * 0.5, v0 = (1 - 0.999) * 0.25
    assert opt.get_slot(w, "m")[0, 0].item() == float((F32(1) - F32(0.9)) * F32(0.5))
    assert opt.get_slot(w, "v")[0, 0].item() == float((F32(1) - F32(0.999)) * F32(0.25))
    _close(w[:, 0], [0.8, 2.0, 3.0])  # two steps of ~lr on row 0 (1.0 -> 0.8, not 0.9)
    w.grad = _sparse([1], [[0.2]], (3, 1))
    opt.step()
    # bias correction uses the global step (t = 2) although row 1 is seen for the first time
    step = 0.1 * np.sqrt(1 - 0.999**2) / (1 - 0.9**2) * 0.1 * 0.2 / np.sqrt(0.001 * 0.04)
    _close(w[:, 0], [0.8, 2.0 - step, 3.0])  # row 0 keeps its w (lazy)
    _close(opt.get_slot(w, "m")[:, 0], [0.05, 0.02, 0.0])  # row 0's m does not decay


def test_amsgrad_13_7_bit_exact():
    w, opt = _dense_run(gf.AMSGradOptimizer)
    assert w.detach().numpy().tolist() == [float(F32(0.74118596)), float(F32(2.24675))]
    w, opt = _dense_run(gf.AMSGradOptimizer, decay=True)
    assert w.detach().numpy().tolist() == [float(F32(0.8000876)), float(F32(2.1984453))]
    t = opt.param_groups[0]["non_slot"]["t"]
    assert t.dtype == torch.float32 and t.item() == 3.0
    v, v_hat = opt.get_slot(w, "v"), opt.get_slot(w, "v_hat")
    assert torch.equal(v, v_hat)  # v only grew in this example
    assert opt.get_slot_names() == ["m", "v", "v_hat"]


def test_amsgrad_v_hat_keeps_the_maximum():
    w = torch.nn.Parameter(torch.tensor([0.0]))
    opt = gf.AMSGradOptimizer([w], learning_rate=0.1, beta2=0.5)
    for g in (2.0, 0.0):
        w.grad = torch.tensor([g])
        opt.step()
    assert opt.get_slot(w, "v").item() == pytest.approx(1.0)  # 0.5 * (0.5 * 4)
    assert opt.get_slot(w, "v_hat").item() == pytest.approx(2.0)


def test_amsgrad_zero_epsilon_warns_once_when_a_first_gradient_is_zero():
    """RETURNN's default epsilon=0: an element whose gradient is exactly 0 at its parameter's
    first step gets 0 / (0 + sqrt(0)) = NaN, as in RETURNN; gradfleet keeps the maths and says
    so once, at that step."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = gf.AMSGradOptimizer([w], learning_rate=0.1)
    w.grad = torch.tensor([1.0, 0.0, 2.0, 0.0])
    with pytest.warns(UserWarning, match="epsilon is 0 .* 2 gradient element"):
        opt.step()
    assert torch.isnan(w[[1, 3]]).all() and torch.isfinite(w[[0, 2]]).all()
    late = torch.nn.Parameter(torch.ones(2))  # a later parameter's first step: warned already
    opt.add_param_group({"params": [late]})
    late.grad = torch.zeros(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_amsgrad_zero_epsilon_check_reads_first_steps_only():
    """No warning without a zero element at a first step, nor with epsilon > 0; a parameter
    that joins later is checked at its own first step; later steps are never read back."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = gf.AMSGradOptimizer([w], learning_rate=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.grad = torch.tensor([1.0, -2.0, 3.0])
        opt.step()
        w.grad = torch.zeros(3)  # v_hat > 0 by now: a zero gradient is harmless, and unread
        opt.step()
        assert torch.isfinite(w).all()
        positive = gf.AMSGradOptimizer([torch.nn.Parameter(torch.ones(2))], epsilon=1e-16)
        positive.param_groups[0]["params"][0].grad = torch.zeros(2)
        positive.step()
    late = torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [late]})
    late.grad = torch.tensor([0.0, 1.0])
    w.grad = torch.ones(3)
    with pytest.warns(UserWarning, match="1 gradient element"):
        opt.step()


def test_amsgrad_from_a_returnn_config():
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = gf.create_optimizer(p, {"class": "amsgrad", "decay": True}, returnn_defaults=True)
    assert isinstance(opt, gf.AMSGradOptimizer) and opt.get_name() == "AMSGradOptimizer"
    assert opt.param_groups[0]["epsilon"] == 1e-16 and opt.param_groups[0]["decay"] is True
    p[0].grad = torch.ones(3)
    opt.step()
    assert torch.isfinite(p[0]).all()


def test_amsgrad_rejects_sparse_gradients_and_tf_only_arguments():
    w = torch.nn.Parameter(torch.ones(3, 2))
    opt = gf.AMSGradOptimizer([w])
    w.grad = _sparse([0], [[1.0, 1.0]], (3, 2))
    with pytest.raises(TypeError, match="AMSGradOptimizer.*CustomAdamOptimizer"):
        opt.step()
    assert not opt.state and torch.equal(w.detach(), torch.ones(3, 2))
    assert opt.param_groups[0]["non_slot"]["t"].item() == 0.0
    with pytest.raises(TypeError, match="use_locking"):
        gf.AMSGradOptimizer([w], use_locking=True)  # as in RETURNN
    with pytest.raises(TypeError, match="name"):
        gf.AMSGradOptimizer([w], name="x")


# ------------------------------------------------------------------ the extension point


class ScaledSGD(gf.BaseCustomOptimizer):
    """A user-defined optimizer: w -= lr * g * (1 + a), a = decay * a + |g| (per row)."""

    hyperparameters = {"lr": _hyper.NON_NEGATIVE, "decay": _hyper.UNIT}
    slots = {"a": 0.0}

    def __init__(self, params, learning_rate, decay=0.5, **kwargs):
        super().__init__(params, learning_rate, decay=decay, **kwargs)

    def _apply_var(self, grad, var, indices=None):
        a = self._get_slot(var, "a")
        a_g = self._hp["decay"] * self._gather(a, indices) + grad.abs()
        self._assign(a, a_g, indices)
        self._assign_sub(var, self._hp["lr"] * grad * (1 + a_g), indices)


def _scaled_sgd_numpy(w, a, g, idx, lr=0.25, decay=0.5):
    rows = range(len(w)) if idx is None else idx
    new_a = [decay * a[i] + abs(gk) for i, gk in zip(rows, g)]  # all read the old a
    for i, ak in zip(rows, new_a):
        a[i] = ak  # the last occurrence wins
    for i, gk, ak in zip(rows, g, new_a):
        w[i] -= lr * gk * (1 + ak)  # once per occurrence


def test_user_subclass_dense_and_sparse_with_duplicates():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    opt = ScaledSGD([w], learning_rate=0.25)
    assert opt.get_name() == "ScaledSGD" and opt.get_slot_names() == ["a"]
    ref_w, ref_a = [1.0, 2.0, 3.0, 4.0], [0.0] * 4
    steps = [
        (None, [0.5, -1.0, 0.25, 2.0]),
        ([2, 0, 2], [1.0, -0.5, -2.0]),
        ([], []),
        ([3], [0.75]),
    ]
    for idx, g in steps:
        if idx is None:
            w.grad = torch.tensor(g, dtype=torch.float64)
        else:
            values = torch.tensor(g, dtype=torch.float64)
            w.grad = torch.sparse_coo_tensor(torch.tensor([idx], dtype=torch.int64), values, (4,))
        opt.step()
        _scaled_sgd_numpy(ref_w, ref_a, g, idx)
        np.testing.assert_allclose(w.detach().numpy(), ref_w, rtol=1e-15)
        np.testing.assert_allclose(opt.get_slot(w, "a").numpy(), ref_a, rtol=1e-15)


def test_user_subclass_hyperparameters_are_cast_and_checked_like_tf():
    w = torch.nn.Parameter(torch.tensor([0.0], dtype=torch.float64))
    opt = ScaledSGD([w], learning_rate=0.1, decay=0.5, name="mine")
    assert opt.get_name() == "mine"
    w.grad = torch.tensor([1.0], dtype=torch.float64)
    opt.step()
    assert w.item() == -float(F32(0.1)) * 2.0  # lr went through float32, as in TF
    with pytest.raises(ValueError, match="decay must be in \\[0, 1\\]"):
        ScaledSGD([w], learning_rate=0.1, decay=2.0)


def test_base_custom_itself_raises_not_implemented():
    w = torch.nn.Parameter(torch.ones(2))
    opt = gf.BaseCustomOptimizer([w], learning_rate=0.1)
    assert opt.get_name() == "BaseCustomOptimizer"
    w.grad = torch.ones(2)
    with pytest.raises(NotImplementedError, match="BaseCustomOptimizer.*_apply_var"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(2))


def test_subclass_defining_returnns_apply_is_told_the_torch_name():
    with pytest.raises(TypeError, match="_apply_var"):

        class Ported(gf.BaseCustomOptimizer):  # noqa: F841 - the definition itself fails
            def _apply(self, grad, var, indices=None):
                pass


def test_missing_user_hyperparameter_is_reported():
    class NoDefault(gf.BaseCustomOptimizer):
        hyperparameters = {"lr": _hyper.NON_NEGATIVE, "decay": _hyper.UNIT}

    with pytest.raises(TypeError, match="NoDefault.*'decay'"):
        NoDefault([torch.nn.Parameter(torch.ones(1))], 0.1)
    assert NoDefault([torch.nn.Parameter(torch.ones(1))], 0.1, decay=0.5).defaults["decay"] == 0.5


def test_assign_keeps_the_last_duplicate():
    ref = torch.zeros(3)
    values, indices = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([2, 0, 2, 0])
    gf.BaseCustomOptimizer._assign(ref, values, indices)
    assert ref.tolist() == [4.0, 0.0, 3.0]


def test_empty_sparse_step_still_decays_and_counts():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = gf.NeuralOptimizer1([w], learning_rate=0.1, beta1=0.5)
    w.grad = torch.tensor([0.4, -0.6])
    opt.step()
    w.grad = _sparse([], torch.zeros(0), (2,))
    opt.step()
    _close(opt.get_slot(w, "m"), [0.1, -0.15])
    _close(w, [0.96, 2.06])


def test_default_names_and_tf_kwargs():
    w = [torch.nn.Parameter(torch.ones(2))]
    for cls in (
        gf.CustomGradientDescentOptimizer,
        gf.NormalizedSGD,
        gf.NeuralOptimizer1,
        gf.GradVarianceScaledOptimizer,
        gf.CustomAdamOptimizer,
    ):
        assert cls(w, learning_rate=0.1).get_name() == cls.__name__
        assert cls(w, learning_rate=0.1, use_locking=True, name="n").get_name() == "n"
    with pytest.raises(ValueError, match="name"):
        gf.CustomAdamOptimizer(w, learning_rate=0.1, name="")


# ------------------------------------------------------------------ validation

BAD_ARGUMENTS = [
    (gf.CustomGradientDescentOptimizer, {"learning_rate": -0.1}, "learning_rate must be >= 0"),
    (gf.NormalizedSGD, {"learning_rate": float("inf")}, "learning_rate"),
    (gf.NeuralOptimizer1, {"beta1": 1.0}, "beta1 must be in \\[0, 1\\)"),
    (gf.NeuralOptimizer1, {"decrease_factor": -0.5}, "decrease_factor must be >= 0"),
    (gf.GradVarianceScaledOptimizer, {"beta2": -0.1}, "beta2 must be in \\[0, 1\\)"),
    (gf.GradVarianceScaledOptimizer, {"epsilon": -1e-8}, "epsilon must be >= 0"),
    (gf.CustomAdamOptimizer, {"beta1": 1.5}, "beta1 must be in \\[0, 1\\)"),
    (gf.CustomAdamOptimizer, {"beta2": float("nan")}, "beta2"),
    (gf.AMSGradOptimizer, {"beta2": 1.0}, "beta2 must be in \\[0, 1\\)"),
    (gf.AMSGradOptimizer, {"epsilon": -1.0}, "epsilon must be >= 0"),
    (gf.AMSGradOptimizer, {"learning_rate": -1.0}, "learning_rate must be >= 0"),
]


@pytest.mark.parametrize("cls,bad,message", BAD_ARGUMENTS)
def test_invalid_arguments_name_the_argument_and_range(cls, bad, message):
    w = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match=f"{cls.__name__}: {message}"):
        cls(w, **dict({"learning_rate": 0.1}, **bad))
