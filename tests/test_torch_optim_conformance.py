"""torch's own optimizer conformance tests, run on every gradfleet optimizer.

pytorch checks its optimizers with the generic tests of ``TestOptimRenewed`` (its
``test/test_optim.py``), each run over ``optim_db``: one ``OptimizerInfo`` per optimizer from
``torch.testing._internal.common_optimizers``, saying which configurations to try
(``optim_inputs_func``), which implementations exist (``supported_impls``), whether sparse or
complex parameters are supported, and which inputs must raise (``optim_error_inputs_func``).
The wheel ships ``common_optimizers`` but not ``test_optim.py``, so this module holds an
``OptimizerInfo`` for each gradfleet optimizer (``OPTIM_DB``) and states torch's generic tests
again, one test function per ``TestOptimRenewed`` test, with the same inputs, steps and
checks.  Where a restated test checks more than torch's (``test_tensor_lr`` steps both
optimizers; ``test_step_is_noop_when_params_have_no_grad`` compares the parameters), its
docstring says so.

Every ``TestOptimRenewed`` test is either here or in ``SKIPS`` with the reason it cannot
apply (TF's maths, a flag gradfleet refuses on purpose, torch internals, hardware this suite
never runs on); ``test_every_torch_test_is_run_or_skipped_with_a_reason`` checks that the two
cover torch's list (``TORCH_TESTS``).  ``ERROR_DEVIATIONS`` lists torch's generic error
inputs that gradfleet answers with another error, and why.

Differences in how inputs are made, each for a stated reason:

* configurations: the conformance table's (tests/conformance), with torch's ``lr`` for TF's
  ``learning_rate`` (torch's tests set and delete ``kwargs["lr"]``);
* implementations: each configuration runs on the loop (``foreach=False``) and on
  ``foreach=True``.  torch's ``_get_optim_inputs_including_global_cliquey_kwargs`` leaves
  foreach out on the CPU (torch's foreach kernels are CUDA's), but gradfleet's foreach path is
  its own code on every device, so ``_all_inputs`` adds it.  ``fused=True`` runs in the fused
  tests (``test_fused_matches_forloop``, ``test_fused_error_on_params_on_meta``) and where a
  step has nothing to compile (no gradients: printing, step hooks, steps without gradients):
  it compiles a kernel per optimizer, configuration, dtype and parameter set (1-3 s each),
  and it reproduces the loop, so the API tests' outcome is the loop's (a fused optimizer's
  copies: tests/test_torch_conventions.py);
* torch's generic error inputs get the hyperparameters a gradfleet class requires
  (``learning_rate``, Momentum's ``momentum``): they assume every hyperparameter has a default.

Runs on the CPU, and on CUDA too where a GPU is present (``DEVICES``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.testing._internal.common_optimizers import (
    ErrorOptimizerInput,
    OptimizerErrorEnum,
    OptimizerInfo,
    OptimizerInput,
    get_error_inputs_for_all_optims,
)

import gradfleet as gf
from gradfleet.kernels import _torch_private as private
from tests.conformance.specs import SPECS
from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CONCRETE = [cls for cls in gf.optimizers.ALL if cls is not gf.BaseCustomOptimizer]

# ---------------------------------------------------------------------------- the table


def _spec_configs() -> dict[type, list[dict]]:
    out: dict[type, list[dict]] = {}
    for spec in SPECS + RETURNN_SPECS:
        out.setdefault(spec.cls, []).extend(spec.configs)
    return out


_CONFIGS = _spec_configs()


#: The learning rate of every configuration that sets one.  The conformance table's rates are
#: chosen for its random gradient streams; torch's problems (a 10x5 least-squares loss for 20
#: steps) have curvature up to about 2 (|x|^2 + 1) ~ 20, where a rate above 0.1 makes
#: gradient descent diverge.  torch's own configurations use 1e-3 to 1e-2 likewise.
LR = 0.01


def _inputs(cls: type, device=None, dtype=None) -> list[OptimizerInput]:
    """``optim_inputs_func``: the conformance table's configurations in torch's names (``lr``
    for TF's ``learning_rate``, at ``LR``); one without a learning rate keeps the default."""
    out = []
    for i, config in enumerate(_CONFIGS[cls]):
        if "_global_step" in config:  # AdagradDA's caller-owned global_step: built by the spec
            continue
        kwargs = dict(config)
        if kwargs.pop("learning_rate", None) is not None:
            kwargs["lr"] = LR
        out.append(OptimizerInput(params=None, kwargs=kwargs, desc=f"config {i}"))
    return out


def _required(cls: type) -> dict:
    """Values for the hyperparameters ``cls`` requires (TF1's ``learning_rate`` has no
    default in most classes; Momentum's ``momentum`` has none either)."""
    out = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if p.default is p.empty and name in ("learning_rate", "momentum"):
            out["lr" if name == "learning_rate" else name] = LR if name == "learning_rate" else 0.9
    return out


def _error_inputs(cls: type, device, dtype) -> list[ErrorOptimizerInput]:
    """``optim_error_inputs_func``: torch's generic error inputs (with the required
    hyperparameters, see ``ERROR_DEVIATIONS``) and gradfleet's own."""
    required = _required(cls)
    out = []
    for error in get_error_inputs_for_all_optims(device, dtype):
        given = error.optimizer_error_input
        kwargs = {**required, **given.kwargs}
        deviation = ERROR_DEVIATIONS.get(given.desc)
        if deviation is not None:
            error = ErrorOptimizerInput(
                given,
                error_on=OptimizerErrorEnum.CONSTRUCTION_ERROR,
                error_type=deviation.error_type,
                error_regex=deviation.error_regex,
            )
        error.optimizer_error_input = OptimizerInput(given.params, kwargs, given.desc)
        out.append(error)

    def param(**kwargs):
        return Parameter(torch.randn(2, 2, device=device, dtype=dtype), **kwargs)

    def construction(kwargs, error_type, regex, desc, params=None):
        return ErrorOptimizerInput(
            OptimizerInput([param()] if params is None else params, kwargs, desc),
            error_type=error_type,
            error_regex=regex,
        )

    out += [
        construction(
            {**required, "foreach": True, "fused": True},
            RuntimeError,
            "`fused` and `foreach` cannot be `True` together",
            "foreach and fused together are refused at construction",
        ),
        construction(
            {**required, "lr": -0.01},
            ValueError,
            "learning_rate must be >?=? 0",
            "a negative learning rate",
        ),
        construction(
            {**required, "weight_decay": 0.01},
            TypeError,
            "weight_decay=0.01: torch's weight_decay has no counterpart",
            "torch's weight_decay (TF1's maths has none)",
        ),
        construction(
            {**required, "maximize": True},
            TypeError,
            "maximize=True",
            "torch's maximize",
        ),
        construction(
            {**required, "differentiable": True},
            TypeError,
            "differentiable=True",
            "torch's differentiable",
        ),
        construction(
            required,
            TypeError,
            "parameters must be float16, bfloat16, float32 or float64, got torch.complex64",
            "complex parameters (TF1's optimizers take real dtypes)",
            params=[Parameter(torch.randn(2, device=device, dtype=torch.complex64))],
        ),
    ]
    if required:
        # Not in the constructor nor in the (second) group: refused at construction.
        groups = [{"params": [param()], **required}, {"params": [param()]}]
        out.append(construction({}, TypeError, "missing", "a required value in no group", groups))
    if cls.sparse is None:
        sparse = param()
        sparse.grad = torch.sparse_coo_tensor([[0]], torch.ones(1, 2), (2, 2)).to(device, dtype)
        out.append(
            ErrorOptimizerInput(
                OptimizerInput([sparse], required, "a sparse gradient (dense rule only)"),
                error_on=OptimizerErrorEnum.STEP_ERROR,
                error_type=TypeError,
                error_regex="dense gradients only",
            )
        )
    return out


# Sparse-gradient settings (torch's ``metadata_for_sparse``): keyword arguments that replace the
# configuration's (a rate at which the Rosenbrock descent of ``test_rosenbrock_sparse`` makes
# progress; no l1/l2, which shrink untouched rows on the dense path, as torch drops weight
# decay there), and the schedulers run with them.
_NO_PROXIMAL = {"l1_regularization_strength": 0.0, "l2_regularization_strength": 0.0}
_SPARSE_KWARGS = {
    gf.AdagradOptimizer: {"lr": 0.5},
    gf.ProximalAdagradOptimizer: {"lr": 0.5, **_NO_PROXIMAL},
    # torch's Adam defaults: with the table's beta2 = 0.9 or epsilon = 1e-16, 1800 steps of
    # this chaotic descent magnify the ulp by which the split sparse value differs beyond 5e-6
    gf.AdamOptimizer: {"lr": 0.05, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    gf.ProximalGradientDescentOptimizer: {"lr": 1e-3, **_NO_PROXIMAL},
}


def _info(cls: type) -> OptimizerInfo:
    return OptimizerInfo(
        cls,
        optim_inputs_func=functools.partial(_inputs, cls),
        optim_error_inputs_func=functools.partial(_error_inputs, cls),
        scheduler_inputs=(
            [lambda opt: StepLR(opt, gamma=0.9, step_size=10)],
            [lambda opt: ReduceLROnPlateau(opt)],
        ),
        # gradfleet refuses differentiable=True (its steps run under no_grad)
        supported_impls=("foreach", "fused"),
        supports_fused_on=("cpu", "cuda"),
        # group keys a state dict of an earlier release may lack
        not_og_supported_flags=("foreach", "fused"),
        supports_sparse=cls.sparse is not None,
        metadata_for_sparse=(
            _SPARSE_KWARGS.get(cls, {"lr": 1e-3}),
            [lambda opt: StepLR(opt, gamma=0.99999, step_size=300)],
        ),
        supports_complex=False,  # TF1's optimizers: real dtypes (refused, see _error_inputs)
    )


OPTIM_DB: list[OptimizerInfo] = [_info(cls) for cls in CONCRETE]

# ---------------------------------------------------------------------------- the reviewed lists


@dataclass(frozen=True)
class ErrorDeviation:
    """A torch generic error input that gradfleet answers with another error."""

    error_type: type
    error_regex: str
    why: str


ERROR_DEVIATIONS = {
    "a param group cannot have duplicate parameters": ErrorDeviation(
        ValueError,
        "listed twice in one param group",
        "torch warns and steps the parameter twice per step; gradfleet refuses it",
    ),
    "duplicate parameters should not occur across param groups either": ErrorDeviation(
        ValueError,
        "listed in two param groups",
        "the same error type; gradfleet's message names the parameter's shape",
    ),
    "Tensor lr must be 1-element": ErrorDeviation(
        ValueError,
        "hyperparameter tensors must hold one value",
        "the same error type; gradfleet's check covers every hyperparameter, not lr alone",
    ),
}


@dataclass(frozen=True)
class Skip:
    """A ``TestOptimRenewed`` test that cannot apply: to ``optimizers`` (class names), or to
    every optimizer when None; in ``dtypes`` only, for a test run per dtype."""

    test: str
    optimizers: tuple[str, ...] | None
    reason: str
    dtypes: tuple[torch.dtype, ...] | None = None


_REQUIRED_LR = tuple(sorted(c.__name__ for c in CONCRETE if _required(c)))
_CLOSED_FORM = ("AdagradDAOptimizer", "FtrlOptimizer")

SKIPS: list[Skip] = [
    # -- torch-only features gradfleet refuses on purpose
    Skip(
        "test_complex",
        None,
        "TF1's optimizers take real dtypes only; a complex parameter is refused with a "
        "TypeError at construction (test_errors)",
    ),
    Skip(
        "test_complex_2d",
        None,
        "TF1's optimizers take real dtypes only (as test_complex): the complex parameter is "
        "refused at construction",
    ),
    Skip(
        "test_fused_does_not_step_if_foundinf",
        None,
        "torch's fused kernels read optimizer.grad_scale/found_inf that GradScaler sets on "
        "optimizers with _step_supports_amp_scaling; gradfleet's do not claim it, so GradScaler "
        "unscales the gradients and skips a step with Inf itself",
    ),
    Skip(
        "test_second_order_optims_return_consistent_types",
        None,
        "for optimizers whose step requires a closure (LBFGS); no gradfleet optimizer's does",
    ),
    Skip(
        "test_defaults_changed_to_foreach",
        None,
        "patches torch.optim's private _multi_tensor_<name> function; gradfleet's default "
        "on CUDA is its fused kernel where it keeps eager CUDA's numbers, else foreach "
        "(tests/kernels/test_fast_paths.py::test_default_path_rule, tests/kernels/test_cuda.py)",
    ),
    Skip(
        "test_param_group_with_lrscheduler_goes_right_direction",
        _REQUIRED_LR,
        "its first param group has no lr and the constructor gets none: TF1's learning_rate "
        "has no default in these classes (nor Momentum's momentum), so the constructor "
        "refuses the group (TypeError, test_errors), as torch refuses a group without a "
        "required hyperparameter",
    ),
    # -- TF's maths
    Skip(
        "test_param_groups_lr",
        _CLOSED_FORM,
        "TF's closed-form weights: AdagradDA and FTRL set each weight from the accumulators "
        "(w = -lr * ... for AdagradDA, w = 0 where |z| <= l1 for FTRL) instead of moving it "
        "by lr x update, so the group at lr 1e-28 does change",
    ),
    Skip(
        "test_step_is_noop_for_zero_grads",
        _CLOSED_FORM,
        "TF's closed-form weights: a zero gradient sets w from zero accumulators (0), it does "
        "not leave w where it was",
    ),
    Skip(
        "test_step_is_noop_for_zero_grads",
        ("AMSGradOptimizer",),
        "RETURNN's default epsilon=0: an element whose gradients have all been 0 gets "
        "0 / (0 + sqrt(0)) = NaN (RETURNN's maths; documented, and warned at the first step)",
    ),
    Skip(
        "test_fused_matches_forloop",
        None,
        "float32/float64: tests/kernels/test_fast_paths.py::test_fused_matches_loop runs every "
        "optimizer fused against the loop in both dtypes (small and large parameters, None "
        "gradients, a zero-size parameter, 10 steps, every step's parameters and state); "
        "here each optimizer and dtype is two more kernel compiles (1-3 s each), so only "
        "float16/bfloat16 run, where the fused path claims the loop's bits",
        dtypes=(torch.float32, torch.float64),
    ),
    # -- hardware this suite never runs on
    Skip(
        "test_forloop_goes_right_direction_multigpu",
        None,
        "needs two GPUs; the machines that run this suite have at most one",
    ),
    Skip("test_mixed_device_dtype", None, "needs two GPUs, as above"),
    Skip(
        "test_foreach_large_tensor",
        None,
        "a 2**32-element float16 tensor: needs 72 GB of GPU memory",
    ),
    Skip("test_fused_large_tensor", None, "a 2**32-element tensor: needs 64 GB of memory"),
    Skip(
        "test_peak_memory_foreach",
        None,
        "its expected peak is a count of torch's own foreach intermediates per torch class; "
        "gradfleet's fused step is checked to allocate no parameter-sized temporary instead "
        "(tests/kernels/test_fast_paths.py)",
    ),
]

if not private.HALF_PRECISION_EXACT:
    SKIPS.append(
        Skip(
            "test_fused_matches_forloop",
            None,
            f"torch {torch.__version__}: before 2.13 inductor's CPU code generator cannot take "
            "(2.8-2.10) or drops (2.11, 2.12) the round trips to half precision that give the "
            "loop's bits; fused float16/bfloat16 differ from the loop within the bound "
            "docs/releases.md states (tests/kernels/test_fast_paths.py checks it on those "
            "releases)",
            dtypes=(torch.float16, torch.bfloat16),
        )
    )

# Sparse gradients: TF's sparse rules update the listed rows only, which equals the dense
# update with zero rows only where a zero gradient changes neither weight nor state.
_SPARSE_NOT_DENSE = {
    "MomentumOptimizer": "the accumulator of rows not listed does not decay (TF's "
    "SparseApplyMomentum); dense zeros decay it",
    "RMSPropOptimizer": "ms and mom of rows not listed do not decay (TF's SparseApplyRMSProp)",
    "AdadeltaOptimizer": "the accumulators of rows not listed do not decay (TF's "
    "SparseApplyAdadelta)",
    "AdagradDAOptimizer": "TF's closed form sets the weight of every row a dense step sees, "
    "also of rows whose gradient is 0; the sparse step sets the listed rows only",
    "FtrlOptimizer": "as AdagradDA: the closed form sets every row a dense step sees",
    "CustomAdamOptimizer": "RETURNN's lazy Adam: rows not listed keep m and v, and a "
    "duplicated index steps once per occurrence (spec 13.6)",
    "NormalizedSGD": "the norm is taken over the sparse values as given, duplicates "
    "counted separately (spec 13.3), not over the dense gradient",
    "GradVarianceScaledOptimizer": "its slots decay on all rows, the parameter moves on the "
    "listed rows only (RETURNN on TF1 reference variables)",
}
SKIPS += [
    Skip(
        "test_rosenbrock_sparse",
        (name,),
        f"torch checks the sparse step against the dense step with zeros; TF's is not that: {why}",
    )
    for name, why in _SPARSE_NOT_DENSE.items()
]

#: ``TestOptimRenewed``'s tests (pytorch's test/test_optim.py, torch 2.8 to 2.14).
TORCH_TESTS = (
    "test_optim_infos_do_not_specify_global_cliquey_kwargs",
    "test_errors",
    "test_forloop_goes_right_direction",
    "test_forloop_goes_right_direction_multigpu",
    "test_param_group_with_lrscheduler_goes_right_direction",
    "test_tensor_lr",
    "test_rosenbrock_sparse",
    "test_complex",
    "test_complex_2d",
    "test_foreach_matches_forloop",
    "test_mixed_device_dtype",
    "test_set_default_dtype_works_with_foreach",
    "test_foreach_large_tensor",
    "test_peak_memory_foreach",
    "test_fused_matches_forloop",
    "test_fused_error_on_params_on_meta",
    "test_fused_large_tensor",
    "test_fused_does_not_step_if_foundinf",
    "test_cpu_load_state_dict",
    "test_param_groups_weight_decay",
    "test_param_groups_lr",
    "test_step_is_noop_when_params_have_no_grad",
    "test_step_is_noop_for_zero_grads",
    "test_optimizer_can_be_printed",
    "test_state_dict_deterministic",
    "test_can_load_older_state_dict",
    "test_can_load_from_to_named_state_dict",
    "test_save_load_equality_with_weights_only",
    "test_load_nontensor_step",
    "test_state_dict_with_cuda_params",
    "test_state_dict_pre_hook",
    "test_state_dict_post_hook",
    "test_state_dict_pre_post_hook",
    "test_load_state_dict_pre_hook_and_prepend",
    "test_load_state_dict_post_hook",
    "test_load_state_dict_pre_post_hook",
    "test_step_post_hook",
    "test_step_pre_hook",
    "test_step_all_hooks",
    "test_deepcopy_copies_all_public_attrs",
    "test_second_order_optims_return_consistent_types",
    "test_fused_cpu_matches_cuda",
    "test_defaults_changed_to_foreach",
    "test_non_empty_state",
)


def _skip_reason(test: str, info: OptimizerInfo, dtype=None) -> str | None:
    for skip in SKIPS:
        if (
            skip.test == test
            and (skip.optimizers is None or info.name in skip.optimizers)
            and (skip.dtypes is None or dtype in skip.dtypes)
        ):
            return skip.reason
    return None


def optims(test: str, infos=None, devices=None, dtypes=None):
    """Parametrize a test over ``OPTIM_DB`` (torch's ``@optims``) and ``DEVICES`` as
    ``info, device`` (and over ``dtypes`` as ``dtype`` if given), with ``SKIPS`` applied."""
    cases = []
    for info in OPTIM_DB if infos is None else infos:
        for device in DEVICES if devices is None else devices:
            for dtype in [None] if dtypes is None else dtypes:
                reason = _skip_reason(test, info, dtype)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                values, name = (info, device), f"{info.name}-{device}"
                if dtype is not None:
                    values, name = (*values, dtype), f"{name}-{str(dtype).split('.')[-1]}"
                cases.append(pytest.param(*values, id=name, marks=marks))
    return pytest.mark.parametrize("info,device" + (",dtype" if dtypes else ""), cases)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _one_thread():
    """torch's problems are a few dozen elements: with OpenMP threads on a busy 2-core machine
    every op waits on a barrier for a descheduled thread (a 2x8x8 batch norm: 70 ms instead of
    0.1 ms), so these tests run on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_every_torch_test_is_run_or_skipped_with_a_reason():
    run = {name for name in globals() if name.startswith("test_")}
    skipped_for_all = {s.test for s in SKIPS if s.optimizers is None and s.dtypes is None}
    assert set(TORCH_TESTS) <= run | skipped_for_all, set(TORCH_TESTS) - run - skipped_for_all
    assert not (run & skipped_for_all), run & skipped_for_all
    names = {info.name for info in OPTIM_DB}
    for skip in SKIPS:
        assert skip.test in TORCH_TESTS, skip.test
        assert skip.optimizers is None or set(skip.optimizers) <= names, skip
        assert len(skip.reason) > 20, skip
    assert {info.optim_cls for info in OPTIM_DB} == set(CONCRETE)


# ---------------------------------------------------------------------------- helpers


def _all_inputs(info: OptimizerInfo, device, impls=("foreach",)) -> list[OptimizerInput]:
    """Every configuration on the loop and on each of ``impls`` set True: torch's
    ``_get_optim_inputs_including_global_cliquey_kwargs`` with gradfleet's CPU foreach."""
    flags = [{"foreach": False}] + [{impl: True} for impl in impls]
    return [
        OptimizerInput(None, {**copy.deepcopy(inp.kwargs), **flag}, f"{inp.desc} {flag}")
        for inp in info.optim_inputs_func(device=device)
        for flag in flags
    ]


def _linear(device, dtype=torch.float32, contiguous=True):
    """torch's usual problem: loss = |W x + b|^2, W 10x5, b 10 (strided views if asked)."""
    if contiguous:
        weight = Parameter(torch.randn(10, 5, device=device, dtype=dtype))
        bias = Parameter(torch.randn(10, device=device, dtype=dtype))
    else:
        weight = Parameter(torch.randn(10, 5, 2, device=device, dtype=dtype)[..., 0])
        bias = Parameter(torch.randn(10, 2, device=device, dtype=dtype)[..., 0])
    x = torch.randn(5, device=device, dtype=dtype)
    return weight, bias, lambda: (weight.mv(x) + bias).pow(2).sum()


def _backward(opt, loss_fn) -> torch.Tensor:
    opt.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss


def _step_scheduler(scheduler, loss) -> None:
    if isinstance(scheduler, ReduceLROnPlateau):
        scheduler.step(loss)
    else:
        scheduler.step()


def _without_param_names(state_dict: dict) -> dict:
    out = copy.deepcopy(state_dict)
    for group in out["param_groups"]:
        group.pop("param_names", None)
    return out


def _assert_state_dicts_equal(a, b) -> None:
    """Equal nested structures, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a, b)
        for key in a:
            _assert_state_dicts_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _assert_state_dicts_equal(x, y)
    else:
        assert a == b, (a, b)


# ---------------------------------------------------------------------------- the tests


@optims("test_optim_infos_do_not_specify_global_cliquey_kwargs", devices=["cpu"])
def test_optim_infos_do_not_specify_global_cliquey_kwargs(info, device):
    for inp in info.optim_inputs_func(device=device):
        assert not {"foreach", "fused", "differentiable"} & inp.kwargs.keys()


@optims("test_errors")
def test_errors(info, device):
    for error in info.optim_error_inputs_func(device=device, dtype=torch.float32):
        inp = error.optimizer_error_input
        expect = (
            pytest.warns(error.error_type, match=error.error_regex)
            if issubclass(error.error_type, Warning)
            else pytest.raises(error.error_type, match=error.error_regex)
        )
        if error.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            with expect:
                info.optim_cls(inp.params, **inp.kwargs)
        else:
            opt = info.optim_cls(inp.params, **inp.kwargs)
            with expect:
                opt.step()


def _assert_goes_down(opt, schedulers, loss_fn, desc: str = "") -> None:
    """20 steps of ``opt`` (each scheduler stepped after each) lower ``loss_fn``."""
    scheds = [make(opt) for make in schedulers]
    initial = loss_fn().item()
    for _ in range(20):
        loss = _backward(opt, loss_fn)
        opt.step()
        for scheduler in scheds:
            _step_scheduler(scheduler, loss)
    assert loss_fn().item() < initial, desc


@pytest.mark.parametrize("with_lrsched", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
@optims("test_forloop_goes_right_direction")
def test_forloop_goes_right_direction(info, device, contiguous, with_lrsched):
    for schedulers in info.scheduler_inputs if with_lrsched else [[]]:
        for inp in info.optim_inputs_func(device=device):
            weight, bias, loss_fn = _linear(device, contiguous=contiguous)
            opt = info.optim_cls([weight, bias], **inp.kwargs, foreach=False)
            _assert_goes_down(opt, schedulers, loss_fn, inp.desc)


@optims("test_param_group_with_lrscheduler_goes_right_direction")
def test_param_group_with_lrscheduler_goes_right_direction(info, device):
    for schedulers in info.scheduler_inputs:
        weight, bias, loss_fn = _linear(device)
        opt = info.optim_cls([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
        _assert_goes_down(opt, schedulers, loss_fn)


@optims("test_tensor_lr")
def test_tensor_lr(info, device):
    """A 0-dim tensor lr steps as the same Python float (torch's test only builds the
    optimizers; this one also steps both, 5 times, and compares bit for bit)."""
    for inp in _all_inputs(info, device):
        weight, bias, loss_fn = _linear(device)
        weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
        x = torch.randn(5, device=device)
        kwargs = {k: v for k, v in inp.kwargs.items() if k != "lr"}
        opt = info.optim_cls([weight, bias], lr=1e-3, **kwargs)
        opt_c = info.optim_cls([weight_c, bias_c], lr=torch.tensor(1e-3), **kwargs)
        for _ in range(5):
            for o, w, b in ((opt, weight, bias), (opt_c, weight_c, bias_c)):
                _backward(o, lambda w=w, b=b, x=x: (w.mv(x) + b).pow(2).sum())
                o.step()
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c), inp.desc


def _rosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def _rosenbrock_grad(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return torch.stack((-400 * x * (y - x**2) - 2 * (1 - x), 200 * (y - x**2)))


@pytest.mark.parametrize("with_lrsched", [True, False])
@optims("test_rosenbrock_sparse", infos=[i for i in OPTIM_DB if i.supports_sparse])
def test_rosenbrock_sparse(info, device, with_lrsched):
    """Cyclic coordinate descent on Rosenbrock's function, the gradient of one coordinate a
    step given as an uncoalesced sparse tensor (the value split over a duplicated index) and,
    to a twin optimizer, as the dense tensor with a zero: both must take the same steps and
    end no farther from the minimum (float64)."""
    kwarg_updates, schedulers = info.metadata_for_sparse
    dtype = torch.float64
    seen = set()
    # The loop only: sparse gradients always take the reference loop (``_apply_sparse``), and
    # the dense twin's foreach path is the loop's bits (test_foreach_matches_forloop).
    for inp in info.optim_inputs_func(device=device):
        kwargs = {**inp.kwargs, **kwarg_updates}
        key = tuple(sorted(kwargs.items(), key=str))
        if key in seen:  # configurations that differ only in what was replaced: one run
            continue
        seen.add(key)
        param = Parameter(torch.tensor([1.5, 1.5], dtype=dtype, device=device))
        twin = Parameter(param.detach().clone())
        opt, opt_c = info.optim_cls([param], **kwargs), info.optim_cls([twin], **kwargs)
        scheds = [make(o) for make in (schedulers if with_lrsched else []) for o in (opt, opt_c)]
        solution = torch.tensor([1.0, 1.0], dtype=dtype, device=device)
        initial = param.detach().dist(solution)
        index = [torch.tensor([[c, c]], device=device) for c in (0, 1)]
        for i in range(1800):
            coord = i % 2
            g = _rosenbrock_grad(param.detach())[coord]
            split = [g / 4, g - g / 4] if coord else [g - g / 4, g / 4]
            param.grad = torch.sparse_coo_tensor(index[coord], torch.stack(split), (2,))
            twin.grad = torch.zeros(2, dtype=dtype, device=device)
            twin.grad[coord] = _rosenbrock_grad(twin.detach())[coord]
            opt.step()
            opt_c.step()
            for scheduler in scheds:
                _step_scheduler(scheduler, _rosenbrock(param.detach()))
            # the dense twin's value is not split and summed again: a few ulps apart
            torch.testing.assert_close(param, twin, atol=5e-6, rtol=5e-6)
        assert param.detach().dist(solution) <= initial, inp.desc


# -- derived implementations against the loop


_DERIVED_STEPS = 7


def _derived_run(info, device, dtype, kwargs):
    """torch's ``_test_derived_optimizers`` problem: Linear(2,3) - Sigmoid - Linear(3,1) -
    Sigmoid and a 0-dim parameter, 7 steps, the last layer frozen at steps 3-4 and no
    backward at step 2 (gradients None); the parameters and state after every step."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid()
    ).to(device=device, dtype=dtype)
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype, device=device).reshape(3, 2)
    scalar = torch.empty((), device=device, dtype=dtype, requires_grad=True)
    scalar.grad = torch.rand_like(scalar)
    params = list(model.parameters()) + [scalar]
    opt = info.optim_cls(params, **kwargs)
    history = []
    for i in range(_DERIVED_STEPS):
        opt.zero_grad()
        if i == 3:
            model[2].requires_grad_(False)
        if i == 5:
            model[2].requires_grad_(True)
        if i != 2:
            model(x).sum().backward()
        opt.step()
        snapshot = []
        for p in model.parameters():
            snapshot.append(p.detach().clone())
            state = opt.state.get(p, {})
            snapshot += [state[k].clone() for k in sorted(state)]
        history.append(snapshot)
    return history


def _compare_derived(
    info, device, dtype, flag: str, assert_equal: Callable, first_only: bool = False
) -> None:
    inputs = info.optim_inputs_func(device=device)
    for inp in inputs[:1] if first_only else inputs:
        ref = _derived_run(info, device, dtype, {**inp.kwargs, "foreach": False})
        got = _derived_run(info, device, dtype, {**inp.kwargs, flag: True})
        for step, (r, g) in enumerate(zip(ref, got)):
            assert len(r) == len(g), f"{inp.desc} step {step}: another state layout"
            for a, b in zip(r, g):
                assert_equal(b, a, f"{inp.desc} step {step}")


@optims("test_foreach_matches_forloop")
def test_foreach_matches_forloop(info, device):
    def equal(got, want, where):
        torch.testing.assert_close(got, want, msg=lambda m: f"{where}: {m}")

    _compare_derived(info, device, torch.float64, "foreach", equal)


@CUDA
@optims("test_set_default_dtype_works_with_foreach", devices=["cuda"])
def test_set_default_dtype_works_with_foreach(info, device):
    old = torch.get_default_dtype()
    for default in (torch.float64, torch.float16):
        try:
            torch.set_default_dtype(default)
            tol = {} if default == torch.float64 else {"atol": 1e-5, "rtol": 1e-4}

            def equal(got, want, where, tol=tol):
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{where}: {m}")

            _compare_derived(info, device, torch.float64, "foreach", equal)
        finally:
            torch.set_default_dtype(old)


@CUDA
@optims("test_cpu_load_state_dict", devices=["cuda"])
def test_cpu_load_state_dict(info, device):
    """A state dict saved on the CPU with fused=True in its group loads into a fused CUDA
    optimizer and steps (torch's "capturable" variant: gradfleet accepts capturable either
    way and stores nothing for it)."""
    for inp in info.optim_inputs_func(device="cpu"):
        param = torch.tensor([0.1, 0.2])
        opt = info.optim_cls([param], **inp.kwargs)
        param.grad = torch.rand_like(param)
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
        saved["param_groups"][0]["fused"] = True
        param_cuda = param.detach().clone().to(device)
        opt_cuda = info.optim_cls([param_cuda], **inp.kwargs, fused=True)
        opt_cuda.load_state_dict(saved)
        param_cuda.grad = torch.rand_like(param_cuda)
        opt_cuda.step()


# Fused against the loop in float16/bfloat16 (float32/float64: see SKIPS): every intermediate
# is rounded to the dtype as the loop rounds it, so the loop's bits, except where the maths
# sums a whole tensor (NormalizedSGD's norm), which the kernel sums in another order: see
# _half_norm_bound.  The first configuration only: each is a compile per dtype and parameter
# set (the foreach runs cover the others through the same maths, tests/kernels/test_fast_paths.py).


def _half_norm_bound(got, want, dtype, lr, where) -> None:
    """NormalizedSGD: its float32 sum of squares, taken in another order, is rounded to the
    dtype as the loop's or one ulp away, so each step's update (|update| <= lr) may differ by
    eps x lr and the stored weight by one more rounding, eps x |w|: over the steps,
    |fused - loop| <= steps x eps x (|w| + lr)."""
    eps = torch.finfo(dtype).eps
    got, want = got.float(), want.float()
    bound = _DERIVED_STEPS * eps * (want.abs() + lr)
    assert bool(((got - want).abs() <= bound).all()), where


_HALF_SUMS = {gf.NormalizedSGD}


@pytest.mark.compile
@optims(
    "test_fused_matches_forloop",
    dtypes=[torch.float64, torch.float32, torch.bfloat16, torch.float16],
)
def test_fused_matches_forloop(info, device, dtype):
    assert dtype in (torch.float16, torch.bfloat16), "float32/float64 are skipped (SKIPS)"

    def equal(got, want, where):
        if info.optim_cls in _HALF_SUMS:
            lr = info.optim_inputs_func(device=device)[0].kwargs["lr"]
            _half_norm_bound(got, want, dtype, lr, where)
        else:  # bit for bit (float16 Adam overflows to inf and nan: equal there too)
            torch.testing.assert_close(
                got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}"
            )

    _compare_derived(info, device, dtype, "fused", equal, first_only=True)


@pytest.mark.compile
@optims("test_fused_error_on_params_on_meta")
def test_fused_error_on_params_on_meta(info, device):
    """Parameters on the meta device (no data) cannot step fused: a clear error that changes
    nothing.  Once the model is materialised on ``device``, the same optimizer steps as one
    built on the materialised parameters (torch's test materialises them into new Parameter
    objects, so its optimizer's last step has nothing to do; here they are swapped in place,
    and the step is compared).  torch's model, in float16 (torch: float32) with the first
    configuration: the kernel test_fused_matches_forloop compiles (inductor's cache serves it).
    """
    dtype = torch.float16
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid()
        ).to(dtype)
    kwargs = {**info.optim_inputs_func(device=device)[0].kwargs, "fused": True}
    opt = info.optim_cls(model.parameters(), **kwargs)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="meta device"):
        opt.step()
    assert not opt.state
    opt.zero_grad(set_to_none=True)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    torch.manual_seed(0)
    for layer in model:
        if hasattr(layer, "reset_parameters"):  # to_empty leaves whatever the memory held
            layer.reset_parameters()
    params = list(model.parameters())
    twins = [Parameter(p.detach().clone()) for p in params]
    for p, twin in zip(params, twins):
        p.grad = torch.rand_like(p)
        twin.grad = p.grad.clone()
    fresh = info.optim_cls(twins, **kwargs)
    opt.step()
    fresh.step()
    for p, twin in zip(params, twins):
        assert p.device == twin.device and torch.equal(p, twin)
        assert opt.state[p].keys() == fresh.state[twin].keys()
        for name, value in fresh.state[twin].items():
            assert torch.equal(opt.state[p][name], value), name
    for group, other in zip(opt.param_groups, fresh.param_groups):
        _assert_state_dicts_equal(group["non_slot"], other["non_slot"])


# -- param groups


def _decays_without_gradient(kwargs: dict) -> bool:
    """Proximal and FTRL regularisation shrink the weights whatever the gradient, as torch's
    weight_decay does (torch's zero-gradient test leaves those configurations out)."""
    keys = ("l1_regularization_strength", "l2_regularization_strength")
    return any(kwargs.get(k, 0) for k in (*keys, "l2_shrinkage_regularization_strength"))


@optims("test_param_groups_weight_decay")
def test_param_groups_weight_decay(info, device):
    """torch's test gives the second group weight_decay=0; gradfleet accepts torch's
    weight_decay only at 0 (TF1's maths has none), so both groups get that value and a
    non-zero one is refused in a group as in the constructor."""
    for inp in _all_inputs(info, device):
        weight, bias, loss_fn = _linear(device)
        opt = info.optim_cls(
            [
                dict(params=[weight], **inp.kwargs),
                dict(params=[bias], **inp.kwargs, weight_decay=0.0),
            ]
        )
        initial = loss_fn().item()
        for _ in range(20):
            loss = _backward(opt, loss_fn)
            opt.step()
        assert loss.item() < initial, inp.desc
        with pytest.raises(TypeError, match="weight_decay"):
            opt.add_param_group({"params": [Parameter(torch.zeros(1))], "weight_decay": 0.1})


@optims("test_param_groups_lr")
def test_param_groups_lr(info, device):
    """The group's lr is used, not the constructor's (1e-28): the first group descends, the
    second (at 1e-28) does not move."""
    for inp in _all_inputs(info, device):
        kwargs = dict(inp.kwargs)
        if not kwargs.get("lr"):
            kwargs["lr"] = 1e-3
        weight, bias, loss_fn = _linear(device)
        irrelevant = Parameter(torch.randn(2, device=device))
        before = irrelevant.detach().clone()
        opt = info.optim_cls(
            [dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])],
            **{**_required(info.optim_cls), "lr": 1e-28},
        )
        initial = loss_fn().item()
        for _ in range(20):
            loss = _backward(opt, loss_fn)
            irrelevant.grad = torch.rand_like(irrelevant)
            opt.step()
        assert loss.item() < initial, inp.desc
        torch.testing.assert_close(irrelevant.detach(), before)


# -- steps that change nothing


@optims("test_step_is_noop_when_params_have_no_grad")
def test_step_is_noop_when_params_have_no_grad(info, device):
    """No parameter has a gradient: the step returns the closure's loss and changes nothing
    (torch's test only steps; this one also compares the parameters and the state)."""
    params = [torch.randn(2, 3, device=device) for _ in range(2)]
    before = [p.clone() for p in params]
    for inp in _all_inputs(info, device, impls=("foreach", "fused")):
        opt = info.optim_cls(params, **inp.kwargs)
        loss = torch.tensor([1.0], device=device)
        assert opt.step(lambda loss=loss: loss) is loss
        assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state


@optims("test_step_is_noop_for_zero_grads")
def test_step_is_noop_for_zero_grads(info, device):
    param = torch.randn(5, 1, device=device, requires_grad=True)
    before = param.detach().clone()
    for inp in _all_inputs(info, device):
        if _decays_without_gradient(inp.kwargs):
            continue
        opt = info.optim_cls([param], **inp.kwargs)
        param.grad = torch.zeros_like(param)
        opt.step(lambda: torch.tensor([1.0], device=device))
        torch.testing.assert_close(param.detach(), before, msg=lambda m, d=inp.desc: f"{d}: {m}")


@optims("test_optimizer_can_be_printed")
def test_optimizer_can_be_printed(info, device):
    params = [Parameter(torch.randn(2, 3, device=device)) for _ in range(2)]
    for inp in _all_inputs(info, device, impls=("foreach", "fused")):
        text = repr(info.optim_cls(params, **inp.kwargs))
        assert text.startswith(info.name) and "Parameter Group 0" in text


# -- state dicts


def _named(params, named: bool):
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
@optims("test_state_dict_deterministic")
def test_state_dict_deterministic(info, device, named0, named1):
    weight = Parameter(torch.randn(2, 3, device=device))
    bias = Parameter(torch.randn(2, device=device))
    x = torch.randn(3, device=device)
    for inp in _all_inputs(info, device):
        opt = info.optim_cls(_named([weight, bias], named0), **inp.kwargs)

        def loss_fn(w=weight, b=bias):
            return (w.mv(x) + b).pow(2).sum()

        for _ in range(10):
            _backward(opt, loss_fn)
            opt.step()
        weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
        opt_c = info.optim_cls(_named([weight_c, bias_c], named1), **inp.kwargs)
        opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
        for _ in range(10):
            _backward(opt, loss_fn)
            _backward(opt_c, functools.partial(loss_fn, weight_c, bias_c))
            opt.step()
            opt_c.step()
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c), inp.desc
        _assert_state_dicts_equal(
            _without_param_names(opt.state_dict()), _without_param_names(opt_c.state_dict())
        )
        # a parameter list given twice is saved as the same indices
        opt_c.param_groups.extend(opt_c.param_groups)
        _assert_state_dicts_equal(
            _without_param_names(opt.state_dict())["param_groups"][-1],
            _without_param_names(opt_c.state_dict())["param_groups"][-1],
        )


def _conv_model(device):
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1)
    ).to(device)
    x = torch.rand(1, 4, 16, 16, device=device)
    return model, lambda: model(x).sum()


@optims("test_can_load_older_state_dict")
def test_can_load_older_state_dict(info, device):
    for inp in _all_inputs(info, device):
        model, loss_fn = _conv_model(device)
        opt = info.optim_cls(model.parameters(), **inp.kwargs)
        for _ in range(3):
            _backward(opt, loss_fn)
            opt.step()
        old = copy.deepcopy(opt.state_dict())
        for group in old["param_groups"]:
            for flag in info.not_og_supported_flags:
                group.pop(flag, None)
        opt.load_state_dict(old)
        _backward(opt, loss_fn)
        opt.step()


@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
@optims("test_can_load_from_to_named_state_dict")
def test_can_load_from_to_named_state_dict(info, device, named0, named1):
    for inp in _all_inputs(info, device):
        model, loss_fn = _conv_model(device)
        params = model.named_parameters() if named0 else model.parameters()
        opt = info.optim_cls(params, **inp.kwargs)
        for _ in range(3):
            _backward(opt, loss_fn)
            opt.step()
        saved = copy.deepcopy(opt.state_dict())
        params = model.named_parameters() if named1 else model.parameters()
        opt2 = info.optim_cls(params, **inp.kwargs)
        opt2.load_state_dict(saved)
        _backward(opt2, loss_fn)
        opt2.step()
        if named0 or named1:
            names = opt2.state_dict()["param_groups"][0]["param_names"]
            assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.mark.parametrize("named", [True, False])
@optims("test_save_load_equality_with_weights_only")
def test_save_load_equality_with_weights_only(info, device, named):
    weight = Parameter(torch.randn(2, 3, device=device))
    bias = Parameter(torch.randn(2, device=device))
    x = torch.randn(3, device=device)
    for inp in _all_inputs(info, device):
        opt = info.optim_cls(_named([weight, bias], named), **inp.kwargs)
        for _ in range(3):
            opt.step(functools.partial(_backward, opt, lambda: (weight.mv(x) + bias).pow(2).sum()))
        saved = opt.state_dict()
        with tempfile.TemporaryFile() as f:
            torch.save(saved, f)
            f.seek(0)
            _assert_state_dicts_equal(torch.load(f, weights_only=False), saved)
            f.seek(0)
            _assert_state_dicts_equal(torch.load(f, weights_only=True), saved)


def _stepped_three_times(info, device):
    """Each input's optimizer over two parameters with random gradients, after 3 steps."""
    params = [Parameter(torch.randn(2, 3, device=device)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for inp in _all_inputs(info, device):
        opt = info.optim_cls(params, **inp.kwargs)
        for _ in range(3):
            opt.step()
        yield inp, opt


@optims("test_load_nontensor_step")
def test_load_nontensor_step(info, device):
    """torch's test turns a tensor ``state["step"]`` into a number before loading.  gradfleet
    keeps no per-parameter step (TF's counters are per group: ``non_slot``), so its state dict
    loads as saved and steps."""
    for _, opt in _stepped_three_times(info, device):
        saved = copy.deepcopy(opt.state_dict())
        for entry in saved["state"].values():
            assert "step" not in entry
            if torch.is_tensor(entry.get("step")):
                entry["step"] = entry["step"].item()
        opt.load_state_dict(saved)
        opt.step()


@CUDA
@optims("test_state_dict_with_cuda_params", devices=["cuda"])
def test_state_dict_with_cuda_params(info, device):
    for inp in _all_inputs(info, "cpu"):
        params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = info.optim_cls(params, **inp.kwargs)
        for _ in range(3):
            opt.step()
        with torch.no_grad():
            params_cuda = [Parameter(p.to(device)) for p in params]
        for p, p_cuda in zip(params, params_cuda):
            p_cuda.grad = p.grad.to(device)
        opt_cuda = info.optim_cls(params_cuda, **inp.kwargs)
        saved = copy.deepcopy(opt.state_dict())
        given = copy.deepcopy(opt.state_dict())
        opt_cuda.load_state_dict(given)
        _assert_state_dicts_equal(given, saved)  # loading leaves the given dict alone
        for _ in range(5):
            opt.step()
            opt_cuda.step()
            for p, p_cuda in zip(params, params_cuda):
                torch.testing.assert_close(p_cuda.cpu(), p, msg=lambda m, d=inp.desc: f"{d}: {m}")
            mine, theirs = opt.state_dict(), opt_cuda.state_dict()
            for key, entry in mine["state"].items():
                for slot, value in entry.items():
                    torch.testing.assert_close(theirs["state"][key][slot].cpu(), value)


# -- state dict hooks


def _set_test_entry(opt) -> None:
    opt.state["test"] = 1


def _pop_test_entry(opt, state_dict):
    ran = "test" in state_dict["state"]
    state_dict["state"].pop("test", None)
    state_dict["ran_state_dict_pre_hook"] = ran
    return state_dict


def _lr_002(opt, state_dict) -> None:
    state_dict["param_groups"][0]["lr"] = 0.002


def _lr_003_copy(opt, state_dict):
    out = copy.deepcopy(state_dict)
    out["param_groups"][0]["lr"] = 0.003
    return out


def _record_load(opt) -> None:
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


def _one_param_optimizers(info, device):
    for inp in _all_inputs(info, device):
        param = torch.rand(2, 3, device=device, requires_grad=True)
        yield info.optim_cls([param], **inp.kwargs)


@optims("test_state_dict_pre_hook")
def test_state_dict_pre_hook(info, device):
    for opt in _one_param_optimizers(info, device):
        opt.register_state_dict_pre_hook(_set_test_entry)
        assert opt.state_dict()["state"]["test"] == 1


@optims("test_state_dict_post_hook")
def test_state_dict_post_hook(info, device):
    for opt in _one_param_optimizers(info, device):
        opt.register_state_dict_post_hook(_pop_test_entry)
        assert opt.state_dict()["ran_state_dict_pre_hook"] is False


@optims("test_state_dict_pre_post_hook")
def test_state_dict_pre_post_hook(info, device):
    for opt in _one_param_optimizers(info, device):
        opt.register_state_dict_pre_hook(_set_test_entry)
        opt.register_state_dict_post_hook(_pop_test_entry)
        state_dict = opt.state_dict()
        assert "test" not in state_dict["state"] and state_dict["ran_state_dict_pre_hook"]


@optims("test_load_state_dict_pre_hook_and_prepend")
def test_load_state_dict_pre_hook_and_prepend(info, device):
    for opt in _one_param_optimizers(info, device):
        state_dict = opt.state_dict()
        opt.register_load_state_dict_pre_hook(_lr_002)
        opt.load_state_dict(state_dict)
        assert opt.param_groups[0]["lr"] == 0.002
        # prepended, the copying hook runs first and the in-place one edits its copy
        opt.register_load_state_dict_pre_hook(_lr_003_copy, prepend=True)
        opt.load_state_dict(state_dict)
        assert opt.param_groups[0]["lr"] == 0.002


@optims("test_load_state_dict_post_hook")
def test_load_state_dict_post_hook(info, device):
    for opt in _one_param_optimizers(info, device):
        opt.register_load_state_dict_post_hook(_record_load)
        opt.load_state_dict(opt.state_dict())
        assert opt.state["ran_load_state_dict_pre_hook2"] is False
        assert opt.state["ran_load_state_dict_post_hook"] is True


@optims("test_load_state_dict_pre_post_hook")
def test_load_state_dict_pre_post_hook(info, device):
    for opt in _one_param_optimizers(info, device):
        opt.register_load_state_dict_pre_hook(_lr_003_copy)
        opt.register_load_state_dict_post_hook(_record_load)
        opt.load_state_dict(opt.state_dict())
        assert opt.state["ran_load_state_dict_pre_hook2"] is True
        assert opt.state["ran_load_state_dict_post_hook"] is True


# -- step hooks


def _record(calls: list, opt, args, kwargs) -> None:
    calls.append(opt)


def _note(order: list, what: str, *hook_args) -> None:
    order.append(what)


def _hook_optimizers(info, device):
    params = [torch.tensor([1.0, 1.0], device=device)]
    for inp in _all_inputs(info, device, impls=("foreach", "fused")):
        yield info.optim_cls(params, **inp.kwargs)


def _check_step_hook(info, device, register: str) -> None:
    """A hook registered with ``opt.<register>`` runs once per step until removed."""
    for opt in _hook_optimizers(info, device):
        calls = []
        handle = getattr(opt, register)(functools.partial(_record, calls))
        opt.step()
        opt.step()
        assert calls == [opt, opt]
        handle.remove()
        opt.step()
        assert len(calls) == 2


@optims("test_step_post_hook")
def test_step_post_hook(info, device):
    _check_step_hook(info, device, "register_step_post_hook")


@optims("test_step_pre_hook")
def test_step_pre_hook(info, device):
    _check_step_hook(info, device, "register_step_pre_hook")


@optims("test_step_all_hooks")
def test_step_all_hooks(info, device):
    """Global pre hooks, then the optimizer's pre hooks, the step, its post hooks, global
    post hooks; for a torch SGD beside it alike."""
    for opt in _hook_optimizers(info, device):
        sgd = torch.optim.SGD([torch.tensor([1.0, 1.0], device=device)])
        order = []
        handles = [
            register_optimizer_step_pre_hook(functools.partial(_note, order, "global pre")),
            register_optimizer_step_post_hook(functools.partial(_note, order, "global post")),
        ]
        for o in (opt, sgd):
            handles.append(o.register_step_pre_hook(functools.partial(_note, order, "pre")))
            handles.append(o.register_step_post_hook(functools.partial(_note, order, "post")))
        one = ["global pre", "pre", "post", "global post"]
        try:
            opt.step()
            assert order == one
            sgd.step()
            opt.step()
            assert order == one * 3
        finally:
            for handle in handles:
                handle.remove()
        opt.step()
        sgd.step()
        assert order == one * 3


# -- copies and state


def _public(obj) -> set[str]:
    return {k for k in obj.__dict__ if not k.startswith("_")}


@optims("test_deepcopy_copies_all_public_attrs")
def test_deepcopy_copies_all_public_attrs(info, device):
    for inp, opt in _stepped_three_times(info, device):
        assert _public(copy.deepcopy(opt)) == _public(opt), inp.desc


@optims("test_non_empty_state")
def test_non_empty_state(info, device):
    """After a step, no parameter has an empty state entry (a slot-free optimizer, as torch's
    SGD without momentum, keeps none)."""
    model = torch.nn.Linear(5, 5).to(device)
    x = torch.rand(2, 5, device=device)
    for inp in info.optim_inputs_func(device=device):
        opt = info.optim_cls(model.parameters(), **inp.kwargs)
        _backward(opt, lambda: model(x).sum())
        opt.step()
        assert all(len(state) > 0 for state in opt.state.values()), inp.desc
        assert all(opt.state_dict()["state"].values()), inp.desc


@CUDA
@optims(
    "test_fused_cpu_matches_cuda",
    devices=["cuda"],
    dtypes=[torch.float64, torch.float32, torch.bfloat16, torch.float16],
)
def test_fused_cpu_matches_cuda(info, device, dtype):
    inp = info.optim_inputs_func(device="cpu")[0]
    kwargs = {**inp.kwargs, "fused": True}
    cpu = _derived_run(info, "cpu", dtype, kwargs)
    cuda = _derived_run(info, device, dtype, kwargs)
    for step, (a, b) in enumerate(zip(cpu, cuda)):
        for x, y in zip(a, b):
            torch.testing.assert_close(y.cpu(), x, msg=lambda m, s=step: f"step {s}: {m}")
