"""One replica of the failover benchmark's comparison rows: torchft's fault-tolerant DDP, or
plain DDP, training the cluster benchmark's MLP on one emulated host.

    python benchmarks/cluster/torchft_worker.py --mode torchft|ddp --rank R --world N
        --addresses A0,A1,... --port P --out DIR [--lighthouse http://ADDR:29510]
        [--params 1e6] [--device-time 0] [--steps 40] [--rejoin]

``--mode torchft``: one replica group of one process per host (torchft's ``Manager`` with its
``DistributedDataParallel`` and ``OptimizerWrapper``, gloo, state healed over the process group
by ``PGTransport``), each group's own ``TCPStore`` on its host's address, the quorum from the
Lighthouse the benchmark runs on the store's host.  A replica started with ``--rejoin`` skips
the start barrier and heals from a live peer at its first quorum, as torchft's live recovery
does.  ``--mode ddp``: ``torch.nn.parallel.DistributedDataParallel`` on one gloo group of N
(the baseline: no recovery, a lost rank ends the job).

Same model, optimizer and batches as the cluster benchmark's workers (Adam, lr 1e-3, batch 32,
each rank's batches drawn from its own generator).  Rank 0 appends ``{"step", "loss", "wall"}``
to ``<out>/metrics.jsonl`` after each committed update (torchft: its step counter advanced, so
an update a failure voided is not logged); every rank writes ``<out>/pids/rank-R.pid`` once it
has made its first update (for a rejoined replica: once it trains again after healing).
``faulthandler`` dumps every thread and exits after ``--deadline`` seconds: a hang is
reported, not waited on.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script

from benchmarks.cluster.cluster_worker import Teacher, build_model  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("torchft", "ddp"), required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--addresses", required=True, help="every host's address, by rank")
    p.add_argument("--port", type=int, required=True, help="this replica's own store")
    p.add_argument("--barrier-port", type=int, default=0, help="torchft: the start barrier's "
                   "store, on rank 0's address (default: --port + 1)")  # fmt: skip
    p.add_argument("--lighthouse", default="", help="torchft: the Lighthouse's http address")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--params", type=float, default=1e6)
    p.add_argument("--device-time", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--timeout", type=float, default=5.0, help="the gloo group's timeout, s")
    p.add_argument("--rejoin", action="store_true", help="torchft: a restarted replica")
    p.add_argument("--deadline", type=float, default=600.0)
    return p.parse_args(argv)


class Record:
    """Rank 0's metrics lines and every rank's pid file (the failover harness reads both)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.start = args, time.monotonic()
        self.pid_written = False
        (args.out / "pids").mkdir(parents=True, exist_ok=True)

    def update(self, step: int, loss: float) -> None:
        if not self.pid_written:
            path = self.args.out / "pids" / f"rank-{self.args.rank}.pid"
            path.write_text(str(os.getpid()))
            self.pid_written = True
        if self.args.rank == 0:
            line = {"step": step, "loss": loss, "wall": round(time.monotonic() - self.start, 4)}
            with open(self.args.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")


def start_barrier(args: argparse.Namespace, address: str) -> None:
    """Every replica's manager exists before any asks for a quorum, so the first quorum has
    all N (the Lighthouse issues one as soon as the replicas it hears from have joined)."""
    port = args.barrier_port or args.port + 1
    store = dist.TCPStore(address, port, args.world, args.rank == 0,
                          timeout=timedelta(seconds=120))  # fmt: skip
    store.add("ready", 1)
    store.wait(["go"] if args.rank else [], timedelta(seconds=120))
    if args.rank == 0:
        while int(store.add("ready", 0)) < args.world:
            time.sleep(0.02)
        store.set("go", "1")


def train_torchft(args: argparse.Namespace, addresses: list[str]) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    me = addresses[args.rank]
    # as torchft's train_ddp.py: the gloo group's timeout short (a receive whose sender died
    # waits it out), the manager's and the heal's long enough for a whole state's transfer
    timeout = timedelta(seconds=args.timeout)
    long = timedelta(seconds=max(30.0, args.timeout))
    own_store = dist.TCPStore(me, args.port, 1, True, wait_for_workers=False)  # noqa: F841
    model = build_model(args.params, seed=0, device_time=args.device_time)
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   inner.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"cluster_{args.rank}",
        store_addr=me, store_port=args.port, rank=0, world_size=1,
        lighthouse_addr=args.lighthouse, hostname=me,
        timeout=long, quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=long, device=torch.device("cpu")),
    )  # fmt: skip
    if not args.rejoin:
        start_barrier(args, addresses[0])
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    teacher, record = Teacher(0), Record(args)
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum (and the heal of a rejoined replica)
        x, y = teacher.batch(32, args.rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()  # commits only if every replica's all-reduce succeeded
        if manager.current_step() > step:
            record.update(manager.current_step(), float(loss))
    manager.shutdown(wait=False)


def train_ddp(args: argparse.Namespace, addresses: list[str]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://{addresses[0]}:{args.port}", rank=args.rank,
        world_size=args.world, timeout=timedelta(seconds=args.timeout),
    )  # fmt: skip
    model = build_model(args.params, seed=0, device_time=args.device_time)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher, record = Teacher(0), Record(args)
    for step in range(args.steps):
        optimizer.zero_grad()
        x, y = teacher.batch(32, args.rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        record.update(step + 1, float(loss))
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    torch.set_num_threads(1)
    addresses = args.addresses.split(",")
    if len(addresses) != args.world:
        raise SystemExit(f"--addresses: {len(addresses)} given for --world {args.world}")
    if args.mode == "torchft":
        train_torchft(args, addresses)
    else:
        train_ddp(args, addresses)
    sys.stdout.flush()
    os._exit(0)  # torchft's server threads do not all stop on shutdown


if __name__ == "__main__":
    sys.exit(main())
