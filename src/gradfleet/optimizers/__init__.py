"""One module per algorithm; ``ALL`` lists every public optimizer class."""

from gradfleet.optimizer import Optimizer
from gradfleet.optimizers.adam import AdamOptimizer
from gradfleet.optimizers.gradient_descent import GradientDescentOptimizer
from gradfleet.optimizers.momentum import MomentumOptimizer

ALL = [
    AdamOptimizer,
    GradientDescentOptimizer,
    MomentumOptimizer,
]

__all__ = ["ALL", "Optimizer"] + [cls.__name__ for cls in ALL]
