"""A job for the emulated-cluster tests, started by torchrun on each host (one worker per host).

SyncReplicas, ``R = N - 1`` of ``N`` workers (one backup), the variables sharded over the
ranks on hosts 0 and 1, a small MLP learning a teacher's labels (the benchmark's workload);
``--all``: R = N, shards on every rank, laid out for the job from the model.  ``--plain-end``:
the program ends as a user's does (``close()``, then the interpreter's exit) instead of
``os._exit(0)`` once its record is written; ``--no-close`` leaves ``close()`` out, as a program
that forgets it does.

``--kill-host H --kill-at S``: the worker on host H is SIGKILLed once the other workers made S
local steps (a machine lost mid-run; it is not a shard host unless H is 0 or 1): at their step
S the others ask for it (a marker file), a thread of the victim kills its process wherever
it is, even blocked in a step, and the others go on once it has.  Every other worker keeps
stepping until ``--steps`` updates or an error; it writes ``<out>/host-<h>.json`` with its
losses, the global step reached, every error it saw (type and message) and how long its
``close()`` took, once done.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.cluster.cluster_worker import Teacher, build_model  # noqa: E402

import gradfleet.distributed as gfd  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-host", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=10)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument(
        "--all",
        action="store_true",
        help="R = N, shards on every rank, the model given (laid out for the job)",
    )
    p.add_argument(
        "--plain-end",
        action="store_true",
        help="end as a user's script does: close, then the interpreter's own exit",
    )
    p.add_argument("--no-close", action="store_true", help="never call close()")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    info = gfd.init(backend="gloo", timeout=60)
    host = int(os.environ["GF_CLUSTER_HOST"])
    hosts = [0] * info.world_size
    dist.all_gather_object(hosts, host)
    model, teacher = build_model(2e4, 0), Teacher(0)
    everyone = list(range(info.world_size))
    opt = gfd.SyncReplicasOptimizer(
        torch.optim.Adam(model.parameters(), lr=3e-3),
        replicas_to_aggregate=info.world_size - (0 if args.all else 1),
        total_num_replicas=info.world_size,
        timeout=args.timeout,
        last_step=args.steps,
        host=os.environ["GF_CLUSTER_ADDR"],
        server_ranks=everyone if args.all else [hosts.index(0), hosts.index(1)],
        model=model if args.all else None,
    )
    record: dict = {"rank": info.rank, "hosts": hosts, "losses": [], "errors": []}
    local = 0
    args.out.mkdir(parents=True, exist_ok=True)
    if host == args.kill_host:
        threading.Thread(target=_die_when_asked, args=(args.out, host), daemon=True).start()
    try:
        while opt.global_step < args.steps:
            if args.kill_host >= 0 and host != args.kill_host and local == args.kill_at:
                (args.out / f"die-{args.kill_host}").touch()
                _wait_for(args.out / f"killed-{args.kill_host}")  # the loss is mid-run
            x, y = teacher.batch(32, info.rank, local)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            record["losses"].append(float(loss.detach()))
            local += 1
    except Exception as err:  # recorded: the test checks which errors every worker saw
        record["errors"].append({"type": type(err).__name__, "message": str(err)})
    record["global_step"] = opt.global_step
    if record["errors"]:
        time.sleep(3)  # a shard host that saw the error keeps serving while the others see it
    elif not args.no_close:
        started = time.monotonic()
        opt.close()  # a server rank serves until every worker left
        record["close_s"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"host-{host}.json").write_text(json.dumps(record))  # written last: done
    if not args.plain_end:
        os._exit(0)  # a dead peer can leave gloo's teardown waiting: the record is written


def _die_when_asked(out: Path, host: int) -> None:
    """The victim's own killer: a slow victim, blocked in a step the others' hold stops, could
    never reach a step count of its own (R = N - 1 needs none of its gradients)."""
    _wait_for(out / f"die-{host}", timeout=600.0)
    (out / f"killed-{host}").touch()
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(marker: Path, timeout: float = 120.0) -> None:
    """Hold this worker until ``marker`` exists (the victim died, or is asked to)."""
    end = time.monotonic() + timeout
    while not marker.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{marker.name} did not appear in {timeout:g} s")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
