"""``replicas_to_aggregate="auto"`` against every fixed R, in a single-process simulation of
the token line: fast enough to try a rule on many jobs, scenarios and seeds.

Each of N simulated workers reads the variables when it is served a token, computes a real
gradient of a real model on its own batch, and pushes it after a *round* of simulated seconds
(its compute time times the scenario's slowdown of that worker at that step, plus its transfer
time, with a few percent of random jitter).  The update at step s is made from the first R
gradients tagged s (``tokens="distinct"``: a gradient tagged older is dropped and its worker
served again at once), exactly as the chief's token line does; the R of each update comes from
the library's own :class:`~gradfleet.distributed.sync.common.replica_choice.ReplicaChoice`
(fixed, or the ``"auto"`` policy fed by its own ``Measurements``), which is also asked to
reconsider at every arrival.  Time to the target is the simulated time at which the loss on a
fixed evaluation set first falls below the job's target.

Jobs (``--jobs``): a teacher-student classification (Gaussian inputs, labels of a fixed linear
teacher, 4 classes, as in the cluster benchmark) learnt by an MLP, and a regression of a fixed
random nonlinear teacher by a wider MLP; each with Adam and with SGD.  Scenarios: the cluster
benchmark's five and two held out (``--held-out``).

    python -m benchmarks.distributed.auto_replicas_sim [--seeds 5] [--jobs ...] [--held-out]

Results: benchmarks/results/auto-replicas-sim/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.cluster.cluster_slowdown import MovingStraggler, SlowHost, Transient
from gradfleet.distributed.sync.common.preconditioning import preconditioners, weighted_sum_sq
from gradfleet.distributed.sync.common.replica_choice import ReplicaChoice
from gradfleet.distributed.sync.common.replicas_policy import AutoReplicas

WORKERS = 4
RAW_NOISE = False  # --raw-noise: the noise of the raw gradients, as before preconditioning
SQUARED = False  # --squared: the noise of the step P g (metric P^2), not in the metric P


# ---------------------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class Job:
    name: str
    make: Callable[[], nn.Module]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    target: float  # the evaluation loss to reach


def _classify(inputs: int, classes: int, seed: int = 7919):
    teacher = torch.randn(inputs, classes, generator=torch.Generator().manual_seed(seed))

    def batch(gen: torch.Generator, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, inputs, generator=gen)
        return x, (x @ teacher).argmax(dim=1)

    return batch


def _regress(inputs: int, seed: int = 17):
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(inputs, 64, generator=gen) / inputs**0.5, torch.randn(64, 1, generator=gen)

    def batch(gen: torch.Generator, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, inputs, generator=gen)
        return x, torch.tanh(x @ w1) @ w2 / 8

    return batch


def _mlp(inputs: int, width: int, outputs: int, layers: int) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        dims = [inputs] + [width] * layers
        body: list[nn.Module] = []
        for a, b in zip(dims, dims[1:], strict=False):
            body += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*body, nn.Linear(dims[-1], outputs))

    return make


def jobs() -> dict[str, Job]:
    classify, regress = _classify(32, 4), _regress(16)
    ce, mse = nn.functional.cross_entropy, nn.functional.mse_loss
    adam = lambda lr: lambda ps: torch.optim.Adam(ps, lr=lr)  # noqa: E731
    sgd = lambda lr: lambda ps: torch.optim.SGD(ps, lr=lr)  # noqa: E731
    mlp_c, mlp_r = _mlp(32, 128, 4, 2), _mlp(16, 256, 1, 1)
    return {
        "classify-adam": Job("classify-adam", mlp_c, adam(1e-3), classify, ce, 0.15),
        "classify-sgd": Job("classify-sgd", mlp_c, sgd(0.1), classify, ce, 0.2),
        "regress-adam": Job("regress-adam", mlp_r, adam(1e-3), regress, mse, 0.024),
        "regress-sgd": Job("regress-sgd", mlp_r, sgd(0.02), regress, mse, 0.027),
    }


# ---------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    """Round of worker ``w`` at its local step ``k``: compute x slowdown + transfer x link."""

    name: str
    slowdown: object | None = None  # anything with factor_at(host, step)
    slow_link: dict[int, float] | None = None
    compute_s: float = 3.0
    transfer_s: float = 3.0
    jitter: float = 0.05

    def round(self, worker: int, step: int, rng: random.Random) -> float:
        f = 1.0 if self.slowdown is None else self.slowdown.factor_at(worker, step)
        link = (self.slow_link or {}).get(worker, 1.0)
        base = self.compute_s * f + self.transfer_s * link
        return base * (1 + self.jitter * abs(rng.gauss(0, 1)))


def scenarios(held_out: bool) -> list[Scenario]:
    if held_out:  # not the benchmark's: tune the rule, not the scenarios
        return [
            Scenario("two-slow-hosts", SlowHost(1, 1.6)),
            Scenario("fast-moving-5x", MovingStraggler(WORKERS, 5.0, 1, first=2)),
            Scenario("transient-2x-often", Transient(2.0, 0.3, 2, seed=3)),
            Scenario("slow-link-2x", slow_link={2: 2.0}),
        ]
    return [
        Scenario("uniform"),
        Scenario("slow-link", slow_link={3: 4.0}),
        Scenario("slow-compute", SlowHost(3, 2.0)),
        Scenario("moving-straggler", MovingStraggler(WORKERS, 3.0, 3, first=3)),
        Scenario("transient", Transient(4.0, 0.1, 3, seed=0)),
    ]


# ------------------------------------------------------------------------- simulation
def simulate(job: Job, scenario: Scenario, replicas: int | str, seed: int,
             max_updates: int = 600) -> dict:  # fmt: skip
    """One run: the time the evaluation loss first fell below the target, and each R."""
    torch.manual_seed(seed)
    model = job.make()
    opt = job.optimizer(list(model.parameters()))
    eval_x, eval_y = job.batch(torch.Generator().manual_seed(99), 2048)
    gens = [torch.Generator().manual_seed(1000 * seed + w) for w in range(WORKERS)]
    rng = random.Random(seed)
    auto = replicas == "auto"
    choice = ReplicaChoice(WORKERS if auto else int(replicas), AutoReplicas() if auto else None)
    live = list(range(WORKERS))
    local = [0] * WORKERS  # each worker's own step count (its slowdowns)
    # worker -> (tag, arrival time, gradient)
    pending: dict[int, tuple[int, float, list[torch.Tensor]]] = {}

    def serve(w: int, now: float) -> None:
        choice.measured.served(w, step, now)
        grads = _gradient(model, job, gens[w])
        pending[w] = (step, now + scenario.round(w, local[w], rng), grads)
        local[w] += 1

    step, now = 0, 0.0
    r = choice.decide(step, live, now)
    for w in live:
        serve(w, now)
    accepted: list[tuple[int, list[torch.Tensor]]] = []
    while step < max_updates:
        w = min(pending, key=lambda v: pending[v][1])
        tag, now, grads = pending.pop(w)
        choice.measured.arrived(w, tag, now)
        if tag != step:  # stale: dropped, served again at once
            serve(w, now)
            continue
        accepted.append((w, grads))
        lower = choice.reconsider(step, live, now)
        r = lower or r
        if len(accepted) < r:
            continue
        _apply(opt, model, accepted, choice, step, now)
        made = [a for a, _ in accepted]
        accepted = []
        step += 1
        with torch.no_grad():
            loss = float(job.loss(model(eval_x), eval_y))
        if loss < job.target:
            return {"time": now, "updates": step, "history": choice.history}
        r = choice.decide(step, live, now)
        for a in made:
            serve(a, now)
    return {"time": float("inf"), "updates": step, "history": choice.history}


def _gradient(model: nn.Module, job: Job, gen: torch.Generator) -> list[torch.Tensor]:
    x, y = job.batch(gen)
    model.zero_grad()
    job.loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _apply(opt, model, accepted, choice: ReplicaChoice, step: int, now: float) -> None:
    k = len(accepted)
    mean = [torch.stack([g[i] for _, g in accepted]).mean(0) for i in range(len(accepted[0][1]))]
    if choice.policy is not None and k >= 2:
        weights = None if RAW_NOISE else preconditioners(opt, list(model.parameters()))
        if SQUARED and weights is not None:
            weights = [None if w is None else w.square() for w in weights]
        sum_sq = sum(float(weighted_sum_sq(g, weights)) for _, g in accepted)
        choice.measured.noise(step, sum_sq, float(weighted_sum_sq(mean, weights)), k)
    for p, m in zip(model.parameters(), mean, strict=True):
        p.grad = m
    opt.step()
    choice.made(step, now, live=range(WORKERS))


# ------------------------------------------------------------------------------ report
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--jobs", default=",".join(jobs()))
    p.add_argument("--held-out", action="store_true")
    p.add_argument("--json", default=None, help="write every run here")
    p.add_argument("--raw-noise", action="store_true", help="measure the raw gradients' noise")
    p.add_argument("--squared", action="store_true", help="the noise of P g (metric P^2)")
    p.add_argument("--only", default=None, help="comma-separated Rs to run (and auto)")
    p.add_argument("--scenarios", default=None, help="comma-separated scenario names")
    args = p.parse_args(argv)
    global RAW_NOISE, SQUARED
    RAW_NOISE, SQUARED = args.raw_noise, args.squared
    torch.set_num_threads(1)
    rows, started = [], time.monotonic()
    choices: list[int | str] = [*range(WORKERS, 0, -1), "auto"]
    if args.only:
        choices = [c if c == "auto" else int(c) for c in args.only.split(",")]
    print("| job | scenario | " + " | ".join(f"R={c}" for c in choices) + " | auto / best fixed |")
    print("|---" * (len(choices) + 3) + "|")
    for name in args.jobs.split(","):
        job = jobs()[name]
        for sc in scenarios(args.held_out):
            if args.scenarios and sc.name not in args.scenarios.split(","):
                continue
            med = {}
            for c in choices:
                runs = [simulate(job, sc, c, s) for s in range(args.seeds)]
                med[c] = statistics.median(r["time"] for r in runs)
                rows.append({"job": name, "scenario": sc.name, "R": c, "runs": runs})
            fixed = [med[c] for c in choices if c != "auto"]
            ratio = f"{med['auto'] / min(fixed):.2f}" if fixed and "auto" in med else "-"
            cells = " | ".join(f"{med[c]:.0f}" for c in choices)
            print(f"| {name} | {sc.name} | {cells} | {ratio} |", flush=True)
    print(f"\n{time.monotonic() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
