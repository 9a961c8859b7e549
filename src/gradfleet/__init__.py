"""gradfleet: TensorFlow/RETURNN-exact optimizers and distributed optimizer wrappers for PyTorch."""

from gradfleet.optimizer import HyperparametersReplacedWarning, Optimizer, RowwiseOptimizer
from gradfleet.optimizers import *  # noqa: F403 - the catalog is the public API
from gradfleet.optimizers import __all__ as _optimizer_names
from gradfleet.registry import create_optimizer, get_optimizer_class, optimizer_names

__version__ = "0.1.0"
__all__ = [
    "HyperparametersReplacedWarning",
    "Optimizer",
    "RowwiseOptimizer",
    "create_optimizer",
    "get_optimizer_class",
    "optimizer_names",
    *_optimizer_names,
]
