"""The deference rule (gradfleet.distributed.sync.worker.deference): its pieces on their own,
then the whole rule in a single-process, event-by-event simulation of first-R arrivals
written from the exchange's description (first R to count in make the update; a late worker
receives it, which takes ``X`` seconds, then computes its next gradient at the newest step; a
worker whose gradient is of an old step counts in there, catches up and computes again)."""

from __future__ import annotations

import heapq
import math
import random

import pytest

from gradfleet.distributed.sync.worker.deference import (
    GRACE,
    INTERVALS,
    MARGIN,
    MAX_SKIP,
    RECENT,
    SAME_PACE,
    WINDOW,
    Deference,
)


def _timed(d: Deference, interval: float = 1.0, pace: float = 1.0) -> Deference:
    for k in range(INTERVALS + 1):
        d.updated(k * interval)
    d.computed(pace)
    return d


def test_no_grace_until_enough_updates_are_timed() -> None:
    d = Deference(4)
    for k in range(INTERVALS):
        d.updated(float(k))
        assert d.grace() == 0
        assert d.candidates(0, k, [[0, 1, 2]] * 10, range(4)) == []
    d.updated(float(INTERVALS))
    assert d.grace() == pytest.approx(GRACE * 1.0)


def test_grace_is_half_the_median_interval_not_the_mean() -> None:
    d = Deference(4)
    times = [0.0]
    for k in range(INTERVALS):
        times.append(times[-1] + (10.0 if k == 0 else 2.0))  # one long interval
    for t in times:
        d.updated(t)
    assert d.grace() == pytest.approx(GRACE * 2.0)


def test_owed_are_the_live_workers_heard_margin_fewer_times_in_the_window() -> None:
    d = _timed(Deference(4))
    window = WINDOW * 4
    # in the window: ranks 0 and 1 in every update, rank 2 in MARGIN - 1 fewer, rank 3 in none
    # (it was in every update before the window)
    history = [[3]] * 50 + [[0, 1, 2]] * (window - MARGIN + 1) + [[0, 1]] * (MARGIN - 1)
    assert d.candidates(0, 100, history, [0, 1, 2, 3]) == [3]
    assert d.candidates(3, 100, history, [0, 1, 2, 3]) == []  # the one owed owes nobody
    assert d.candidates(0, 100, history, [0, 1, 2]) == []  # rank 3 is not live


def test_owed_are_the_candidates_still_coming_at_about_this_workers_pace() -> None:
    d = _timed(Deference(4))
    for seconds in (2.0, 0.5, 1.0):  # the median of the worker's own times
        d.computed(seconds)
    assert d.pace() == 1.0
    lately = {1: SAME_PACE * 1.0, 2: SAME_PACE * 1.0 + 1e-9, 3: 0.1}
    assert d.owed([1, 2, 3, 4], lately) == [1, 3]  # 2 is slower; 4 did not come lately


def test_a_worker_that_does_not_come_is_paused_1_2_4_then_at_most_max_skip_updates() -> None:
    d = _timed(Deference(2))
    history = [[0]] * 20
    step, pauses = 100, []
    for _ in range(6):
        assert d.candidates(0, step, history, [0, 1]) == [1]
        d.settle(step, owed=[1], came=[], waited=0.5)
        later = range(step + 1, step + 100)
        resumed = next(s for s in later if d.candidates(0, s, history, [0, 1]))
        pauses.append(resumed - step - 1)
        step = resumed
    assert pauses == [1, 2, 4, 8, 8, 8][: len(pauses)] and MAX_SKIP == 8
    # one that comes is deferred to again at once, and its misses start afresh
    d.settle(step, owed=[1], came=[1], waited=0.1)
    assert d.candidates(0, step + 1, history, [0, 1]) == [1]
    d.settle(step + 1, owed=[1], came=[], waited=0.5)
    assert d.candidates(0, step + 2, history, [0, 1]) == []
    assert d.candidates(0, step + 3, history, [0, 1]) == [1]
    assert d.waits == 8 and d.waited == pytest.approx(6 * 0.5 + 0.1 + 0.5)


def test_no_deference_with_an_infinite_margin() -> None:
    d = _timed(Deference(2, margin=math.inf))
    assert d.candidates(0, 100, [[0]] * 20, [0, 1]) == []


# --------------------------------------------------------------------- the simulation
def simulate(
    n: int,
    r: int,
    updates: int,
    compute: list[float] | None = None,
    slow: dict[int, tuple[float, int]] | None = None,
    late_lag: float = 0.3,
    all_reduce: float = 0.05,
    jitter: float = 0.01,
    margin: float = MARGIN,
    seed: int = 0,
) -> tuple[list[list[int]], list[float], list[Deference]]:
    """First-R updates of ``n`` workers, each computing ``compute[w]`` seconds per gradient
    (``slow[w] = (seconds, until)``: that long until update ``until``), with relative
    ``jitter``; the members' all-reduce takes ``all_reduce``; a late worker receives an
    update (or a run of them) ``late_lag`` after it is made, or after it asks, whichever is
    later.  Returns each update's members, the time it was made, and each worker's rule."""
    rng = random.Random(seed)
    compute = compute or [1.0] * n
    slow = slow or {}
    rules = [Deference(n, margin) for _ in range(n)]
    history: list[list[int]] = []
    made: list[float] = []
    came: dict[int, dict[int, float]] = {}  # step -> the workers that counted in, their pace
    order: list[int] = []  # the current step's arrivals
    waiting: dict[int, tuple[float, list[int]]] = {}  # deferring worker -> (since, owed)
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, worker, step)
    seq = 0

    def push(t: float, kind: str, w: int, s: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, w, s))

    def computes(w: int, start: float, step: int) -> None:
        """``w`` starts a gradient of ``step`` at ``start``."""
        c = slow[w][0] if w in slow and len(made) < slow[w][1] else compute[w]
        c *= 1 + jitter * rng.uniform(-1, 1)
        rules[w].computed(c)
        push(start + c, "ready", w, step)

    def count_in(w: int, s: int) -> None:
        came.setdefault(s, {})[w] = rules[w].last()

    def lately(s: int, ranks: list[int]) -> dict[int, float]:
        out: dict[int, float] = {}
        for back in range(RECENT, 0, -1):  # the latest arrival's pace wins
            out.update({o: p for o, p in came.get(s - back, {}).items() if o in ranks})
        return out

    for w in range(n):
        computes(w, 0.0, 0)
    while len(made) < updates:
        t, _, kind, w, s = heapq.heappop(events)
        g = len(made)
        if kind == "ready":
            if s < g:  # of an old step: counts in there, receives the newer updates, again
                count_in(w, s)
                computes(w, max(t, made[-1]) + late_lag, g)
                continue
            rule = rules[w]
            candidates = rule.candidates(w, s, history, range(n))
            owed = rule.owed(candidates, lately(s, candidates))
            owed = [o for o in owed if o not in came.get(s, {})]
            if owed:
                waiting[w] = (t, owed)
                push(t + rule.grace(), "deadline", w, s)
                continue
            push(t, "arrive", w, s)
        elif kind == "deadline":
            if w in waiting and s == g:
                started, owed = waiting.pop(w)
                rules[w].settle(s, owed, [o for o in owed if o in came.get(s, {})], t - started)
                push(t, "arrive", w, s)
        elif kind == "arrive":
            count_in(w, s)
            if s < g:  # the update was made meanwhile: receive it (and any newer), again
                computes(w, max(t, made[-1]) + late_lag, g)
                continue
            order.append(w)
            for d, (started, owed) in list(waiting.items()):  # released deferrers
                if all(o in came.get(s, {}) for o in owed):
                    del waiting[d]
                    rules[d].settle(s, owed, owed, t - started)
                    push(t, "arrive", d, s)
            if len(order) == r:
                done = t + all_reduce
                history.append(sorted(order))
                made.append(done)
                for rule in rules:
                    rule.updated(done)
                for m in order:
                    computes(m, done, g + 1)
                for d, (started, _) in list(waiting.items()):  # made without them
                    del waiting[d]
                    rules[d].settle(s, [], [], t - started)
                    push(t, "arrive", d, s)
                order = []
    return history, made, rules


def _shares(history: list[list[int]], n: int, r: int) -> list[float]:
    return [sum(w in m for m in history) / len(history) / (r / n) for w in range(n)]


CASES = [(2, 1), (4, 3), (4, 2), (8, 7)]
LAGS = [0.05, 0.3, 0.6]  # receiving an update, x the time a gradient takes


@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize(("n", "r"), CASES)
def test_equal_workers_each_share_is_near_fair_in_every_50_updates(
    n: int, r: int, lag: float
) -> None:
    """Equal workers: without the rule one is locked out (the problem the rule is for); with
    it, every worker's share of any 50 updates after the first 20 is within 0.5x-1.5x of
    R / N, at a cost of at most a few tenths of the time (the simulations' worst: 1.22x at
    a lag of 0.6, where each rotation waits for a worker a step behind)."""
    first_r, t_first, _ = simulate(n, r, 220, late_lag=lag, margin=math.inf)
    assert min(_shares(first_r[20:70], n, r)) < 0.5
    fair, t_fair, _ = simulate(n, r, 220, late_lag=lag)
    for k in range(20, 171, 10):
        shares = _shares(fair[k : k + 50], n, r)
        assert all(0.5 <= s <= 1.5 for s in shares), (k, shares)
    assert t_fair[-1] - t_fair[20] <= (t_first[-1] - t_first[20]) * (1 + 2 * GRACE / MARGIN)


@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize(("n", "r"), [(4, 3), (8, 7), (2, 1)])
def test_a_recovered_straggler_is_heard_within_a_few_updates(n: int, r: int, lag: float) -> None:
    """The last worker computes 3x as long until update 20; in the 10 updates after its
    first gradient at the new pace, its gradients go into at least half as many updates as
    the others' average (without the rule: none)."""
    for margin, heard in ((math.inf, False), (MARGIN, True)):
        history, _, _ = simulate(n, r, 40, slow={n - 1: (3.0, 20)}, late_lag=lag, margin=margin)
        after = history[21:31]
        others = sum(sum(w in m for m in after) for w in range(n - 1)) / (n - 1)
        assert (sum(n - 1 in m for m in after) >= others / 2) == heard, (margin, after)


@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize("slowness", [1.3, 2.0, 3.0])
def test_a_worker_slower_throughout_is_never_waited_for(slowness: float, lag: float) -> None:
    """Slower than SAME_PACE x the others (jitter included): what backups are for; no
    worker ever defers to it, so the updates are those of the first R."""
    assert slowness > SAME_PACE * 1.01 / 0.99
    compute = [1.0, 1.0, 1.0, slowness]
    first_r, _, _ = simulate(4, 3, 120, compute=compute, late_lag=lag, margin=math.inf)
    fair, _, rules = simulate(4, 3, 120, compute=compute, late_lag=lag)
    assert sum(rule.waits for rule in rules) == 0
    assert fair == first_r


def test_a_worker_about_as_fast_is_heard() -> None:
    """10% slower is within SAME_PACE: it is waited for when owed, so it is heard."""
    compute = [1.0, 1.0, 1.0, 1.1]
    first_r, _, _ = simulate(4, 3, 120, compute=compute, margin=math.inf)
    fair, _, _ = simulate(4, 3, 120, compute=compute)
    assert _shares(first_r[20:120], 4, 3)[3] < 0.5 <= _shares(fair[20:120], 4, 3)[3]
