"""A rank restarted by ``gradfleet train --max-restarts 1``, on one machine: how soon it trains
again, and how long the others stall.

Each run trains the cluster benchmark's MLP (``benchmarks/cluster/mlp_workload.py``,
``--params`` parameters, Adam) on ``--workers`` local ranks under ``--strategy`` (default: R =
2 of 3 without a server, every rank keeping the state), SIGKILLs rank ``--kill`` once the
writer logged update ``--kill-at``, and lets the launcher start it again. From the run's own
files:

* *restart to rejoin*: seconds from the SIGKILL to the restarted process's log line saying it
  rejoined the running job (the launcher's detection, the fork from its forkserver -- torch
  already imported --, the set-up and the heal from a live member's state: no file read);
* *back in an update*: on the writer's clock, from the update after which the rank was
  killed to the update at which the group's record (``membership_changes``) has it joined
  again (the restarted rank trains again with the others);
* *longest gap*: the longest time between two consecutive updates in the writer's
  ``metrics.jsonl`` (the survivors' stall), against the run's median update.

    python -m benchmarks.distributed.launcher_restart [--params 1e7] [--runs 3]

Writes ``--out``.json and .md (default ``benchmarks/results/launcher-restart``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "benchmarks" / "cluster" / "mlp_workload.py"
REJOINED = re.compile(r"^(\S+ \S+) .*rejoined the running job at step (\d+)", re.M)


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]  # whole lines only
    return [json.loads(line) for line in lines if line.strip()]


def _wall_of_log(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_run(args: argparse.Namespace, work: Path) -> dict:
    out = work / "run"
    cmd = [
        sys.executable, "-m", "gradfleet", "train", "-w", str(WORKLOAD), "-s", args.strategy,
        "-n", str(args.workers), "--steps", str(args.steps), "--max-restarts", "1",
        "--log-level", "info", "--out", str(out), "-q",
    ]  # fmt: skip
    env = {**os.environ, "GF_MLP_PARAMS": str(args.params)}
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + args.deadline
    try:
        while time.monotonic() < deadline:
            done = [r["step"] for r in _records(out) if "loss" in r]
            if done and done[-1] >= args.kill_at:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before update {args.kill_at}")
            time.sleep(0.05)
        pid = int((out / "pids" / f"rank-{args.kill}.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        console, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {console[-2000:]}")
    logs = sorted((out / "logs" / f"rank-{args.kill}").glob("restart-1/**/stderr.log"))
    found = REJOINED.search(logs[0].read_text()) if logs else None
    if found is None:
        raise RuntimeError("the restarted rank did not log its rejoin")
    rejoined = _wall_of_log(found.group(1)) - killed
    recs = [r for r in _records(out) if "loss" in r]
    walls = [r["wall"] for r in recs]
    wall_at = {r["step"]: r["wall"] for r in recs}  # (the first record of each update)
    gaps = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    summary = json.loads((out / "summary.json").read_text())
    joined = [c for c in summary.get("membership_changes") or [] if c["event"] == "joined"]
    back = None
    if joined and joined[0]["global_step"] in wall_at:
        back = wall_at[joined[0]["global_step"]] - wall_at[args.kill_at]
    return {
        "rejoin_s": round(rejoined, 3),
        "back_in_update_s": None if back is None else round(back, 3),
        "longest_gap_s": round(max(gaps), 3),
        "median_update_s": round(statistics.median(gaps), 3),
        "rejoined_workers": summary["rejoined_workers"],
        "lost_workers": summary["lost_workers"],
        "updates": len(recs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e7)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--strategy", default="sync-replicas:replicas_to_aggregate=2")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kill", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=600)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/launcher-restart")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="gf-restart-") as tmp:
            runs.append(one_run(args, Path(tmp)))
        print(f"run {i + 1}: {runs[-1]}", flush=True)
    med = {
        key: statistics.median(r[key] for r in runs if r[key] is not None)
        for key in ("rejoin_s", "back_in_update_s", "longest_gap_s", "median_update_s")
    }
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.with_suffix(".json").write_text(
        json.dumps({"config": config, "runs": runs, "median": med}, indent=2) + "\n"
    )
    rows = [
        "| run | kill to rejoin (s) | back in an update (s) | longest gap (s) | "
        "median update (s) |",
        "|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        rows.append(f"| {i} | {r['rejoin_s']} | {r['back_in_update_s']} | "
                    f"{r['longest_gap_s']} | {r['median_update_s']} |")  # fmt: skip
    rows.append(f"| median | {med['rejoin_s']} | {med['back_in_update_s']} | "
                f"{med['longest_gap_s']} | {med['median_update_s']} |")  # fmt: skip
    command = "python -m benchmarks.distributed.launcher_restart " + " ".join(sys.argv[1:])
    args.out.with_suffix(".md").write_text(
        f"# A rank restarted by `gradfleet train --max-restarts 1`\n\n    {command}\n\n"
        f"{args.params:g} parameters, `{args.strategy}`, {args.workers} ranks on loopback, rank "
        f"{args.kill} SIGKILLed after update {args.kill_at}.\n\n" + "\n".join(rows) + "\n"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
