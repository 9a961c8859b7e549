"""Wrapper state as TF saves it.

A SyncReplicasOptimizer checkpoint holds the wrapped optimizer's variables and ``global_step``
and nothing else (its ``sync_rep_local_step`` is a local variable; accumulators and token
queues are not variables), so it loads into the wrapped gradfleet optimizer with nothing left
over; gradfleet's SyncReplicasOptimizer starts from its ``global_step`` and continues beside
TF's restarted chief, and its chief's state goes back through TF's ``Saver``.  EASGD and model
averaging keep their centres under TF's names; TF's side of those tests is the wrappers'
update in TF ops (``tf_centre.py``), trained, saved, continued."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import gradfleet as gf
from gradfleet.distributed import (
    ElasticAverageOptimizer,
    ModelAverageOptimizer,
    SyncReplicasOptimizer,
)
from gradfleet.tf_checkpoint import (
    CheckpointMismatch,
    CheckpointReader,
    load_tf_checkpoint,
    save_tf_checkpoint,
    tf_tensors,
    write_checkpoint,
)
from tests.conformance.test_conformance import TOLERANCE
from tests.tf_checkpoint import tf_run
from tests.tf_checkpoint.tf_centre import GLOBAL, LOCAL, TFCentreRun

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


# SyncReplicas, one worker (R = N = 1): TF's chief runs its hook's init ops (local_step :=
# global_step, accumulators set to it, the initial token); the test runs the chief's sync op
# (its queue runner's op) once per update.  The queue runner's thread starts the next sync op
# at once, and TF's sparse Adam decays m and v before that op's gradient arrives, so what a
# chief reads or saves meanwhile holds the sparse slots one decay ahead: run one at a time, every
# state read is the state between two updates.  After every (re)start the first update is
# followed by TF's wasted round (the initial token carries the old step): KS + 1 steps reach
# global_step KS, and NS steps after a restart apply NS - 1 updates.
KS, NS = 4, 4


def _sync_tf(init):
    def make(train, variables):
        adam = train.AdamOptimizer(0.1)
        return train.SyncReplicasOptimizer(adam, replicas_to_aggregate=1, total_num_replicas=1)

    run = tf_run.TFRun(make, init)
    v1 = run.v1
    with run.graph.as_default():
        run.init_ops = [run.opt.chief_init_op, run.opt.get_init_tokens_op(num_tokens=-1)]
        (run.sync_op,) = run.opt.get_chief_queue_runner().enqueue_ops
        (run.local_step,) = v1.local_variables()
    return run


def _start_chief(run, prefix=None) -> None:
    """Start TF's chief: a new session restored from ``prefix`` (a restart) or TFRun's
    initialised one, then the chief's init ops (what its session hook runs)."""
    v1 = run.v1
    if prefix is not None:
        run.sess.close()
        run.sess = v1.Session(graph=run.graph)
        run.restore(prefix)
    with run.graph.as_default():
        run.sess.run(v1.local_variables_initializer())
    run.sess.run(run.init_ops)


def _tf_step_count(run) -> int:
    return int(run.sess.run(run.global_step))


def _tf_sync_step(run, grads) -> None:
    """One worker step (push, take a token) and, if its gradient is fresh (TF's rule: the
    worker's local_step is not behind the accumulators' step, here global_step), the chief's
    sync op that applies it and enqueues the next token."""
    fresh = run.sess.run(run.local_step) >= _tf_step_count(run)
    if not fresh:  # dropped; the token is already there
        run.step(grads)
        return
    worker = threading.Thread(target=run.step, args=(grads,), daemon=True)
    worker.start()  # blocks on the token unless the initial one is left
    timeout = run.v1.RunOptions(timeout_in_ms=30_000)
    run.sess.run(run.sync_op, options=timeout)
    worker.join(30)
    assert not worker.is_alive(), "TF's worker got no token"


def _sync_gradfleet(prefix):
    """A gradfleet chief restarted from ``prefix``: model and Adam loaded, then wrapped."""
    torch.manual_seed(0)  # any start: loading must overwrite all of it
    model = tf_run.Model()
    adam = gf.AdamOptimizer(model.parameters(), 0.1)
    loaded = load_tf_checkpoint(prefix, model, adam, tf_run.NAME_MAP)
    at = CheckpointReader(prefix)
    _assert_same(tf_tensors(model, adam, tf_run.NAME_MAP, global_step=loaded.global_step),
                 {n: at.get(n) for n in at.names()}, 0, 0, f"loaded {prefix}")  # fmt: skip
    opt = SyncReplicasOptimizer(
        adam, 1, 1, global_step=loaded.global_step, timeout=30, tokens="shared"
    )
    assert (opt.local_step, opt.global_step) == (loaded.global_step,) * 2
    return model, opt, loaded


def _continue_beside(run, model, opt, grads, where) -> None:
    """Both chiefs take the same worker steps; every variable agrees after each."""
    start = _tf_step_count(run)
    for i, g in enumerate(grads):
        _tf_sync_step(run, g)
        tf_run.set_gradients(model, g)
        opt.step()
        _assert_same(_state(model, opt), run.values(), RTOL, ATOL, f"{where}, step {i + 1}")
    assert opt.global_step == start + len(grads) - 1  # one wasted round


def test_sync_replicas_tf_to_gradfleet_and_back(tmp_path):
    rng = np.random.default_rng(5)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}
    grads = tf_run.gradients(rng, KS + 1 + 2 * NS)
    run = _sync_tf(init)
    opts = []
    try:
        _start_chief(run)
        for g in grads[: KS + 1]:
            _tf_sync_step(run, g)
        assert _tf_step_count(run) == KS
        a = run.save(str(tmp_path / "a" / "model.ckpt"))
        at_k = run.values()
        assert sorted(CheckpointReader(a).names()) == sorted(at_k)  # global variables only

        # TF -> gradfleet: loaded, wrapped at global_step KS, continued beside TF's restart.
        model, opt, loaded = _sync_gradfleet(a)
        opts.append(opt)
        assert loaded.global_step == KS and sorted(loaded.used) == sorted(at_k)
        _assert_same(_state(model, opt), at_k, 0, 0, "the wrapper's chief at the start")
        _start_chief(run, a)
        _continue_beside(run, model, opt, grads[KS + 1 : KS + 1 + NS], "continued from TF's")

        # gradfleet -> TF: the chief's state through TF's Saver, both continue from it.
        b = save_tf_checkpoint(tmp_path / "b" / "model.ckpt", model, opt, tf_run.NAME_MAP)
        written = _state(model, opt)
        assert written["global_step"] == KS + NS - 1
        _start_chief(run, b)
        _assert_same(run.values(), written, 0, 0, "TF restored gradfleet's")
        model_b, opt_b, _ = _sync_gradfleet(b)
        opts.append(opt_b)
        _continue_beside(run, model_b, opt_b, grads[KS + 1 + NS :], "continued from gradfleet's")
    finally:
        for o in opts:
            o.close()
        run.close()


# EASGD and model averaging, one worker: TF (the wrappers' update in TF ops, tf_centre.py)
# trains K steps; exchanges every PERIOD steps, so at K the worker is between two exchanges
# (parameters, centre and cached centre all differ) and local_step is not a multiple of PERIOD.
# A restarted worker continues R steps (a multiple of PERIOD: model averaging writes its
# parameters as the centre, which is TF's only right after a round).
K, N, R, PERIOD, ALPHA, RHO = 5, 3, 4, 2, 0.3, 0.5
RTOL, ATOL = TOLERANCE["float32"]


def _gradfleet(elastic: bool):
    torch.manual_seed(0)  # any start: loading must overwrite all of it
    model = tf_run.Model()
    inner = gf.AdamOptimizer(model.parameters(), 0.1)
    if elastic:
        opt = ElasticAverageOptimizer(
            inner, num_worker=1, communication_period=PERIOD, moving_rate=ALPHA, rho=RHO
        )
    else:
        opt = ModelAverageOptimizer(inner, num_worker=1, interval_steps=PERIOD)
    return model, opt


def _step(model, opt, grads) -> None:
    tf_run.set_gradients(model, grads)
    if isinstance(opt, ElasticAverageOptimizer):
        opt.add_elastic_penalty_()  # TF's compute_gradients adds the penalty's gradient
    opt.step()


def _state(model, opt) -> dict[str, np.ndarray]:
    return tf_tensors(model, opt, tf_run.NAME_MAP)


def _assert_same(got: dict, expected: dict, rtol: float, atol: float, where: str) -> None:
    assert sorted(got) == sorted(expected), where
    for name, value in expected.items():
        np.testing.assert_allclose(
            got[name], value, rtol=rtol, atol=atol, err_msg=f"{where}: {name}"
        )


@pytest.mark.parametrize("elastic", [True, False], ids=["ElasticAverage", "ModelAverage"])
def test_wrapper_state_tf_to_gradfleet_and_back(tmp_path, elastic):
    rng = np.random.default_rng(11 if elastic else 12)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}
    grads = tf_run.gradients(rng, K + max(N, R))
    run = TFCentreRun(elastic, init, PERIOD, ALPHA, RHO)
    try:
        for g in grads[:K]:
            run.step(g)
        at_k = run.values()
        full = run.save(str(tmp_path / "full" / "model.ckpt"))  # global and local variables
        chief = run.save_default(str(tmp_path / "chief" / "model.ckpt"))  # a default Saver

        # What TF's default Saver keeps: the centres and global_step; model averaging also
        # the wrapped optimizer's state (EASGD moved it to the local variables).
        centres = {f"{GLOBAL}/{n}" for n in tf_run.SHAPES}
        adam = {f"{n}/Adam{s}" for n in tf_run.SHAPES for s in ("", "_1")}
        adam |= {"beta1_power", "beta2_power"}
        kept = centres | {"global_step"} | (set() if elastic else adam)
        assert set(CheckpointReader(chief).names()) == kept

        # The whole worker: a copy, bit for bit, under the names TF gave every variable.
        model, opt = _gradfleet(elastic)
        assert load_tf_checkpoint(full, model, opt, tf_run.NAME_MAP).global_step == K // PERIOD
        assert (opt.local_step, opt.global_step) == (K, K // PERIOD)
        mine = _state(model, opt)
        if not elastic:
            # gradfleet keeps no global copy besides the parameters: it writes them as the
            # centre (TF's next round overwrites its centre before anything reads it).
            for n in tf_run.SHAPES:
                np.testing.assert_array_equal(mine[f"{GLOBAL}/{n}"], mine[n])
                assert not np.array_equal(at_k[f"{GLOBAL}/{n}"], at_k[n])
                mine[f"{GLOBAL}/{n}"] = at_k[f"{GLOBAL}/{n}"]
        _assert_same(mine, at_k, 0, 0, "loaded the full checkpoint")
        b = save_tf_checkpoint(tmp_path / "b" / "model.ckpt", model, opt, tf_run.NAME_MAP)
        written_centres = {k: v for k, v in _state(model, opt).items() if k.startswith(GLOBAL)}

        # The chief's checkpoint: a restarted worker (x := centre, local_step 0, EASGD's Adam
        # afresh), as TF restarts from it.
        model_r, opt_r = _gradfleet(elastic)
        assert load_tf_checkpoint(chief, model_r, opt_r, tf_run.NAME_MAP).global_step == 2
        assert (opt_r.local_step, opt_r.global_step) == (0, K // PERIOD)
        centre_k = {n: at_k[f"{GLOBAL}/{n}"] for n in tf_run.SHAPES}
        np.testing.assert_array_equal(
            model_r.dense.weight.detach().numpy().T, centre_k["dense/kernel"]
        )
        assert (not opt_r.state) == elastic  # Adam starts afresh only where TF kept it local

        for g in grads[K : K + N]:
            run.step(g)
            _step(model, opt, g)
        _assert_same(_state(model, opt), run.values(), RTOL, ATOL, "continued from the full one")
        continued = run.values()
        run.restart(chief)
        for g in grads[K : K + R]:
            run.step(g)
            _step(model_r, opt_r, g)
        _assert_same(_state(model_r, opt_r), run.values(), RTOL, ATOL, "restarted from the chief's")
        assert not np.allclose(run.values()["emb"], continued["emb"])  # two different states

        # gradfleet -> TF -> gradfleet: TF's full Saver restores what gradfleet wrote.
        run.restore(b)
        _assert_same(run.values(), {**at_k, **written_centres}, 0, 0, "TF restored it")
        for g in grads[K : K + N]:
            run.step(g)
        c = run.save(str(tmp_path / "c" / "model.ckpt"))
        model_c, opt_c = _gradfleet(elastic)
        load_tf_checkpoint(c, model_c, opt_c, tf_run.NAME_MAP)
        _assert_same(_state(model_c, opt_c), _state(model, opt), RTOL, ATOL, "back in gradfleet")
    finally:
        run.close()


def test_wrapper_needs_its_centres_and_its_global_step(tmp_path):
    model, opt = _gradfleet(elastic=True)
    # the wrapped optimizer's state only: a plain TF1 run's checkpoint
    plain = write_checkpoint(tmp_path / "plain", tf_tensors(model, opt.optimizer, tf_run.NAME_MAP))
    before = _state(model, opt)
    with pytest.raises(CheckpointMismatch) as info:
        load_tf_checkpoint(plain, model, opt, tf_run.NAME_MAP)
    pairs = [("dense.weight", "dense/kernel"), ("dense.bias", "dense/bias"), ("emb.weight", "emb")]
    expected = [f"{GLOBAL}/{tf} (for {name} centre)" for name, tf in pairs]
    expected += [f"{LOCAL}/{tf} (for {name} local centre)" for name, tf in pairs]
    assert sorted(info.value.problems["missing in the checkpoint"]) == sorted(expected)
    after = _state(model, opt)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing loaded
    load_tf_checkpoint(plain, model, opt.optimizer, tf_run.NAME_MAP)  # the wrapped one: fine
    with pytest.raises(ValueError, match="global_step=3 disagrees with the ElasticAverage"):
        save_tf_checkpoint(tmp_path / "x", model, opt, tf_run.NAME_MAP, global_step=3)
    assert not (tmp_path / "x.index").exists()


def test_sync_replicas_is_loaded_before_wrapping_and_saved_from_its_chief(tmp_path):
    model = tf_run.Model()
    adam = gf.AdamOptimizer(model.parameters(), 0.1)
    first, second = tf_run.gradients(np.random.default_rng(0), 2)
    tf_run.torch_step(model, adam, first)  # slots to write
    prefix = save_tf_checkpoint(tmp_path / "a" / "model.ckpt", model, adam, tf_run.NAME_MAP,
                                global_step=7)  # fmt: skip
    with SyncReplicasOptimizer(adam, 1, 1, global_step=7, server_rank=0) as opt:
        before = _state(model, opt)
        with pytest.raises(TypeError, match="load into the model and the optimizer to wrap"):
            load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP)
        with pytest.raises(ValueError, match="global_step=3 disagrees with the SyncReplicas"):
            tf_tensors(model, opt, tf_run.NAME_MAP, global_step=3)
        tf_run.set_gradients(model, second)
        opt.step()
        after = _state(model, opt)  # the chief's Adam state, not the worker's untouched copy
        assert after["global_step"] == 8 and before["global_step"] == 7
        assert not np.array_equal(after["emb/Adam"], before["emb/Adam"])
        assert not np.array_equal(after["beta1_power"], before["beta1_power"])
        worker_m = adam.get_slot(model.emb.weight, "m").numpy()
        np.testing.assert_array_equal(worker_m, before["emb/Adam"])  # the worker's copy: unused
