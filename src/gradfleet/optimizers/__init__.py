"""One module per algorithm; ``ALL`` lists every public optimizer class."""

from gradfleet.optimizer import Optimizer
from gradfleet.optimizers.adadelta import AdadeltaOptimizer
from gradfleet.optimizers.adagrad import AdagradOptimizer
from gradfleet.optimizers.adagrad_da import AdagradDAOptimizer
from gradfleet.optimizers.adam import AdamOptimizer
from gradfleet.optimizers.amsgrad import AMSGradOptimizer
from gradfleet.optimizers.base_custom import BaseCustomOptimizer
from gradfleet.optimizers.custom_adam import CustomAdamOptimizer
from gradfleet.optimizers.custom_gradient_descent import CustomGradientDescentOptimizer
from gradfleet.optimizers.ftrl import FtrlOptimizer
from gradfleet.optimizers.grad_variance_scaled import GradVarianceScaledOptimizer
from gradfleet.optimizers.gradient_descent import GradientDescentOptimizer
from gradfleet.optimizers.momentum import MomentumOptimizer
from gradfleet.optimizers.neural_optimizer1 import NeuralOptimizer1
from gradfleet.optimizers.normalized_sgd import NormalizedSGD
from gradfleet.optimizers.proximal_adagrad import ProximalAdagradOptimizer
from gradfleet.optimizers.proximal_gradient_descent import ProximalGradientDescentOptimizer
from gradfleet.optimizers.rmsprop import RMSPropOptimizer

ALL = [
    AdadeltaOptimizer,
    AdagradOptimizer,
    AdagradDAOptimizer,
    AdamOptimizer,
    AMSGradOptimizer,
    BaseCustomOptimizer,
    CustomAdamOptimizer,
    CustomGradientDescentOptimizer,
    FtrlOptimizer,
    GradientDescentOptimizer,
    GradVarianceScaledOptimizer,
    MomentumOptimizer,
    NeuralOptimizer1,
    NormalizedSGD,
    ProximalAdagradOptimizer,
    ProximalGradientDescentOptimizer,
    RMSPropOptimizer,
]

__all__ = ["ALL", "Optimizer"] + [cls.__name__ for cls in ALL]
