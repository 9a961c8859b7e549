"""``ElasticAverageOptimizer``: Elastic Averaging SGD (TF ``contrib.opt``) and its centres.

* :mod:`.optimizer` -- the wrapper: elastic penalty, exchange schedule, checkpoints;
* :mod:`.centre` -- the centre strategy interface and :class:`AllReduceCentre` (synchronous);
* :mod:`.server.centre_server` -- the asynchronous centre's state machine (pure);
* :mod:`.async_centre` -- :class:`AsyncCentre`: that centre hosted on a server rank.

Layer: wrappers.
"""

from .async_centre import AsyncCentre
from .centre import CENTRE_MODES, AllReduceCentre, CentreStrategy
from .optimizer import ElasticAverageOptimizer

__all__ = [
    "CENTRE_MODES",
    "AllReduceCentre",
    "AsyncCentre",
    "CentreStrategy",
    "ElasticAverageOptimizer",
]
