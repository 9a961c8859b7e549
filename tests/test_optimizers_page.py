"""docs/optimizers.md's extension example (SignSGD) does what the page says: it moves each
parameter by ``lr * sign(grad)``, dense and sparse, duplicates applied once per occurrence."""

from __future__ import annotations

import numpy as np
import torch

import gradfleet as gf
from tests.doc_blocks import claimed_blocks


def _page_extension_class():
    (block,) = claimed_blocks("docs/optimizers.md", __file__)
    namespace = {"gf": gf, "torch": torch}
    exec(block, namespace)  # noqa: S102 - the page's own example
    return namespace["SignSGD"]


def test_custom_optimizer_example_dense_and_sparse():
    sign_sgd = _page_extension_class()
    w = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [3.0, 4.0], [0.5, 0.5]]))
    opt = sign_sgd([w], learning_rate=0.25)
    w.grad = torch.tensor([[0.3, -0.1], [0.0, 2.0], [-1.0, 5.0]])
    opt.step()
    expected = np.array([[0.75, -1.75], [3.0, 3.75], [0.75, 0.25]], dtype=np.float32)
    np.testing.assert_array_equal(w.detach().numpy(), expected)
    # sparse, duplicate row 2 applied once per occurrence (RETURNN's scatter_sub)
    w.grad = torch.sparse_coo_tensor([[2, 2]], torch.tensor([[1.0, -1.0], [1.0, 1.0]]), (3, 2))
    opt.step()
    expected[2] += [-0.5, 0.0]
    np.testing.assert_array_equal(w.detach().numpy(), expected)
