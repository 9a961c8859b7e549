"""``replicas_to_aggregate="auto"``: the chief chooses each update's R from measured rounds and
gradient noise.

The chief (``SyncChief``, one server) is driven in one process by a discrete-event simulation
of N workers whose rounds follow a recorded schedule (a worker slows down mid-run and
recovers), on a fake clock.  A float64 reference written from the rule in the docs (rounds as
medians of the last three, a late worker's round, the noise terms, the measured lags,
``argmax R/(R+rho)/T(R)`` with gradients per second before the noise is measured and a 5%
margin to change R, one gradient per worker per update, stale ones dropped) runs the same
schedule: the R sequence and the applied sums must match.
"""

from __future__ import annotations

import heapq
import math
import statistics

import numpy as np
import pytest
import torch

import gradfleet
from gradfleet.distributed.common.replies import DROPPED, Answer
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.common.replicas_policy import (
    LAG_HALF_LIFE,
    AutoReplicas,
    Decision,
    Measurements,
    progress,
)
from gradfleet.distributed.sync.server.chief import SyncChief

from .test_token_line import Reply  # a ticket that keeps its answer

F64 = torch.float64
LR = 0.1
TF_LR = float(np.float32(LR))  # TF's GradientDescent makes its learning rate a float32 tensor
DIM = 6
CENTRE = np.linspace(-1.0, 1.0, DIM)
SIGMA = 0.8  # noise of one worker's gradient, per coordinate


def gradient(x: np.ndarray, worker: int, round_: int) -> np.ndarray:
    """Worker ``worker``'s ``round_``-th gradient of ``0.5 |x - CENTRE|^2`` at ``x``, with noise
    drawn from its own seeded stream (so both simulations draw the same)."""
    noise = np.random.default_rng(1000 * worker + round_).standard_normal(DIM)
    return (x - CENTRE) + SIGMA * noise


def slow_then_recover(worker: int, round_: int) -> float:
    """Seconds of ``worker``'s ``round_``-th round: about 1 s each, worker 3 three times as
    slow in its rounds 6 to 10."""
    base = 1.0 + 0.01 * math.sin(7 * worker + 3 * round_)
    return base * (3.0 if worker == 3 and 6 <= round_ < 11 else 1.0)


class ChiefServer:
    """The simulated workers' view of a real ``SyncChief`` under ``"auto"``."""

    def __init__(self, N: int, clock) -> None:
        self.x = torch.tensor(np.zeros(DIM), dtype=F64)
        self.chief = SyncChief(
            gradfleet.GradientDescentOptimizer([self.x], LR),
            Job(R=N, N=N, timeout=1e9, policy=AutoReplicas()), clock=clock,
        )  # fmt: skip
        self.tickets: dict[int, Reply] = {}

    def _send(self, msg):
        reply = Reply()
        self.tickets[msg["worker"]] = reply
        return self._deliver(self.chief.handle(msg, reply))

    def tick(self):
        served = {}
        for v, payload in self._deliver(self.chief.tick()).items():
            served[v] = (int(payload["token"]), payload["params"][0].numpy().copy())
        return served

    def _deliver(self, answers):
        out = {}
        for answer in answers:
            assert isinstance(answer, Answer)
            answer.ticket.send(answer.payload, answer.share)
        for w, r in list(self.tickets.items()):
            if r.payload is not None:
                out[w] = r.payload
                del self.tickets[w]
        return out

    def hello(self, w):
        shapes = {"shapes": [[DIM]], "dtypes": ["torch.float64"]}
        got = self._send({"op": "hello", "worker": w, **shapes})
        return int(got[w]["global_step"]), got[w]["params"][0].numpy().copy()

    def push(self, w, tag, grad, version):
        msg = {"op": "step", "worker": w, "tag": tag, "version": version,
               "grads": [torch.tensor(grad, dtype=F64)]}  # fmt: skip
        served = {}
        for v, payload in self._send(msg).items():  # version -1: the values come along
            served[v] = (int(payload["token"]), payload["params"][0].numpy().copy())
        return served

    @property
    def values(self):
        return self.chief.params[0].numpy()

    @property
    def history(self):
        return list(self.chief.history)


class Reference:
    """TF's chief with one gradient per worker per update and R chosen by the documented
    rule, in float64 numpy (written from docs/distributed.md, not from the code)."""

    def __init__(self, N: int, clock) -> None:
        self.N, self.clock = N, clock
        self.x = np.zeros(DIM)
        self.step = 0
        self.rounds: dict[int, list[float]] = {}
        self.token: dict[int, list] = {}  # worker -> [tag, served at, arrived]
        self.trace = self.signal = None
        self.noise_updates = 0
        self.pending: list[np.ndarray] = []
        self.contributors: list[int] = []
        self.history: list[int] = []
        self.R = N
        self.current = None  # the R chosen last
        self.lags: dict[int, tuple] = {}  # R -> (smoothed interval / T(R) >= 1, update)
        self.last_made = self.expected = None

    @property
    def values(self):
        return self.x

    def hello(self, w):
        self.token[w] = [self.step, self.clock(), False]
        return self.step, self.x.copy()

    def _choose(self, now):
        if len(self.rounds) < self.N:
            self.expected = None
            return self.N
        if self.noise_updates < 3 or self.signal <= 0:  # warm-up: the most gradients per second
            rho = math.inf
        else:
            rho = max(self.trace, 0.0) / self.signal
        times = []
        for w in range(self.N):
            d = statistics.median(self.rounds[w][-3:])
            tag, start, arrived = self.token[w]
            times.append(2 * (now - start) if not arrived and now - start > d else d)
        times.sort()

        def rate(r):
            gain = r if math.isinf(rho) else r / (r + rho)
            # an R's measured lag: how much longer than T(R) its updates took
            f, measured_at = self.lags.get(r, (1.0, 0))  # its excess halves every 10 updates
            lag = 1.0 + (f - 1.0) * 0.5 ** ((self.step - measured_at) / 10)
            return gain / max(times[r - 1] * lag, 1e-9)

        best = max(range(self.N, 1, -1), key=lambda r: (rate(r), r))  # R = 1 measures no noise
        if self.current is not None and rate(best) <= rate(self.current) * 1.05:
            best = self.current  # another R must promise 5% more to be taken
        self.current = best
        self.expected = times[best - 1]
        return best

    def push(self, w, tag, grad, version):
        now = self.clock()
        t = self.token[w]
        if t[0] == tag and not t[2]:
            t[2] = True
            self.rounds.setdefault(w, []).append(now - t[1])
        served = {}
        if tag < self.step:  # stale: dropped, next token at once
            self.token[w] = [self.step, now, False]
            return {w: (self.step, self.x.copy())}
        self.pending.append(grad)
        self.contributors.append(w)
        if len(self.pending) < self.R:
            return {}
        k = len(self.pending)
        total = np.sum(self.pending, axis=0)
        mean = total / k
        if k >= 2:
            sum_sq = sum(float(g @ g) for g in self.pending)
            mean_sq = float(mean @ mean)
            trace = k / (k - 1) * (sum_sq / k - mean_sq)
            signal = mean_sq - trace / k
            self.noise_updates += 1
            if self.trace is None:
                self.trace, self.signal = trace, signal
            else:
                self.trace += 0.1 * (trace - self.trace)
                self.signal += 0.1 * (signal - self.signal)
        self.x = self.x - TF_LR * mean
        self.history.append(self.R)
        if self.last_made is not None and self.expected is not None:
            latest = sorted(self.rounds[w][-1] for w in range(self.N))  # a later slowdown's
            lag = max((now - self.last_made) / max(self.expected, latest[self.R - 1]), 1.0)
            old = self.lags.get(self.R)
            smoothed = lag if old is None else old[0] + 0.3 * (lag - old[0])
            self.lags[self.R] = (smoothed, self.step)  # measured at this update
        self.last_made = now
        self.step += 1
        self.R = self._choose(now)
        for v in self.contributors:
            self.token[v] = [self.step, now, False]
            served[v] = (self.step, self.x.copy())
        self.pending, self.contributors = [], []
        return served


def simulate(server_cls, N=4, updates=40, schedule=slow_then_recover, tick=None):
    """Run N simulated workers against ``server_cls`` until ``updates`` updates; returns the
    server.  Each worker computes its gradient on the values it was served, for as long as
    its schedule says, then pushes it and waits for its token.  ``tick``: the server's
    ``tick()`` runs every ``tick`` seconds while nothing arrives."""
    now = [0.0]
    server = server_cls(N, lambda: now[0])
    events: list[tuple[float, int, int, int, np.ndarray]] = []
    rounds = [0] * N

    def start(w, tag, x):
        d = schedule(w, rounds[w])
        heapq.heappush(events, (now[0] + d, w, tag, rounds[w], gradient(x, w, rounds[w])))
        rounds[w] += 1

    for w in range(N):
        tag, x = server.hello(w)
        start(w, tag, x)
    while events and len(server.history) < updates:
        while tick is not None and events[0][0] > now[0] + tick and now[0] < 1e3:
            now[0] += tick
            for v, (token, x) in server.tick().items():
                start(v, token, x)
        if math.isinf(events[0][0]):
            break
        at, w, tag, _, g = heapq.heappop(events)
        now[0] = at
        for v, (token, x) in server.push(w, tag, g, -1).items():
            start(v, token, x)
    return server


def test_chosen_replicas_and_applied_sums_match_a_float64_simulation_of_the_rule():
    chief, reference = simulate(ChiefServer), simulate(Reference)
    assert chief.history == reference.history
    # the rule did adapt: all four at first, three while worker 3 is slow, four again after
    assert chief.history[0] == 4
    assert 3 in chief.history
    slow = chief.history.index(3)
    assert 4 in chief.history[slow:], chief.history
    # the applied sums: same updates, float64 both; the difference is summation order,
    # a few ulps per update over 40 updates of |x| ~ 1
    np.testing.assert_allclose(chief.values, reference.values, rtol=0, atol=40 * 8 * 2.2e-16 * 4)


def test_fixed_replicas_history_records_every_update():
    x = torch.zeros(2, dtype=F64)
    chief = SyncChief(gradfleet.GradientDescentOptimizer([x], LR), Job(R=2, N=3, timeout=10))
    for step in range(2):
        for w in range(2):
            chief.handle({"op": "step", "worker": w, "tag": step, "version": -1,
                          "grads": [torch.ones(2, dtype=F64)]}, Reply())  # fmt: skip
    assert chief.history == [2, 2]


def _view(rounds, rho, live=4):
    return Decision(update=5, live=live, rounds=tuple(rounds), noise_scale=rho)


@pytest.mark.parametrize(
    ("rounds", "rho", "best"),
    [
        ((1.0, 1.0, 1.0, 1.0), 2.0, 4),  # even workers: all of them
        ((1.0, 1.01, 1.02, 3.0), 2.0, 3),  # one straggler: leave it out
        ((1.0, 1.1, 1.2, 1.3), 0.01, 2),  # almost no noise: two gradients (one measures none)
        ((1.0, 1.0, 1.0, 1.05), math.inf, 4),  # noise swamps the signal: R / T(R)
    ],
)
def test_auto_takes_the_most_progress_per_second(rounds, rho, best):
    rates = {r: progress(r, rho) / rounds[r - 1] for r in range(2, 5)}
    assert max(rates, key=lambda r: (rates[r], r)) == best  # the rule, by brute force
    assert AutoReplicas().choose(_view(rounds, rho)) == best


def test_auto_waits_for_everyone_until_their_rounds_are_measured():
    assert AutoReplicas().choose(Decision(0, 4, None, 2.0)) == 4


@pytest.mark.parametrize(
    ("rounds", "best"),
    [
        ((1.0, 1.0, 9.0), 2),  # a straggler: 2 gradients/s against 3 / 9
        ((1.0, 1.0, 1.05), 3),  # even: 3 / 1.05 gradients/s against 2
    ],
)
def test_before_the_noise_is_measured_auto_takes_the_most_gradients_per_second(rounds, best):
    """The warm-up: no noise scale yet, so every gradient counts alike (``rho`` infinite)."""
    assert AutoReplicas().choose(Decision(0, 3, rounds, None)) == best


def test_auto_keeps_its_r_until_another_promises_the_margin_more():
    policy = AutoReplicas()
    assert policy.choose(_view((1.0, 1.0, 1.0, 1.0), 2.0)) == 4
    # R = 3 now promises 3/5 / 1.0 against 4/6 / 1.12: 1.0076x, under the 5% margin: R = 4 stays
    assert policy.choose(_view((1.0, 1.0, 1.0, 1.12), 2.0)) == 4
    restored = AutoReplicas()
    restored.load_state_dict(policy.state_dict())
    assert restored.choose(_view((1.0, 1.0, 1.0, 1.12), 2.0)) == 4  # a checkpoint keeps it
    fresh = AutoReplicas()
    fresh.load_state_dict({})  # a checkpoint from before the policy kept its R: the argmax
    assert fresh.choose(_view((1.0, 1.0, 1.0, 1.12), 2.0)) == 3
    # 1.17x: taken, and then kept while R = 4 promises less than 5% over it
    assert policy.choose(_view((1.0, 1.0, 1.0, 1.3), 2.0)) == 3
    assert policy.choose(_view((1.0, 1.0, 1.0, 1.08), 2.0)) == 3  # 4/6 / 1.08 against 3/5: 1.03x
    assert policy.choose(_view((1.0, 1.0, 1.0, 0.9), 2.0)) == 4  # 1.23x


def test_a_measured_lag_lengthens_t_of_r_and_its_excess_halves_every_half_life():
    """An update at R that took longer than T(R) (workers out of phase) makes R cost more;
    the excess decays while R is not measured again, so R is tried again."""
    m = Measurements()
    m.lag(3, seconds=3.0, expected=1.5, update=4)  # twice T(3)
    m.lag(4, seconds=0.5, expected=1.0, update=4)  # faster than T(4): a lag is at least 1
    assert m.recent_lags(5) == {3: pytest.approx(1 + 0.5 ** (1 / LAG_HALF_LIFE)), 4: 1.0}
    assert m.recent_lags(4 + LAG_HALF_LIFE)[3] == pytest.approx(1.5)
    m.lag(3, seconds=1.5, expected=1.5, update=6)  # smoothed: 2 + 0.3 (1 - 2)
    assert m.recent_lags(6)[3] == pytest.approx(1.7)
    rounds = (1.0, 1.0, 1.0, 1.0)
    view = Decision(7, 4, rounds, 2.0, lags={4: 1.3})
    assert AutoReplicas().choose(view) == 3  # 3/5 against 4/6 / 1.3
    restored = Measurements()
    restored.load_state_dict(m.state_dict())
    assert restored.recent_lags(9) == m.recent_lags(9)


def test_measurements_expect_a_late_worker_to_need_as_long_again():
    m = Measurements()
    for w in range(2):
        m.served(w, 0, 0.0)
        m.arrived(w, 0, 1.0)
        m.served(w, 1, 1.0)
    m.arrived(0, 1, 2.0)  # worker 0's round of step 1 took 1 s
    assert m.expected_rounds(1.5, [0, 1]) == (1.0, 1.0)  # worker 1 is not late yet
    assert m.expected_rounds(3.0, [0, 1]) == (1.0, 4.0)  # 1 s late on its 1 s round: 2 x 2 s
    m.arrived(1, 1, 3.5)  # its round took 2.5 s: rounds 1 and 2.5, median 1.75
    assert m.expected_rounds(3.5, [0, 1]) == (1.0, 1.75)
    assert m.expected_rounds(3.5, [0, 1, 2]) is None  # worker 2 never measured


def test_noise_terms_estimate_the_true_noise_scale():
    """The noise scale from the documented estimators, over many updates of k gradients of a
    known distribution, converges to ``tr(Sigma) / |G|^2``."""
    rng = np.random.default_rng(0)
    G, sigma, k = np.full(10, 0.5), 1.5, 4
    m = Measurements()
    for u in range(400):
        g = G + sigma * rng.standard_normal((k, 10))
        mean = g.mean(axis=0)
        m.noise(u, float((g * g).sum()), float(mean @ mean), k)
        m.close_update(u)
        assert (m.noise_scale() is None) == (u < 2)  # three updates before it counts
    truth = 10 * sigma**2 / float(G @ G)
    assert m.noise_scale() == pytest.approx(truth, rel=0.35)  # smoothed: ~2 updates' worth


def test_a_policy_choosing_outside_the_live_workers_is_refused():
    class Bad:
        def choose(self, view):
            return view.live + 1

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    x = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match=r"chose 4 .* must be an int in \[1, 3\]"):
        SyncChief(gradfleet.GradientDescentOptimizer([x], LR), Job(R=3, N=3, policy=Bad()))


def test_a_worker_leaving_lowers_the_pending_update_and_makes_it():
    x = torch.zeros(2, dtype=F64)
    chief = SyncChief(
        gradfleet.GradientDescentOptimizer([x], LR),
        Job(R=3, N=3, timeout=10, policy=AutoReplicas()),
    )
    replies = [Reply() for _ in range(3)]
    for w in range(2):
        for out in chief.handle(
            {
                "op": "step",
                "worker": w,
                "tag": 0,
                "version": -1,
                "grads": [torch.full((2,), float(w + 1), dtype=F64)],
            },
            replies[w],
        ):
            out.ticket.send(out.payload)  # fmt: skip
    assert chief.global_step == 0  # waits for the third
    for out in chief.handle({"op": "done", "worker": 2}, Reply()):
        out.ticket.send(out.payload)
    assert chief.global_step == 1 and chief.history == [2]
    torch.testing.assert_close(chief.params[0], torch.full((2,), -LR * 1.5, dtype=F64))
    assert replies[0].payload["token"] == 1 and replies[1].payload["r"] == 2


class Scripted:
    """A policy that answers from a script and keeps its last answer, as AutoReplicas does."""

    def __init__(self, answers: list[int]) -> None:
        self.answers, self.current = list(answers), None

    def choose(self, view: Decision) -> int:
        self.current = self.answers.pop(0)
        return self.current

    def state_dict(self) -> dict:
        return {"current": self.current}

    def load_state_dict(self, state: dict) -> None:
        self.current = state["current"]


def test_a_choice_reconsidered_but_not_taken_leaves_the_policy_as_it_was():
    from gradfleet.distributed.sync.common.replica_choice import ReplicaChoice

    choice = ReplicaChoice(3, Scripted([2, 3]))
    measured = choice.measured
    for t in range(3):  # three rounds of 1 s from each worker
        for w in range(3):
            measured.served(w, t, 10.0 * t)
            measured.arrived(w, t, 10.0 * t + 1.0)
    assert choice.decide(3, [0, 1, 2], 30.0) == 2
    for w in range(3):
        measured.served(w, 3, 30.0)
    measured.arrived(0, 3, 31.0)
    assert measured.overdue(33.0, [0, 1, 2])  # workers 1 and 2: the policy is asked again
    assert choice.reconsider(3, [0, 1, 2], 33.0) is None  # it says 3: not lower, not taken
    assert choice.replicas[3] == 2 and choice.policy.current == 2


def test_state_dict_carries_the_choices():
    chief = simulate(ChiefServer, updates=14).chief
    state = chief.state_dict()
    x = torch.zeros(DIM, dtype=F64)
    again = SyncChief(
        gradfleet.GradientDescentOptimizer([x], LR),
        Job(R=4, N=4, timeout=1e9, policy=AutoReplicas()),
    )
    again.load_state_dict(state)
    assert again.history == chief.history
    assert again.replicas[again.global_step] == chief.replicas[chief.global_step]
    assert again.measured.noise_scale() == chief.measured.noise_scale()
    assert dict(again.measured.rounds) == dict(chief.measured.rounds)


def dies_at_round_5(worker: int, round_: int) -> float:
    """Worker 2's fifth round never ends (it died); the others take about 1 s."""
    return math.inf if worker == 2 and round_ == 5 else 1.0 + 0.01 * math.sin(worker + round_)


def test_a_worker_that_dies_mid_update_is_left_out_after_twice_its_round():
    server = simulate(ChiefServer, N=3, updates=12, schedule=dies_at_round_5, tick=0.1)
    history = server.history
    assert len(history) == 12, history  # nothing hangs: the update it was in went on
    assert history[:5] == [3] * 5 and max(history[5:]) <= 2, history  # at most the live two
    chief = server.chief
    assert chief.measured.overdue(chief.clock(), [0, 1, 2]) == [2]


class ReplicatedChiefServer(ChiefServer):
    """A ``ChiefServer`` whose chief has a live standby, fed as the hosting code feeds one
    (:mod:`gradfleet.distributed.hosting.standby`): a copy of every request the chief
    handled, less the fields the chief replaces (its gradients), with the chief's
    ``copy_fields``, and every request a tick hands out; and the worker on the standby's rank
    (worker 1) reads its values there after every request, as it does.  The standby's clock is
    another host's: offset, and at an uneven pace."""

    def __init__(self, N: int, clock) -> None:
        super().__init__(N, clock)
        self.chief.standby = "standby's address"  # the chief now keeps its ticks for it
        x = torch.tensor(np.zeros(DIM), dtype=F64)
        self.copy = SyncChief(
            gradfleet.GradientDescentOptimizer([x], LR),
            Job(R=N, N=N, timeout=1e9, policy=AutoReplicas()),
            clock=lambda: 1000.0 + clock() + 0.4 * math.sin(clock()) ** 2,
        )  # fmt: skip
        self.copy.choice.follow(self.copy.choice.live_state())  # as SyncServers starts it

    def _replicate(self, msg):
        left_out = self.chief.standby_replaced.get(msg["op"], ())
        fields = {k: v for k, v in msg.items() if k not in left_out}
        self.copy.handle({**fields, **self.chief.copy_fields()}, DROPPED)
        self.copy.handle({"op": "read", "worker": 1, "version": -1}, Reply())  # no takeover

    def _send(self, msg):
        out = super()._send(msg)
        self._replicate(msg)
        return out

    def tick(self):
        served = super().tick()
        for request in self.chief.tick_requests():
            self._replicate(request)
        self.copy.tick()  # its own ticks change nothing while it follows
        return served


def _same_chiefs(chief: SyncChief, copy: SyncChief) -> None:
    assert copy.history == chief.history and copy.global_step == chief.global_step
    assert torch.equal(copy.params[0], chief.params[0])
    assert copy.choice.live_state() == chief.choice.live_state()


def test_a_standby_takes_each_r_from_its_chief_and_stays_bit_identical():
    server = simulate(ReplicatedChiefServer, updates=40)
    _same_chiefs(server.chief, server.copy)
    assert 3 in server.history and server.history[0] == 4  # the choices did change
    # its own rank's worker reads there: it still follows (its ticks choose nothing)
    server.copy.handle({"op": "read", "worker": 1, "version": -1}, Reply())
    assert server.copy.choice.following
    # a worker's own request (the standby took over): it chooses from then on
    server.copy.handle({"op": "stats", "worker": 0}, Reply())
    assert not server.copy.choice.following


def test_an_r_lowered_on_a_tick_is_lowered_on_the_standby_too():
    server = simulate(ReplicatedChiefServer, N=3, updates=12, schedule=dies_at_round_5, tick=0.1)
    assert len(server.history) == 12 and max(server.history[5:]) <= 2, server.history
    _same_chiefs(server.chief, server.copy)


def test_a_shard_lowers_its_update_when_the_chief_says_so():
    from gradfleet.distributed.sync.server.shards import Applied, Shard, ShardServer

    x = torch.zeros(2, dtype=F64)
    shard = Shard(gradfleet.GradientDescentOptimizer([x], LR), [0], Job(R=3, N=3, timeout=10.0))
    shard.measure()
    server = ShardServer(1, shard, Job(R=3, N=3, timeout=10.0))
    for w in range(2):
        grads = [torch.full((2,), float(w + 1), dtype=F64)]
        out = server.handle({"op": "push", "worker": w, "tag": 0, "r": 3, "grads": grads}, Reply())
        assert not any(isinstance(o, Applied) for o in out)
    out = server.handle({"op": "replicas", "worker": -1, "step": 0, "r": 2}, Reply())
    applied = [o for o in out if isinstance(o, Applied)]
    assert applied and applied[0].step == 1 and applied[0].noise[2] == 2
    torch.testing.assert_close(shard.params[0], torch.full((2,), -TF_LR * 1.5, dtype=F64))


# --------------------------------------------------------------------- over processes
def _check_logged(history, decisions):
    """Every update's R is logged, its last decision being the R it was made with."""
    last = {}
    for update, r in decisions:
        last[update] = r
    assert [last[u] for u in range(len(history))] == history


@pytest.mark.parametrize(
    ("server_ranks", "world"),
    [(None, 4), ([0, 1, 2, 3], 4), ([4], 5)],
    ids=["one-server", "sharded", "dedicated"],
)
def test_a_worker_slows_down_and_recovers_over_processes(server_ranks, world):
    from gradfleet.distributed.testing import run_ranks

    from . import auto_ranks

    steps = 36
    args = (steps, server_ranks, (3, 8, 18, 0.6), None, 0.05, 4)
    out = run_ranks(auto_ranks.auto_train, world, args=args, timeout=150)
    history = out[0]["history"]
    assert [o["history"] for o in out[:4]] == [history] * 4  # the chief's record, everywhere
    assert len(history) == steps and all(o["global_step"] == steps for o in out[:4])
    assert history[0] == 4  # starts from R = N
    low = min(range(len(history)), key=lambda u: (history[u], u))
    assert history[low] <= 3, history  # left the slow worker out...
    assert 4 in history[low:], history  # ...and took it back once it recovered
    _check_logged(history, out[(server_ranks or [0])[0]]["decisions"])  # the chief's rank


def test_a_killed_worker_under_auto_leaves_the_job_running():
    from gradfleet.distributed.testing import RankKilled, run_ranks

    from . import auto_ranks

    steps = 24
    out = run_ranks(
        auto_ranks.auto_train, 4, args=(steps, None, None, (2, 6)), timeout=150,
        kill_on={2: "die"},
    )  # fmt: skip
    assert out[2] == RankKilled(2)
    survivors = [out[r] for r in (0, 1, 3)]
    assert all(o["global_step"] == steps for o in survivors)
    history = survivors[0]["history"]
    assert len(history) == steps and history[0] == 4
    assert max(history[8:]) <= 3, history  # at most the live workers once it is gone
    _check_logged(history, survivors[0]["decisions"])
