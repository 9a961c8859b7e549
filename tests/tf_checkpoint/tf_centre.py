"""TF's EASGD and model-averaging wrappers for one worker, written in TF ops from the spec.

``tf.contrib.opt`` is gone from TF 2, so the wrappers' update (reference
``distributed-semantics.md`` sections 2.3 and 3.4) is built here on ``tf.compat.v1`` variables
named exactly as TF's custom getters named them: the worker's ``<name>`` (a local variable),
``global_center_variable/<name>`` (global), EASGD's ``local_center_variable/<name>`` (local),
``local_step`` (int32, local) and the graph's ``global_step``.  The wrapped optimizer is TF's
own ``AdamOptimizer``; EASGD moves its variables to the local collection as TF r1.12+ did.

Per step, with ``g`` the fed gradient (EASGD adds the elastic penalty ``rho * (x - c_loc)``,
the gradient of TF's ``compute_gradients`` loss term)::

    x := Adam(x, g);  local_step += 1
    if local_step % period == 0:
        EASGD: c_loc := c;  d := x - c_loc;  x -= alpha * d;  c += alpha * d;  global_step += 1
        model averaging (one worker: the mean is x):  c := x;  global_step += 1;  x := c

``restart(prefix)`` is a restarted TF worker: every variable initialised, the default
``Saver`` (global variables) restored, then TF's init op ``x := c`` (and ``c_loc := c``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.tf_checkpoint.tf_run import SHAPES, TFRun

GLOBAL, LOCAL = "global_center_variable", "local_center_variable"


class TFCentreRun(TFRun):
    def __init__(
        self,
        elastic: bool,
        init: dict[str, np.ndarray],
        period: int,
        moving_rate: float = 0.0,
        rho: float = 0.0,
        learning_rate: float = 0.1,
    ) -> None:
        import tensorflow as tf

        v1 = tf.compat.v1
        self.tf, self.v1, self.elastic = tf, v1, elastic
        self.graph = tf.Graph()
        local = [v1.GraphKeys.LOCAL_VARIABLES]
        with self.graph.as_default():
            self.global_step = v1.Variable(0, dtype=tf.int64, name="global_step", trainable=False)
            self.vars = {n: v1.Variable(init[n], name=n, collections=local) for n in SHAPES}
            self.centre = {
                n: v1.Variable(init[n], name=f"{GLOBAL}/{n}", trainable=False) for n in SHAPES
            }
            self.local_centre = {
                n: v1.Variable(init[n], name=f"{LOCAL}/{n}", trainable=False, collections=local)
                for n in (SHAPES if elastic else ())
            }
            self.local_step = v1.Variable(
                0, dtype=tf.int32, name="local_step", trainable=False, collections=local
            )
            self.opt = v1.train.AdamOptimizer(learning_rate)
            pairs = self._pairs(rho)
            before = {v.op.name for v in v1.global_variables()}
            apply = self.opt.apply_gradients(pairs)
            if elastic:  # TF r1.12+: the wrapped optimizer's variables are the worker's own
                self._move_to_local({v.op.name for v in v1.global_variables()} - before)
            with tf.control_dependencies([apply]):
                step = self.local_step.assign_add(1)
            exchange = self._exchange if elastic else self._average
            self.train = tf.cond(
                tf.equal(tf.math.floormod(step, period), 0),
                lambda: exchange(moving_rate),
                tf.no_op,
            )
            self.init_op = tf.group(
                *[x.assign(self.centre[n]) for n, x in self.vars.items()],
                *[c.assign(self.centre[n]) for n, c in self.local_centre.items()],
            )
            self.everything = v1.global_variables() + v1.local_variables()
            self.saver = v1.train.Saver(var_list=self.everything)  # global + local
            self.default_saver = v1.train.Saver()  # global variables only: the chief's
            self.sess = v1.Session(graph=self.graph)
            self._initialise()

    def _initialise(self) -> None:
        self.sess.run(
            [self.v1.global_variables_initializer(), self.v1.local_variables_initializer()]
        )

    def _pairs(self, rho: float) -> list:
        tf, v1 = self.tf, self.v1
        self.feeds, pairs = {}, []
        for n, var in self.vars.items():
            if n == "emb":
                idx, rows = v1.placeholder(tf.int64, [None]), v1.placeholder(tf.float32, [None, 3])
                self.feeds[n] = (idx, rows)
                grad: Any = tf.IndexedSlices(rows, idx, tf.constant([5, 3], tf.int64))
            else:
                grad = self.feeds[n] = v1.placeholder(tf.float32, SHAPES[n])
            if self.elastic:  # the penalty's gradient is dense: so is the sum
                if n == "emb":
                    grad = tf.math.unsorted_segment_sum(rows, idx, 5)
                grad = grad + rho * (var - self.local_centre[n])
            pairs.append((grad, var))
        return pairs

    def _move_to_local(self, names: set[str]) -> None:
        v1 = self.v1
        kept = v1.get_collection_ref(v1.GraphKeys.GLOBAL_VARIABLES)
        moved = [v for v in kept if v.op.name in names]
        kept[:] = [v for v in kept if v.op.name not in names]
        for v in moved:
            v1.add_to_collection(v1.GraphKeys.LOCAL_VARIABLES, v)

    def _exchange(self, alpha: float):
        tf = self.tf
        read = [self.local_centre[n].assign(self.centre[n]) for n in SHAPES]
        updates = []
        with tf.control_dependencies(read):
            for n, x in self.vars.items():
                d = x.read_value() - self.local_centre[n].read_value()
                updates += [x.assign_sub(alpha * d), self.centre[n].assign_add(alpha * d)]
        return tf.group(*updates, self.global_step.assign_add(1))

    def _average(self, _alpha: float):
        tf = self.tf
        means = [self.centre[n].assign(x.read_value()) for n, x in self.vars.items()]
        with tf.control_dependencies(means):
            copies = [x.assign(self.centre[n].read_value()) for n, x in self.vars.items()]
        return tf.group(*copies, self.global_step.assign_add(1))

    def save_default(self, prefix: str) -> str:
        with self.graph.as_default():
            return self.default_saver.save(self.sess, prefix)

    def restart(self, prefix: str) -> None:
        with self.graph.as_default():
            self._initialise()
            self.default_saver.restore(self.sess, prefix)
            self.sess.run(self.init_op)

    def values(self) -> dict[str, np.ndarray]:
        """Every variable, global and local, by name."""
        return dict(zip([v.op.name for v in self.everything], self.sess.run(self.everything)))
