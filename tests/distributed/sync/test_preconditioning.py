"""The noise an adaptive optimizer sees (``sync.common.preconditioning``): its diagonal
preconditioner read from its state, against the slots recomputed in float64 from TF's and
torch's update rules; the weighted squared norms, dense and sparse; and the servers' noise
terms weighted by it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradfleet
from gradfleet.distributed.sync.common.preconditioning import preconditioners, weighted_sum_sq
from gradfleet.distributed.sync.server.aggregator import GradientAggregator

F64 = torch.float64
G1 = torch.tensor([0.5, -2.0, 0.0, 3.0], dtype=F64)
G2 = torch.tensor([1.0, 1.0, -1.0, 0.25], dtype=F64)


def _stepped(make, grads=(G1, G2)):
    """An optimizer of one float64 parameter after one step per gradient in ``grads``."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=F64))
    opt = make([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return opt, p


def test_adam_is_preconditioned_by_its_second_moment():
    opt, p = _stepped(lambda ps: gradfleet.AdamOptimizer(ps, 0.01, epsilon=1e-3))
    b2 = float(np.float32(0.999))  # TF makes its hyperparameters float32 tensors
    v = b2 * ((1 - b2) * G1**2) + (1 - b2) * G2**2  # TF: v = beta2 v + (1 - beta2) g^2
    (P,) = preconditioners(opt, [p])
    torch.testing.assert_close(P, 1 / (v.sqrt() + 1e-3), rtol=1e-12, atol=0)


def test_torch_adam_and_amsgrad_by_theirs():
    opt, p = _stepped(lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-4))
    v = 0.999 * (0.001 * G1**2) + 0.001 * G2**2
    torch.testing.assert_close(preconditioners(opt, [p])[0], 1 / (v.sqrt() + 1e-4))
    opt, p = _stepped(lambda ps: gradfleet.AMSGradOptimizer(ps, 0.01, epsilon=1e-8))
    assert "v_hat" in opt.state[p]
    torch.testing.assert_close(
        preconditioners(opt, [p])[0], 1 / (opt.state[p]["v_hat"].double().sqrt() + 1e-8)
    )


def test_rmsprop_adds_its_epsilon_inside_the_root():
    opt, p = _stepped(lambda ps: gradfleet.RMSPropOptimizer(ps, 0.01, epsilon=1e-2))
    rms = 0.9 * (0.9 * 1.0 + 0.1 * G1**2) + 0.1 * G2**2  # TF: ones, then decay
    torch.testing.assert_close(preconditioners(opt, [p])[0], 1 / (rms + 1e-2).sqrt())


def test_adagrad_by_its_accumulator_and_adadelta_by_its_ratio():
    opt, p = _stepped(lambda ps: gradfleet.AdagradOptimizer(ps, 0.1))
    accum = 0.1 + G1**2 + G2**2
    torch.testing.assert_close(preconditioners(opt, [p])[0], 1 / (accum.sqrt() + 1e-8))
    opt, p = _stepped(lambda ps: gradfleet.AdadeltaOptimizer(ps, 1.0, epsilon=1e-6))
    state = opt.state[p]
    expected = (state["accum_update"].double() + 1e-6).sqrt() / (state["accum"] + 1e-6).sqrt()
    torch.testing.assert_close(preconditioners(opt, [p])[0], expected)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: gradfleet.GradientDescentOptimizer(ps, 0.1),
        lambda ps: gradfleet.MomentumOptimizer(ps, 0.1, 0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["GradientDescent", "Momentum", "torch-SGD"],
)
def test_plain_and_momentum_descent_are_not_preconditioned(make):
    opt, p = _stepped(make)
    assert preconditioners(opt, [p]) == [None]


def test_a_parameter_without_state_yet_is_not_preconditioned():
    p = torch.nn.Parameter(torch.zeros(4, dtype=F64))
    assert preconditioners(gradfleet.AdamOptimizer([p], 0.01), [p]) == [None]


def test_weighted_sum_sq_dense_sparse_and_none():
    w = torch.tensor([1.0, 2.0, 0.5, 4.0], dtype=F64)
    table_w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=F64)
    # rows 2 and 0, row 2 twice: coalesced (summed) before squaring
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[2, 0, 2]]), torch.tensor([[1.0, 1.0], [2.0, -1.0], [0.5, 1.0]], dtype=F64),
        (3, 2),
    )  # fmt: skip
    rows = {0: [2.0, -1.0], 2: [1.5, 2.0]}
    sparse_ref = sum(
        float(table_w[r, c]) * v**2 for r, vals in rows.items() for c, v in enumerate(vals)
    )
    dense_ref = float((w * G1**2).sum())
    got = weighted_sum_sq([G1, None, sparse], [w, None, table_w])
    assert got.dtype == F64
    assert float(got) == pytest.approx(dense_ref + sparse_ref, rel=1e-15)
    assert float(weighted_sum_sq([G1, sparse])) == pytest.approx(
        float((G1**2).sum()) + sum(v**2 for vals in rows.values() for v in vals), rel=1e-15
    )
    assert float(weighted_sum_sq([None])) == 0.0


def test_the_servers_noise_terms_are_taken_in_the_preconditioners_metric():
    """``(sum_i g_i^T P g_i, mean^T P mean, k)`` of an update, ``P`` read once per update."""
    x = torch.zeros(4, dtype=F64)
    agg = GradientAggregator([x], 2)
    agg.measure_noise = True
    w = torch.tensor([1.0, 0.5, 2.0, 0.25], dtype=F64)
    reads = []
    agg.noise_weights = lambda: reads.append(1) or [w]
    assert agg.push(0, 0, [G1]) and agg.push(1, 0, [G2])
    agg.take_average()
    mean = (G1 + G2) / 2
    sum_sq, mean_sq, k = agg.last_noise
    assert k == 2 and reads == [1]
    assert sum_sq == pytest.approx(float((w * G1**2).sum() + (w * G2**2).sum()), rel=1e-15)
    assert mean_sq == pytest.approx(float((w * mean**2).sum()), rel=1e-15)
