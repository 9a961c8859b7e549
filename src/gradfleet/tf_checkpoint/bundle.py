"""TensorFlow's checkpoint files (Saver V2 "tensor bundle": ``PREFIX.index`` +
``PREFIX.data-*``) read and written through TensorFlow itself, loaded on first use.

Reading uses ``tf.train.load_checkpoint`` (TF's own ``CheckpointReader``), so every file TF
writes (TF1 ``Saver``, TF2 ``tf.train.Checkpoint``) is read as TF reads it.  Writing runs
TF's ``SaveV2`` op, the op ``Saver.save`` runs, with the tensors fed through placeholders
(no 2 GiB graph-constant limit), and writes the ``checkpoint`` state file next to it, so
``tf.train.latest_checkpoint`` and ``Saver.restore`` find the result.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

Progress = Callable[[int, int], None]

#: The serialized object graph a TF2 ``tf.train.Checkpoint`` stores next to the variables.
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"

log = logging.getLogger(__name__)


class TensorFlowMissing(ImportError):
    """TensorFlow is needed to read or write TF checkpoints and is not installed."""


def import_tensorflow() -> Any:
    """TensorFlow, or one clear ``TensorFlowMissing`` naming the extra that installs it."""
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise TensorFlowMissing(
            "reading or writing TensorFlow checkpoints needs TensorFlow: "
            "pip install 'gradfleet[tf]' (or tensorflow-cpu)"
        ) from exc
    return tf


#: Environment that keeps TensorFlow's C++ side quiet when it is first imported: INFO and
#: WARNING lines off, and oneDNN's kernels off, whose "oneDNN custom operations are on" line
#: ignores the log level.  Reading and writing checkpoints runs no maths oneDNN would speed up.
QUIET_TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


@contextlib.contextmanager
def quiet_tensorflow() -> Iterator[None]:
    """TensorFlow's own logging quiet inside the block, for a conversion whose output is one
    line: :data:`QUIET_TF_ENV` (where the caller has not set those variables) while TF is
    first imported, and the ``tensorflow`` and ``absl`` Python loggers at ERROR.  Both are
    restored afterwards; TF's C++ side keeps what it read at import for the process's life,
    so a process that imported TF before the block is left as it was."""
    added = []
    if "tensorflow" not in sys.modules:
        for key, value in QUIET_TF_ENV.items():
            if key not in os.environ:
                os.environ[key] = value
                added.append(key)
    loggers = [logging.getLogger(name) for name in ("tensorflow", "absl")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        for key in added:
            os.environ.pop(key, None)


_NO_CHECKPOINT_IN_DIRECTORY = "no TensorFlow checkpoint in directory {!r}"
_NO_CHECKPOINT_AT = "no TensorFlow checkpoint at {0!r} (expected {0}.index and {0}.data-*)"


def check_checkpoint_path(prefix: str | os.PathLike) -> None:
    """``FileNotFoundError`` where no checkpoint can be, found from the files alone, without
    importing TensorFlow (seconds): a directory needs TF's ``checkpoint`` state file (which
    names its latest checkpoint), a prefix its ``PREFIX.index``.  :class:`CheckpointReader`
    checks the rest."""
    prefix = os.fspath(prefix)
    if os.path.isdir(prefix):
        if not os.path.isfile(os.path.join(prefix, "checkpoint")):
            raise FileNotFoundError(_NO_CHECKPOINT_IN_DIRECTORY.format(prefix))
    elif not os.path.exists(prefix + ".index"):
        raise FileNotFoundError(_NO_CHECKPOINT_AT.format(prefix))


class CheckpointReader:
    """The variables of one checkpoint: ``shapes`` and ``dtypes`` by name (no tensor is read
    until ``get``), ``get(name)`` a numpy array.

    The names are the checkpoint's keys, or those of a :meth:`view` (TF1-style names for a
    TF2 object-based checkpoint, aliases for wrapper variables TF restores from others).
    A TF2 checkpoint's serialized object graph is not a variable: it is :meth:`object_graph`.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        tf = import_tensorflow()
        prefix = os.fspath(prefix)
        if os.path.isdir(prefix):  # a directory: its latest checkpoint, as TF resolves it
            latest = tf.train.latest_checkpoint(prefix)
            if latest is None:
                raise FileNotFoundError(_NO_CHECKPOINT_IN_DIRECTORY.format(prefix))
            log.info("%s: reading its latest checkpoint %s", prefix, latest)
            prefix = latest
        if not os.path.exists(prefix + ".index"):
            raise FileNotFoundError(_NO_CHECKPOINT_AT.format(prefix))
        self.prefix = prefix
        self._reader = tf.train.load_checkpoint(prefix)
        keys = self._reader.get_variable_to_shape_map()
        self._has_object_graph = OBJECT_GRAPH_KEY in keys
        self._keys: dict[str, str] = {k: k for k in keys if k != OBJECT_GRAPH_KEY}
        self._key_shapes: dict[str, tuple[int, ...]] = {k: tuple(v) for k, v in keys.items()}
        self._key_dtypes: dict[str, np.dtype] = {
            k: np.dtype(v.as_numpy_dtype)
            for k, v in self._reader.get_variable_to_dtype_map().items()
            if k != OBJECT_GRAPH_KEY
        }
        self._index()

    def _index(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {
            n: self._key_shapes[k] for n, k in self._keys.items()
        }
        self.dtypes: dict[str, np.dtype] = {n: self._key_dtypes[k] for n, k in self._keys.items()}

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def key(self, name: str) -> str:
        """The checkpoint key that ``name`` reads."""
        return self._keys[name]

    def get(self, name: str) -> np.ndarray:
        return np.asarray(self._reader.get_tensor(self._keys[name]))

    def view(self, keys: Mapping[str, str]) -> CheckpointReader:
        """The same checkpoint under other names: ``keys`` maps each name of the view to a
        name of this reader (several names may read the same variable)."""
        unknown = sorted(set(keys.values()) - set(self._keys))
        if unknown:
            raise KeyError(f"view of {self.prefix!r}: no variables {unknown}")
        out = copy.copy(self)
        out._keys = {n: self._keys[k] for n, k in keys.items()}
        out._index()
        return out

    def object_graph(self) -> Any:
        """The ``TrackableObjectGraph`` proto of a TF2 object-based checkpoint, else None."""
        if not self._has_object_graph:
            return None
        from tensorflow.core.protobuf import trackable_object_graph_pb2

        graph = trackable_object_graph_pb2.TrackableObjectGraph()
        graph.ParseFromString(self._reader.get_tensor(OBJECT_GRAPH_KEY))
        return graph


def write_checkpoint(
    prefix: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    progress: Progress | None = None,
) -> str:
    """Write ``tensors`` (TF name -> array) as a V2 checkpoint at ``prefix``; returns it.

    ``progress(done, total)`` is called as tensors are handed to TF (bytes, before the write).
    """
    tf = import_tensorflow()
    v1 = tf.compat.v1
    prefix = os.path.abspath(os.fspath(prefix))
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    names = sorted(tensors)
    arrays = [np.asarray(tensors[n], order="C") for n in names]  # keeps 0-d arrays 0-d
    graph = tf.Graph()
    with graph.as_default():
        holders = [v1.placeholder(tf.as_dtype(a.dtype), a.shape) for a in arrays]
        save = tf.raw_ops.SaveV2(
            prefix=prefix,
            tensor_names=names,
            shape_and_slices=[""] * len(names),
            tensors=holders,
        )
    total = sum(a.nbytes for a in arrays)
    log.info("writing %d tensors (%d bytes) to %s", len(names), total, prefix)
    done = 0
    feed = {}
    for holder, array in zip(holders, arrays):
        feed[holder] = array
        done += array.nbytes
        if progress is not None:
            progress(done, total)
    with v1.Session(graph=graph) as sess:
        sess.run(save, feed)
    v1.train.update_checkpoint_state(os.path.dirname(prefix), prefix)
    return prefix
