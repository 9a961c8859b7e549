"""The cluster benchmark's compute slowdowns (``benchmarks.cluster.cluster_slowdown``): each
schedule against a step-by-step simulation of what its docstring says, determinism by seed (also
in another process), the moving straggler moving, transient slowdowns independent per host with
the stated factor and rate, and the scenarios' schedules as ``benchmarks/cluster/cluster.py``
builds them from its flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from benchmarks.cluster import cluster
from benchmarks.cluster.cluster_slowdown import (
    MovingStraggler,
    SlowHost,
    Transient,
    from_spec,
    table,
    to_spec,
    uniform,
)

from .netns import ROOT


def _runs(factors: list[float]) -> list[tuple[int, int]]:
    """(start, length) of each run of slowed steps."""
    runs, start = [], None
    for s, f in enumerate([*factors, 1.0]):
        if f > 1 and start is None:
            start = s
        elif f == 1 and start is not None:
            runs.append((start, s - start))
            start = None
    return runs


def test_slow_host_is_the_one_host_slowed_at_every_step() -> None:
    schedule = SlowHost(3, 2.0)
    factors = table(schedule, 5, 50)
    assert factors[3] == [2.0] * 50
    assert all(factors[h] == [1.0] * 50 for h in (0, 1, 2, 4))


@pytest.mark.parametrize(("hosts", "factor", "every", "first"), [(4, 3.0, 4, 3), (3, 2.5, 1, 0)])
def test_the_moving_straggler_moves_from_host_to_host(
    hosts: int, factor: float, every: int, first: int
) -> None:
    schedule = MovingStraggler(hosts, factor, every, first)
    steps = 6 * hosts * every
    factors = table(schedule, hosts, steps)
    # reference: one turn at a time, handed to the next host after `every` steps
    expected = [[1.0] * steps for _ in range(hosts)]
    turn, left = first, every
    for s in range(steps):
        expected[turn][s] = factor
        left -= 1
        if left == 0:
            turn, left = (turn + 1) % hosts, every
    assert factors == expected
    slow = [next(h for h in range(hosts) if factors[h][s] > 1) for s in range(steps)]
    assert all(sum(factors[h][s] > 1 for h in range(hosts)) == 1 for s in range(steps))
    blocks = [slow[i : i + every] for i in range(0, steps, every)]
    assert all(len(set(b)) == 1 for b in blocks)  # one host per block of `every` steps
    assert all(a[0] != b[0] for a, b in zip(blocks, blocks[1:]))  # then another one
    assert {b[0] for b in blocks[:hosts]} == set(range(hosts))  # every host has its turn
    assert schedule.slow_host(0) == first


def test_transient_is_a_stateful_simulation_of_its_starts() -> None:
    """A step is slowed iff a slowdown started in the last ``steps`` steps: the same as
    counting down ``steps`` from every start, step by step."""
    schedule = Transient(4.0, 0.1, 3, seed=11)
    for host in range(4):
        left, expected = 0, []
        for s in range(600):
            if uniform(11, host, s) < 0.1:
                left = 3
            expected.append(4.0 if left > 0 else 1.0)
            left = max(left - 1, 0)
        assert [schedule.factor_at(host, s) for s in range(600)] == expected, host


def test_transient_slowdowns_have_the_stated_factor_rate_and_length() -> None:
    factor, chance, steps, n = 4.0, 0.1, 3, 20_000
    schedule = Transient(factor, chance, steps, seed=5)
    for host, factors in enumerate(table(schedule, 4, n)):
        assert set(factors) == {1.0, factor}
        starts = sum(schedule.starts(host, s) for s in range(n)) / n
        assert starts == pytest.approx(chance, abs=0.01)
        # a step is slowed unless none of the last `steps` steps started a slowdown
        slowed = sum(f > 1 for f in factors) / n
        assert slowed == pytest.approx(1 - (1 - chance) ** steps, abs=0.02)
        runs = _runs(factors)
        assert runs and all(length >= steps for start, length in runs if start + length < n)


def test_transient_slowdowns_are_independent_per_host() -> None:
    n, hosts = 20_000, 4
    slowed = [[f > 1 for f in row] for row in table(Transient(4.0, 0.1, 3, seed=0), hosts, n)]
    share = [sum(row) / n for row in slowed]
    for a in range(hosts):
        for b in range(a + 1, hosts):
            assert slowed[a] != slowed[b]
            both = sum(x and y for x, y in zip(slowed[a], slowed[b])) / n
            assert both == pytest.approx(share[a] * share[b], abs=0.015), (a, b)


def test_transient_schedules_are_fixed_by_their_seed() -> None:
    a, b = Transient(4.0, 0.2, 2, seed=1), Transient(4.0, 0.2, 2, seed=1)
    assert table(a, 4, 300) == table(b, 4, 300)
    assert table(a, 4, 300) != table(Transient(4.0, 0.2, 2, seed=2), 4, 300)
    # another process, another hash seed, the spec through JSON: the same schedule
    code = (
        "import json, sys\n"
        "from benchmarks.cluster.cluster_slowdown import from_spec, table\n"
        "print(json.dumps(table(from_spec(json.loads(sys.argv[1])), 4, 300)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(to_spec(a))],
        capture_output=True, text=True, check=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip
    assert json.loads(out.stdout) == table(a, 4, 300)


def test_uniform_is_spread_over_the_unit_interval() -> None:
    values = [uniform(0, h, s) for h in range(4) for s in range(2500)]
    assert all(0 <= v < 1 for v in values)
    for k in range(10):  # each tenth holds a tenth of them
        share = sum(k / 10 <= v < (k + 1) / 10 for v in values) / len(values)
        assert share == pytest.approx(0.1, abs=0.015), k


@pytest.mark.parametrize(
    "schedule", [SlowHost(3, 2.0), MovingStraggler(4, 3.0, 4, 3), Transient(4.0, 0.1, 3, 7)]
)
def test_a_spec_through_json_is_the_same_schedule(schedule) -> None:
    again = from_spec(json.loads(json.dumps(to_spec(schedule))))
    assert again == schedule and table(again, 4, 100) == table(schedule, 4, 100)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: SlowHost(-1, 2.0), "SlowHost: host must be an int >= 0, got -1"),
        (lambda: SlowHost(3, 0.5), "SlowHost: factor must be >= 1, got 0.5"),
        (lambda: MovingStraggler(4, 3.0, 0), "MovingStraggler: every must be an int >= 1"),
        (lambda: MovingStraggler(4, 3.0, 4, 4), "first must be a host index in [0, 4), got 4"),
        (lambda: Transient(4.0, 1.5, 3), "Transient: chance must be a probability in [0, 1]"),
        (lambda: Transient(4.0, 0.1, 0), "Transient: steps must be an int >= 1, got 0"),
        (lambda: SlowHost(3, 2.0).factor_at(0, -1), "factor_at: step must be an int >= 0"),
        (lambda: from_spec({"kind": "slow"}), "kind must be one of ['moving-straggler', "),
        (lambda: from_spec({"kind": "slow-host", "host": 1, "factor": 2, "x": 1}), "['x']"),
    ],
)
def test_bad_arguments_name_the_argument_and_what_it_takes(make, words: str) -> None:
    with pytest.raises(ValueError) as error:
        make()
    assert words in str(error.value)


def test_the_scenarios_build_their_schedules_from_the_flags() -> None:
    args = cluster.parse(["--straggler-factor", "2.5", "--straggler-every", "3",
                          "--transient-factor", "5", "--transient-chance", "0.2",
                          "--transient-steps", "2", "--slowdown-seed", "9"])  # fmt: skip
    assert cluster.slowdown("uniform", args) is None
    assert cluster.slowdown("slow-link", args) is None
    assert cluster.slowdown("slow-compute", args) == SlowHost(3, 2.0)  # as before: host 3, 2x
    assert cluster.slowdown("moving-straggler", args) == MovingStraggler(4, 2.5, 3, first=3)
    assert cluster.slowdown("transient", args) == Transient(5.0, 0.2, 2, seed=9)
    assert "5x slower for 2 steps" in cluster.describe("transient", args)
    assert "seed 9" in cluster.describe("transient", args)
    # defaults: the three scenarios of before; a 3x straggler moving every 4 steps; 4x
    # slowdowns of 3 steps starting with chance 0.1
    defaults = cluster.parse([])
    assert defaults.scenarios == "uniform,slow-link,slow-compute"
    assert cluster.slowdown("moving-straggler", defaults) == MovingStraggler(4, 3.0, 4, 3)
    assert cluster.slowdown("transient", defaults) == Transient(4.0, 0.1, 3, seed=0)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--straggler-factor", "0.5"], "argument --straggler-factor: must be >= 1, got 0.5"),
        (["--straggler-every", "0"], "argument --straggler-every: must be >= 1, got 0"),
        (["--transient-chance", "2"], "argument --transient-chance: must be a probability"),
        (["--transient-steps", "1.5"], "argument --transient-steps: invalid int value"),
    ],
)
def test_bad_flags_are_refused_by_name(argv: list[str], words: str, capsys) -> None:
    with pytest.raises(SystemExit):
        cluster.parse(argv)
    assert words in capsys.readouterr().err
