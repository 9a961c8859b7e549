"""Move a TensorFlow 1 or RETURNN training to PyTorch mid-run, and back.

:func:`load_tf_checkpoint` reads a TF checkpoint (TF1 ``Saver`` V2 files, or TF2
``tf.train.Checkpoint`` files of ``tf.compat.v1`` optimizers, see :mod:`.object_graph`) into a
torch model and a gradfleet optimizer: parameters, every slot under TF's names and the
non-slot variables, and the EASGD / model-averaging wrappers' own variables (see
:mod:`.wrapper_state`); :func:`save_tf_checkpoint` writes one that TF's ``Saver`` restores.
:func:`read_graph_hyperparameters` reads the optimizer's hyperparameters from the TF graph
next to a checkpoint (``PREFIX.meta``).
TensorFlow is needed only while reading or writing (``pip install 'gradfleet[tf]'``);
importing this module does not load it.
"""

from gradfleet.tf_checkpoint.bundle import CheckpointReader, TensorFlowMissing, write_checkpoint
from gradfleet.tf_checkpoint.convert import (
    CheckpointMismatch,
    GraphHyperparametersWarning,
    LoadedCheckpoint,
    load_tf_checkpoint,
)
from gradfleet.tf_checkpoint.graph_hyperparameters import (
    GraphHyperparameters,
    GraphMismatch,
    read_graph_hyperparameters,
)
from gradfleet.tf_checkpoint.names import IDENTITY, TRANSPOSE, NameMap, Transform
from gradfleet.tf_checkpoint.save import save_tf_checkpoint, tf_tensors
from gradfleet.tf_checkpoint.slot_names import NON_SLOT_NAMES, SLOT_ORDER, slot_suffixes

__all__ = [
    "IDENTITY",
    "NON_SLOT_NAMES",
    "SLOT_ORDER",
    "TRANSPOSE",
    "CheckpointMismatch",
    "CheckpointReader",
    "GraphHyperparameters",
    "GraphHyperparametersWarning",
    "GraphMismatch",
    "LoadedCheckpoint",
    "NameMap",
    "TensorFlowMissing",
    "Transform",
    "load_tf_checkpoint",
    "read_graph_hyperparameters",
    "save_tf_checkpoint",
    "slot_suffixes",
    "tf_tensors",
    "write_checkpoint",
]
