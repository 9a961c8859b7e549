"""TensorFlow's checkpoint files (Saver V2 "tensor bundle": ``PREFIX.index`` +
``PREFIX.data-*``) read and written through TensorFlow itself, loaded on first use.

Reading uses ``tf.train.load_checkpoint`` (TF's own ``CheckpointReader``), so every file TF
writes (TF1 ``Saver``, TF2 ``tf.train.Checkpoint``) is read as TF reads it.  Writing runs
TF's ``SaveV2`` op, the op ``Saver.save`` runs, with the tensors fed through placeholders
(no 2 GiB graph-constant limit), and writes the ``checkpoint`` state file next to it, so
``tf.train.latest_checkpoint`` and ``Saver.restore`` find the result.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

Progress = Callable[[int, int], None]


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


class CheckpointReader:
    """The variables of one checkpoint: ``shapes`` and ``dtypes`` by name (no tensor is read
    until ``get``), ``get(name)`` a numpy array."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        tf = import_tensorflow()
        prefix = os.fspath(prefix)
        if os.path.isdir(prefix):  # a directory: its latest checkpoint, as TF resolves it
            latest = tf.train.latest_checkpoint(prefix)
            if latest is None:
                raise FileNotFoundError(f"no TensorFlow checkpoint in directory {prefix!r}")
            prefix = latest
        if not os.path.exists(prefix + ".index"):
            raise FileNotFoundError(
                f"no TensorFlow checkpoint at {prefix!r} (expected {prefix}.index and "
                f"{prefix}.data-*)"
            )
        self.prefix = prefix
        self._reader = tf.train.load_checkpoint(prefix)
        self.shapes: dict[str, tuple[int, ...]] = {
            k: tuple(v) for k, v in self._reader.get_variable_to_shape_map().items()
        }
        self.dtypes: dict[str, np.dtype] = {
            k: np.dtype(v.as_numpy_dtype)
            for k, v in self._reader.get_variable_to_dtype_map().items()
        }

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def get(self, name: str) -> np.ndarray:
        return np.asarray(self._reader.get_tensor(name))


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
