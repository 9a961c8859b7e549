"""Fault report: K jobs per strategy and launcher, a random worker SIGKILLed at a random step.

For each job: start it as a user would (``gradfleet train -n N``; under torchrun, the recipe
of docs/failures.md -- one agent per worker, ``--max-restarts=1`` -- for strategies that can
lose a worker, ``torchrun --nproc-per-node N`` for the others), wait until rank 0 logged the chosen
step, SIGKILL the chosen rank (``--rank R``, or at random: 0..N-1 where the launcher hosts the
store and rank 0 can be replaced -- sync-replicas without a server, async EASGD whose centre
has a standby, under ``gradfleet train``; else 1..N-1: rank 0 hosts the servers or the store,
and is always fatal), and
classify the end: *completed* (exit 0 everywhere, the summary written), *failed fast* (a
non-zero exit, with the seconds from the kill to the last process's end), or *hung* (nothing
ended within ``--deadline`` seconds; everything is then killed). *Steps lost*: the model
updates a failed job had made (lost without checkpoints); 0 for a completed one.

The strategies: every one of the CLI's table that starts a process per worker
(:data:`gradfleet.cli.strategy_table.STRATEGIES`), with the option sets of :data:`OPTIONS`;
whether a job can lose a worker is the table's ``tolerated_losses``.

    python -m benchmarks.distributed.faults --jobs 2 --json benchmarks/results/faults.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from gradfleet.cli.config import parse_spec
from gradfleet.cli.strategy_table import (
    STRATEGIES,
    rank0_replaceable,
    tolerated_losses,
    validate_strategy,
)

# Each strategy's option sets, one job kind each (a strategy not named here: one kind, with its
# defaults).
OPTIONS: dict[str, list[dict[str, Any]]] = {
    "model-average": [{"interval": 4}],
    "easgd": [{"period": 4}, {"mode": "async", "period": 4}],
    # with the default 3 workers: one backup, and none
    "sync-replicas": [{"replicas_to_aggregate": 2}, {"replicas_to_aggregate": 3}],
}


def configurations() -> list[str]:
    """The ``--strategy`` of each job kind: the table's strategies that start a process per
    worker, each with its option sets."""
    out = []
    for name, info in STRATEGIES.items():
        if not info.spawns:
            continue
        for args in OPTIONS.get(name, [{}]):
            text = ",".join(f"{k}={v}" for k, v in args.items())
            out.append(f"{name}:{text}" if text else name)
    return out


def lockstep(strategy: str, workers: int) -> bool:
    """A job that cannot lose a worker: under torchrun it runs with --nproc-per-node N (the
    per-worker recipe refuses it); the others with the recipe, one agent per worker."""
    name, args = parse_spec(strategy, "strategy")
    return tolerated_losses(name, args, workers) == 0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(ln)["step"] for ln in lines if '"loss"' in ln]
    return steps[-1] if steps else 0


def _start(
    launcher: str, strategy: str, workers: int, steps: int, out: Path, servers: int = 0
) -> list:
    train = ["-m", "gradfleet", "train", "-s", strategy, "-n", str(workers)]
    train += ["--steps", str(steps), "--out", str(out), "-q", "--servers", str(servers)]
    common = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    if launcher == "cli":
        return [subprocess.Popen([sys.executable, *train], **common)]
    agent = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    agent += ["--monitor-interval=0.2"]
    if lockstep(strategy, workers):  # torch's own launch: one agent for the N workers
        return [subprocess.Popen([*agent, f"--nproc-per-node={workers}", *train], **common)]
    port, procs = _port(), []
    for r in range(workers):
        env = dict(os.environ, GRADFLEET_RANK=str(r), GRADFLEET_WORLD_SIZE=str(workers))
        env.update(GRADFLEET_MASTER_ADDR="127.0.0.1", GRADFLEET_MASTER_PORT=str(port))
        one = [*agent, "--nproc-per-node=1", "--max-restarts=1"]
        procs.append(subprocess.Popen([*one, *train], env=env, **common))
    return procs


def _kill_all(procs: list, out: Path) -> None:
    """End each launcher's session and the workers named in ``out/pids`` (torchrun starts its
    workers in sessions of their own)."""
    running = [p for p in procs if p.poll() is None]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for pid_file in (out / "pids").glob("*.pid") if running else ():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def run_job(
    launcher: str, strategy: str, workers: int, steps: int, rng, deadline: float,
    rank: int | None = None, servers: int = 0,
) -> dict:  # fmt: skip
    name, args = parse_spec(strategy, "strategy")
    lowest = 0 if launcher == "cli" and rank0_replaceable(name, args, workers) else 1
    at = rng.randint(steps // 10, steps * 6 // 10)
    if rank is None:
        rank = rng.randrange(lowest, workers)
    with tempfile.TemporaryDirectory(prefix="gf-faults-") as tmp:
        out = Path(tmp) / "run"
        procs = _start(launcher, strategy, workers, steps, out, servers)
        end = time.monotonic() + deadline
        try:
            while _last_step(out) < at:  # wait for the chosen step
                if time.monotonic() > end or any(p.poll() is not None for p in procs):
                    return {"outcome": "error", "detail": "ended or stalled before the kill"}
                time.sleep(0.05)
            pid = int((out / "pids" / f"rank-{rank}.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            while any(p.poll() is None for p in procs) and time.monotonic() < end:
                time.sleep(0.05)
            took = time.monotonic() - killed
            job = {"rank": rank, "killed_at": at, "seconds_after_kill": round(took, 2)}
            if any(p.poll() is None for p in procs):
                return {**job, "outcome": "hung", "steps_lost": _last_step(out)}
            ok = all(p.returncode == 0 for p in procs) and (out / "summary.json").is_file()
            outcome = "completed" if ok else "failed"
            return {**job, "outcome": outcome, "steps_lost": 0 if ok else _last_step(out)}
        finally:
            _kill_all(procs, out)


def summarise(jobs: list[dict]) -> dict:
    failed = [j for j in jobs if j["outcome"] == "failed"]
    return {
        "jobs": len(jobs),
        "completed": sum(j["outcome"] == "completed" for j in jobs),
        "failed_fast": len(failed),
        "failed_after_s": median(j["seconds_after_kill"] for j in failed) if failed else None,
        "hung": sum(j["outcome"] == "hung" for j in jobs),
        "errors": sum(j["outcome"] == "error" for j in jobs),
        "steps_lost": [j.get("steps_lost") for j in jobs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="jobs per strategy and launcher (K)")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--launchers", default="cli,torchrun")
    ap.add_argument("--strategy", action="append", help="repeat; default: every kind")
    ap.add_argument("--deadline", type=float, default=240, help="seconds before 'hung'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rank",
        type=int,
        default=None,
        help="kill this rank in every job (default: a random one it may lose)",
    )
    ap.add_argument(
        "--servers",
        type=int,
        default=0,
        help="dedicated server ranks after the workers (gradfleet train --servers; with "
        "--launchers cli): --rank N kills the first",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.servers and args.launchers != "cli":
        ap.error("--servers: with --launchers cli (the torchrun recipe starts no server rank)")
    rng = random.Random(args.seed)
    strategies = args.strategy or configurations()
    for strategy in strategies:  # a clear error before any job starts
        try:
            validate_strategy(*parse_spec(strategy, "strategy"), args.workers)
        except ValueError as err:
            ap.error(f"--strategy {strategy}: {err}")
    report = []
    print(f"{'launcher':9} {'strategy':40} {'done':>4} {'fast':>4} {'after s':>8} {'hung':>4} "
          "steps lost")  # fmt: skip
    for launcher in args.launchers.split(","):
        for strategy in strategies:
            jobs = [
                run_job(
                    launcher,
                    strategy,
                    args.workers,
                    args.steps,
                    rng,
                    args.deadline,
                    args.rank,
                    args.servers,
                )  # fmt: skip
                for _ in range(args.jobs)
            ]
            row = {"launcher": launcher, "strategy": strategy, **summarise(jobs), "runs": jobs}
            report.append(row)
            after = "-" if row["failed_after_s"] is None else f"{row['failed_after_s']:.1f}"
            print(
                f"{launcher:9} {strategy:40} {row['completed']:>4} {row['failed_fast']:>4} "
                f"{after:>8} {row['hung']:>4} {row['steps_lost']}",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"workers": args.workers, "servers": args.servers, "steps": args.steps,
                "jobs": args.jobs}  # fmt: skip
        args.json.write_text(json.dumps({"config": meta, "rows": report}, indent=2) + "\n")


if __name__ == "__main__":
    main()
