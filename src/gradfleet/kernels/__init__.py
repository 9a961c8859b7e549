"""Fast implementations of every optimizer's dense step, from the optimizer's own maths.

Three paths, chosen per param group by ``foreach``/``fused`` as in ``torch.optim``, except that
the default on CUDA is the fused kernel where it keeps eager CUDA's numbers
(see ``dispatch.resolve_path``): the per-parameter reference loop (ground truth), the
multi-tensor path (``TensorList`` over ``torch._foreach_*``) and the fused path (one
inductor kernel per device/dtype bucket, traced from the maths with ``make_fx``).  Nothing
here is per-algorithm: both fast paths call the subclass's ``_apply_dense`` (or ``_rule``)
unchanged.

Exactness against the reference loop (checked by tests/kernels/test_fast_paths.py):

* foreach: bit-identical on CPU (each ``_foreach_*`` op runs the same ATen kernel per
  tensor, in the same order).
* fused: same operations in the same order, no FMA contraction (inductor compiles with
  ``-ffp-contract=off``); the residue is ATen's own eager kernels: for large float32
  tensors ATen uses MKL-VML for ``sqrt``/``rsqrt``/``exp``/``log``, which is off by up to
  1 ulp from the correctly rounded result inductor computes (TensorFlow's Eigen kernels are
  correctly rounded too).  Differences therefore stay at a few ulps per step.
"""

from gradfleet.kernels import dtensor, plan
from gradfleet.kernels.dispatch import PATHS, apply_dense, resolve_path
from gradfleet.kernels.tensorlist import TensorList

__all__ = ["PATHS", "TensorList", "apply_dense", "dtensor", "plan", "resolve_path"]
