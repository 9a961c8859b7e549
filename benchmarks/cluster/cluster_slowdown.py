"""Compute slowdowns of the cluster benchmark: how many times slower each host computes at each
of its own training steps.

A schedule is a pure function ``factor_at(host, step) -> f`` (``step``: the host's local training
step, counted from 0), the same on every host and in every row of a run: the worker sleeps
``(f - 1) * c`` before that step's forward, ``c`` being its calibrated compute time (a machine
``f`` times slower).  Kinds:

* :class:`SlowHost`: one host ``factor`` times slower at every step (``slow-compute``);
* :class:`MovingStraggler`: one host ``factor`` times slower, and every ``every`` steps the
  next host is: host ``(first + step // every) % hosts`` at ``step``;
* :class:`Transient`: at each step, each host independently starts a slowdown with
  probability ``chance``, seeded; a slowdown makes ``steps`` steps ``factor`` times slower
  (one that starts inside another extends it).  The same seed gives the same schedule.

Steps are each host's own: a host that falls behind reaches its slow steps later in wall
time, and a moving straggler's turn lasts ``every`` of its own, slower, steps.
:func:`to_spec` / :func:`from_spec` carry a schedule to the workers as JSON.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar


def _check(owner: str, name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")


def _check_factor(owner: str, factor: float) -> None:
    _check(owner, "factor", factor, isinstance(factor, (int, float)) and factor >= 1, ">= 1")


def _check_count(owner: str, name: str, value: int, low: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    _check(owner, name, value, ok, f"an int >= {low}")


def _check_step(host: int, step: int) -> None:
    _check("factor_at", "host", host, isinstance(host, int) and host >= 0, "an int >= 0")
    _check("factor_at", "step", step, isinstance(step, int) and step >= 0, "an int >= 0")


@dataclass(frozen=True)
class SlowHost:
    """Host ``host`` is ``factor`` times slower at every step; the others are not slowed."""

    kind: ClassVar[str] = "slow-host"
    host: int
    factor: float

    def __post_init__(self) -> None:
        _check_count("SlowHost", "host", self.host, 0)
        _check_factor("SlowHost", self.factor)

    def factor_at(self, host: int, step: int) -> float:
        _check_step(host, step)
        return float(self.factor) if host == self.host else 1.0


@dataclass(frozen=True)
class MovingStraggler:
    """One of ``hosts`` hosts is ``factor`` times slower: at step ``s``, host
    ``(first + s // every) % hosts``; the turn passes to the next host every ``every`` steps."""

    kind: ClassVar[str] = "moving-straggler"
    hosts: int
    factor: float
    every: int
    first: int = 0

    def __post_init__(self) -> None:
        _check_count("MovingStraggler", "hosts", self.hosts, 1)
        _check_factor("MovingStraggler", self.factor)
        _check_count("MovingStraggler", "every", self.every, 1)
        ok = isinstance(self.first, int) and 0 <= self.first < self.hosts
        _check("MovingStraggler", "first", self.first, ok, f"a host index in [0, {self.hosts})")

    def slow_host(self, step: int) -> int:
        """The host that is slowed at local step ``step``."""
        return (self.first + step // self.every) % self.hosts

    def factor_at(self, host: int, step: int) -> float:
        _check_step(host, step)
        return float(self.factor) if host == self.slow_host(step) else 1.0


def uniform(seed: int, host: int, step: int) -> float:
    """A number in [0, 1) from a hash of (seed, host, step): the same in every process and
    Python version (no ``hash()``, no global random state)."""
    digest = hashlib.blake2b(f"{seed}/{host}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True)
class Transient:
    """Each host, independently: a slowdown starts at step ``t`` when
    ``uniform(seed, host, t) < chance``, and steps ``t .. t + steps - 1`` are ``factor`` times
    slower.  A step is slowed once however many slowdowns cover it."""

    kind: ClassVar[str] = "transient"
    factor: float
    chance: float
    steps: int
    seed: int = 0

    def __post_init__(self) -> None:
        _check_factor("Transient", self.factor)
        ok = isinstance(self.chance, (int, float)) and 0 <= self.chance <= 1
        _check("Transient", "chance", self.chance, ok, "a probability in [0, 1]")
        _check_count("Transient", "steps", self.steps, 1)
        _check("Transient", "seed", self.seed, isinstance(self.seed, int), "an int")

    def starts(self, host: int, step: int) -> bool:
        """Whether a slowdown of ``host`` starts at ``step``."""
        return uniform(self.seed, host, step) < self.chance

    def factor_at(self, host: int, step: int) -> float:
        _check_step(host, step)
        recent = range(max(0, step - self.steps + 1), step + 1)
        return float(self.factor) if any(self.starts(host, t) for t in recent) else 1.0


Slowdown = SlowHost | MovingStraggler | Transient
KINDS: dict[str, type[Slowdown]] = {cls.kind: cls for cls in (SlowHost, MovingStraggler, Transient)}


def to_spec(schedule: Slowdown) -> dict[str, Any]:
    """The schedule as JSON-able data: ``{"kind": ..., field: value, ...}``."""
    return {"kind": schedule.kind, **asdict(schedule)}


def from_spec(spec: dict[str, Any]) -> Slowdown:
    """The schedule :func:`to_spec` described."""
    kind = spec.get("kind")
    if kind not in KINDS:
        raise ValueError(f"slowdown spec: kind must be one of {sorted(KINDS)}, got {kind!r}")
    cls = KINDS[kind]
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(spec) - names - {"kind"})
    if unknown:
        raise ValueError(f"slowdown spec: {kind} takes {sorted(names)}, got also {unknown}")
    return cls(**{k: v for k, v in spec.items() if k != "kind"})


def table(schedule: Slowdown, hosts: int, steps: int) -> list[list[float]]:
    """``[host][step]`` factors of the first ``steps`` steps of ``hosts`` hosts."""
    return [[schedule.factor_at(h, s) for s in range(steps)] for h in range(hosts)]
