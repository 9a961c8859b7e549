"""Wrapper state as TF saves it: a SyncReplicasOptimizer checkpoint holds the wrapped
optimizer's variables and ``global_step`` and nothing else (its ``sync_rep_local_step`` is
a local variable; accumulators and token queues are not variables), so it loads into the
wrapped gradfleet optimizer with nothing left over."""

from __future__ import annotations

import numpy as np
import pytest

import gradfleet as gf
from gradfleet.tf_checkpoint import load_tf_checkpoint, tf_tensors
from tests.tf_checkpoint import tf_run

pytest.importorskip("tensorflow")


def test_sync_replicas_checkpoint_is_the_chiefs_variables(tmp_path):
    rng = np.random.default_rng(3)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}

    def make(train, variables):
        return train.SyncReplicasOptimizer(train.AdamOptimizer(0.1), replicas_to_aggregate=2)

    run = tf_run.TFRun(make, init)
    try:
        with run.graph.as_default():
            local = {v.op.name for v in run.v1.local_variables()}
        assert local == {"sync_rep_local_step"}
        prefix = run.save(str(tmp_path / "model.ckpt"))
        values = run.values()
    finally:
        run.close()
    model = tf_run.Model()
    opt = gf.AdamOptimizer(model.parameters(), 0.1)
    loaded = load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP)
    assert loaded.global_step == 0
    assert sorted(loaded.used) == sorted(values)  # every saved variable was claimed
    mine = tf_tensors(model, opt, tf_run.NAME_MAP, global_step=0)
    assert sorted(mine) == sorted(values)
    assert all(np.array_equal(mine[k], values[k]) for k in values)
