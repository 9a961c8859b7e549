"""``--servers K``: K extra processes, ranks ``N .. N+K-1`` after the ``N`` workers, that only
serve (TF's ``ps`` tasks; see ``docs/servers.md``).

Which strategies have servers to move there:

- ``sync-replicas``: ``K = 1`` puts its one server on rank ``N``; ``K > 1`` shards the variables
  over ranks ``N .. N+K-1`` (byte-balanced, the chief on rank ``N``);
- ``easgd:mode=async``: ``K = 1`` puts the centre on rank ``N``.

A server rank builds no model and writes no metrics: it calls
:class:`~gradfleet.distributed.ParameterServer` (the wrapped optimizer's factory from the run's
``optimizer``), takes part in the workers' start barrier, saves its own state into each
checkpoint directory when rank 0 asks (``rank-R.pt``, what ``serve(state=)`` resumes from), and
returns once every worker left. A server that dies makes every worker's step fail naming it;
the launcher reports it as ``dedicated server rank R failed`` -- except where it has a standby
on a worker rank (the EASGD centre and the chief of one server, by default; every shard's
server with ``standby=true``), to which its workers move. Restarted into the running job (the
launcher's ``--max-restarts``, the torchrun recipe), a server rank becomes the standby of the
server(s) that took its place, from their live state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradfleet.distributed as gfd
from gradfleet.distributed.job_control import JobControl, server_host

from .run_files import atomic_save, latest_checkpoint

__all__ = [
    "check_job_size",
    "checkpoint_servers",
    "is_server_rank",
    "lockstep",
    "run_server",
    "server_kind",
    "server_ranks",
    "validate_servers",
]

log = logging.getLogger(__name__)

TAKES_SERVERS = (
    "sync-replicas (K=1: one server, K>1: shards) and easgd:mode=async (K=1: its centre)"
)


def server_kind(name: str, args: dict[str, Any]) -> str | None:
    """``"sync"`` or ``"centre"``: what a dedicated server rank of this strategy runs."""
    if name == "sync-replicas":
        return "sync"
    if name == "easgd" and args.get("mode", "sync") == "async":
        return "centre"
    return None


def server_ranks(workers: int, servers: int) -> list[int]:
    return list(range(workers, workers + servers))


def validate_servers(
    name: str, args: dict[str, Any], workers: int, servers: int, num_params: int
) -> None:
    """Reject ``--servers`` for a strategy without servers and counts it cannot use."""
    if not servers:
        return
    kind = server_kind(name, args)
    if kind is None:
        mode = f":mode={args.get('mode', 'sync')}" if name == "easgd" else ""
        raise ValueError(
            f"--servers {servers}: strategy {name}{mode} has no server to run on a process of "
            f"its own; --servers is for {TAKES_SERVERS}"
        )
    if kind == "centre" and servers != 1:
        raise ValueError(
            f"--servers {servers}: easgd:mode=async has one centre; use --servers 1 (or 0)"
        )
    if kind == "sync":
        for key in ("shards", "transport"):
            if key in args and not (key == "transport" and args[key] == "server"):
                raise ValueError(
                    f"--servers {servers}: sync-replicas:{key}={args[key]} lays the variables "
                    "out over the workers; with --servers the dedicated processes hold them "
                    f"(leave out {key}= or --servers)"
                )
        total = args.get("total_num_replicas", workers)
        if total != workers:
            raise ValueError(
                f"--servers {servers}: sync-replicas with dedicated servers needs every worker "
                f"in the job (total_num_replicas = --workers = {workers}), got "
                f"total_num_replicas={total}"
            )
        if servers > num_params:
            raise ValueError(
                f"--servers {servers}: the workload's model has {num_params} parameter tensors, "
                f"so at most {num_params} shards (one server each)"
            )


def lockstep(args: dict[str, Any], workers: int) -> bool:
    """Sync-replicas where every worker's local step is the global step: R = N = workers and
    the one-gradient-per-worker token rule (``tokens=distinct``, the default without
    ``num_tokens``), so each update takes one gradient from every worker, of that step.  TF's
    shared queue (``tokens=shared``, or any ``num_tokens``, 0 included) hands tokens to whoever
    asks first: a fast worker may give two gradients to one update, its local step runs
    ahead, and a checkpoint at a local step then waits for ranks that are steps behind."""
    R = args.get("replicas_to_aggregate", workers - 1)
    shared = args.get("tokens") == "shared" or args.get("num_tokens", -1) != -1
    return R == workers and not shared


# ----------------------------------------------------------------------------- the job
def is_server_rank(servers: int) -> bool:
    """Whether this process (``RANK`` of ``WORLD_SIZE``) is one of the job's last ``servers``
    ranks, which only serve."""
    if not servers:
        return False
    return int(os.environ["RANK"]) >= int(os.environ["WORLD_SIZE"]) - servers


def check_job_size(servers: int, world: int, workers: int) -> None:
    """The job's processes are ``workers`` workers and ``servers`` servers (under torchrun the
    process count is the launcher's: a mismatch fails on every rank alike)."""
    if servers and world - servers != workers:
        raise RuntimeError(
            f"--servers {servers} with {world} processes leaves {world - servers} worker(s), "
            f"but --workers is {workers}: start --workers + --servers = {workers + servers} "
            "processes"
        )


def checkpoint_servers(
    control: JobControl | None, rank: int, step: int, workers: int, servers: int, timeout: float
) -> None:
    """A worker at checkpoint ``step`` (its file saved, its arrival told): every worker waits.
    Rank 0, once every live worker saved (no push in flight, so a server's state is one
    step's), asks the dedicated servers to save theirs and then releases the workers."""
    assert control is not None, "a job with dedicated servers has job control"
    if rank != 0:
        control.wait_checkpoint_released(step, 2 * timeout)  # rank 0 waits twice: both bounded
        return
    control.request_server_checkpoint(step)
    control.wait_server_checkpoints(step, server_ranks(workers, servers), timeout)
    log.info("checkpoint %d: every dedicated server saved its state", step)
    control.release_checkpoint(step)


# ----------------------------------------------------------------------------- the server rank
def _optimizer_factory(config: dict[str, Any]):
    from gradfleet.registry import create_optimizer

    return lambda groups: create_optimizer(groups, config)


def run_server(
    spec: Any, rank: int, control: JobControl | None, out: Path, rejoining: bool = False
) -> None:
    """This rank only serves: set up with the workers, save checkpoints on request, return
    once every worker left (``spec``: the run's :class:`~gradfleet.cli.spec.RunSpec`).
    ``rejoining``: restarted into the running job, it becomes the standby of the server it
    was (:meth:`~gradfleet.distributed.ParameterServer.rejoin`)."""
    assert control is not None, "a job with dedicated servers has job control"
    (out / "pids").mkdir(exist_ok=True)
    (out / "pids" / f"rank-{rank}.pid").write_text(str(os.getpid()))
    factory = _optimizer_factory(spec.optimizer)
    if rejoining:
        server = _rejoin(factory, rank, control, spec.timeout)
    else:
        state = None
        if spec.resume:
            step = latest_checkpoint(out)
            path = out / "checkpoints" / f"step-{step:07d}" / f"rank-{rank}.pt"
            state = torch.load(path, weights_only=True)
            log.info("dedicated server rank %d: resuming from %s", rank, path)
        server = gfd.ParameterServer(factory, host=server_host(), state=state)
        control.publish_server_spec(rank, server.spec)  # for this rank restarted
        log.info("dedicated server rank %d serves %s at %s", rank, server.kind, server.addresses)
        dist.barrier()  # the workers' start barrier
    # join() blocks until every worker left; checkpoint requests come meanwhile, so it runs
    # on a thread and this one watches the store.
    failed: list[BaseException] = []

    def join() -> None:
        try:
            server.join()
        except BaseException as exc:  # raised again below, on this rank's main thread
            failed.append(exc)

    joined = threading.Thread(target=join, name=f"gradfleet-serve-{rank}", daemon=True)
    joined.start()
    saved = None  # the request key lives in this job's store: a resumed job starts afresh
    while joined.is_alive():
        try:
            asked = control.server_checkpoint_requested()
        except dist.DistError as exc:  # rank 0 ended the job, and its store with it
            joined.join()  # every worker left or went silent: the servers stop by themselves
            log.info("dedicated server rank %d: the job's store is gone: %s", rank, exc)
            break
        if asked is not None and asked != saved:
            _save(out, asked, rank, server)
            control.server_checkpoint_saved(asked, rank)
            saved = asked
        joined.join(0.05)
    if failed:
        raise failed[0]
    log.info("dedicated server rank %d: every worker left", rank)


def _rejoin(factory: Any, rank: int, control: JobControl, timeout: float) -> Any:
    """This dedicated server rank, restarted into the running job: the standby of the server
    its standby on a worker rank took over, from that server's live state."""
    served = control.server_spec(rank)
    if served is None:
        raise RuntimeError(
            f"dedicated server rank {rank}: the running job published nothing it served, so "
            "it cannot rejoin; resume the job from its last checkpoint"
        )
    address = control.reachable_server_address(timeout)  # where the server lives now
    if address is None:
        raise RuntimeError(f"dedicated server rank {rank}: the running job has no server")
    server = gfd.ParameterServer.rejoin(
        factory, spec=served, address=address, rank=rank, host=server_host()
    )
    step = control.progress()
    control.mark_rejoined(rank, step, os.getpid())
    log.info("dedicated server rank %d rejoined at step %d: the standby of %s", rank, step,
             address)  # fmt: skip
    print(f"dedicated server rank {rank} rejoined the running job at step {step}", flush=True)
    return server


def _save(out: Path, step: int, rank: int, server: gfd.ParameterServer) -> None:
    """Every worker waits at checkpoint ``step`` while this runs: nothing is in flight."""
    ckpt_dir = out / "checkpoints" / f"step-{step:07d}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    atomic_save(server.state_dict(), ckpt_dir / f"rank-{rank}.pt")
    log.info(
        "dedicated server rank %d: checkpoint of step %d saved in %.3fs",
        rank, step, time.perf_counter() - start,
    )  # fmt: skip
