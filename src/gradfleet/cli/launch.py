"""Run the worker loop: in this process, or as N local ranks started by torch's elastic
multiprocessing (``start_processes``), one process context per rank.

Ranks are forked by a ``forkserver``: a fresh interpreter that imports torch (and the lazily
loaded ``torch._dynamo`` an optimizer's first step needs) once, then forks each rank from that
clean state. A rank starts without re-importing torch, which ``spawn`` would do in every rank
at once (seconds of CPU each); the server never touches CUDA nor inherits this process's
threads, so each rank initialises its own device as under ``spawn`` (still the start method
where a platform has no forkserver).

Ranks rendezvous on a TCPStore this process hosts on loopback (``env://`` with the launcher's
store, as torchrun's agent does); their stdout/stderr go to ``<run>/logs/rank-R``, and
``<run>/workers.json`` maps ranks to process ids and logs. Which exit is fatal is the
strategy's (``tolerated_losses``): a worker lost while the wrapper can do without it
(sync-replicas with a backup left, asynchronous EASGD) is reported -- console, then rank 0's
``metrics.jsonl`` and ``summary.json`` through the job store -- and the survivors finish the
run (with ``--max-restarts K`` the launcher starts the lost rank again, up to K times each, and
it rejoins the running job from a live peer's state, as under the torchrun recipe); any other
failure (rank 0, a loss during start-up, lockstep strategies, no backup left, a
dedicated server rank of ``--servers``) ends every survivor at once and raises
:class:`WorkerFailed` (a lost server: after the workers had a few seconds to fail on their
own, naming it).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from gradfleet.distributed.job_control import JobControl

from .exit_times import ExitTimes
from .run_files import last_logged_step
from .spec import RunSpec
from .strategy_table import rank0_replaceable, server_replaceable, tolerated_losses
from .worker import run_worker

__all__ = ["WorkerFailed", "run_local", "launch"]

log = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """A rank failed: ``str()`` is one line naming the rank, the cause and its log."""


def run_local(spec: RunSpec) -> dict[str, Any] | None:
    """One process (``none``, ``towers``, or this rank under torchrun)."""
    return run_worker(spec)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no error message"


def _rank_log(log_dir: Path, rank: int) -> Path | None:
    """The stderr log of ``rank``'s latest process (a restarted one's is newest)."""
    logs = (log_dir / f"rank-{rank}").glob("**/stderr.log")
    return max(logs, key=lambda p: p.stat().st_mtime_ns, default=None)


def _error_text(message: Any) -> str | None:
    """The last line of an error-file payload (``{"message": ..., "extraInfo": ...}``)."""
    if isinstance(message, dict):
        message = message.get("message", message)
    return _last_line(str(message)) if message else None


def _cause(failure: Any) -> str:
    if failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode}"
    return _error_text(failure.message) or f"exit code {failure.exitcode}"


RANK_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "gradfleet.cli.worker")
"""What the forkserver imports before it forks the ranks: none of it initialises CUDA."""
# where a platform has no forkserver (Windows), each rank is a fresh interpreter
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _start(
    spec: RunSpec, rank: int, world: int, port: int, run_id: str, log_dir: Path, restart: int = 0
):
    """Start ``rank``'s process; ``restart`` > 0: the rank's restart number ``restart``, which
    joins the running job as the torchrun recipe's restarted process does (``GRADFLEET_*``:
    :func:`~gradfleet.distributed.job_control.apply_job_env`), not its process group."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store below, hosted here
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
    }
    logs = log_dir / f"rank-{rank}"
    if restart:
        logs = logs / f"restart-{restart}"
        env.update(
            GRADFLEET_RANK=str(rank),
            GRADFLEET_WORLD_SIZE=str(world),
            GRADFLEET_MASTER_ADDR="127.0.0.1",
            GRADFLEET_MASTER_PORT=str(port),
            GRADFLEET_STORE="own",  # this process's store: every rank is its client
        )
    return start_processes(
        name=f"gradfleet-rank{rank}",
        entrypoint=run_worker,
        args={0: (spec,)},
        envs={0: env},
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL),
        start_method=START_METHOD,
    )


SERVER_LOSS_GRACE_S = 10.0
"""How long the workers of a lost dedicated server get to fail on their own (each step raises
``ServerUnreachable`` naming the server, written to its log) before they are ended."""


def _reported_error(log_dir: Path, rank: int) -> str | None:
    """The error a rank's process wrote (torch elastic's ``error.json``, next to its
    ``stderr.log``) before its exit: on a loaded machine the interpreter's teardown can take
    seconds after that."""
    log_file = _rank_log(log_dir, rank)
    if log_file is None:
        return None
    try:
        message = json.loads((log_file.parent / "error.json").read_text())["message"]
    except (OSError, ValueError, KeyError, TypeError):  # not written (yet), or partly
        return None
    return _error_text(message)


def _let_workers_fail(running: dict[int, Any], workers: int, log_dir: Path) -> str:
    """Wait (at most the grace) until every worker has ended or reported an error: each is to
    fail on its own, with an error naming the lost server, before the survivors are ended.
    Returns what the first worker to fail said (or "")."""
    deadline = time.monotonic() + SERVER_LOSS_GRACE_S
    ended: dict[int, Any] = {}
    said: dict[int, str] = {}  # in the order the workers failed
    while True:
        for r, pc in running.items():
            if r >= workers or r in ended:
                continue
            result = pc.wait(0)
            if result is not None:
                ended[r] = result
                if result.is_failed() and r not in said:
                    said[r] = _cause(result.failures[0])
            elif r not in said and (reported := _reported_error(log_dir, r)) is not None:
                said[r] = reported  # failed, still tearing down: closed by the caller
        if all(r in ended or r in said for r in running if r < workers):
            break
        if time.monotonic() >= deadline:
            log.info(
                "workers still running %.0fs after a server loss: ending them",
                SERVER_LOSS_GRACE_S,
            )
            break
        time.sleep(0.1)
    for r in ended:
        running.pop(r)
    first = next(iter(said), None)
    return "" if first is None else f"; worker rank {first}: {said[first]}"


EXIT_REPORT_S = 2.0
"""How long a rank's exit, seen by the kernel, may take to be reported by its process context."""


def _reports_of_the_exited(running: dict[int, Any], ended: dict[int, Any], exits: ExitTimes):
    """The results of the ranks the kernel saw exit that have not been reported yet: a
    killed rank's report can come a polling round after that of the peer it broke, which
    would then be named as the failure."""
    exits.in_exit_order(ended)  # lets the watching thread note these, and all before them
    waiting = (exits.exited() & running.keys()) - ended.keys()
    found: dict[int, Any] = {}
    deadline = time.monotonic() + EXIT_REPORT_S
    while waiting and time.monotonic() < deadline:
        for r in list(waiting):
            if (res := running[r].wait(0)) is not None:
                found[r] = res
                waiting.discard(r)
        if waiting:
            time.sleep(0.02)
    return found


def launch(spec: RunSpec) -> dict[str, Any] | None:
    """Start ``spec.workers`` ranks of :func:`run_worker` on loopback, and ``spec.servers``
    dedicated server ranks after them; rank 0's summary."""
    import torch.distributed as dist

    # read when the forkserver starts, with the first rank; a later launch finds it running
    multiprocessing.set_forkserver_preload(list(RANK_PRELOAD))
    # The elastic code logs each failure with a traceback; the CLI reports it as one line.
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    workers, out = spec.workers, Path(spec.out)
    world = workers + spec.servers
    log_dir = out / "logs"
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=spec.timeout),
    )  # fmt: skip
    job = JobControl(store, workers)
    run_id = f"gradfleet-{uuid.uuid4().hex[:8]}"
    tolerated = tolerated_losses(spec.strategy, spec.strategy_args, workers)
    # the store is this process's: where every rank holds the state, rank 0 may go too
    any_rank = not spec.servers and rank0_replaceable(
        spec.strategy, spec.strategy_args, workers, spec.device
    )
    # the server ranks whose loss a standby on a worker rank takes over: each once, until a
    # restarted process of it is back (with --servers K, every server has a standby of its own)
    replaceable = bool(spec.servers) and server_replaceable(
        spec.strategy, spec.strategy_args, workers, spec.servers
    )
    server_spares = set(range(workers, world)) if replaceable else set()
    # servers first: each round of polling sees a dead server before the workers it failed
    order = [*range(workers, world), *range(workers)]
    running = {r: _start(spec, r, world, store.port, run_id, log_dir) for r in order}
    pids = {r: pc.pids()[0] for r, pc in running.items()}
    (out / "workers.json").write_text(json.dumps({"pids": pids, "logs": str(log_dir)}) + "\n")
    log.info(
        "started %d worker and %d dedicated server ranks: pids %s, logs under %s",
        workers, spec.servers, pids, log_dir,
    )  # fmt: skip
    exits = ExitTimes(pids)
    lost: dict[int, str] = {}
    restarts: dict[int, int] = {}  # rank -> how often it was restarted

    def _restart(rank: int) -> str:
        """Start ``rank`` again, into the running job; what the warning says of it."""
        restarts[rank] = restarts.get(rank, 0) + 1
        running[rank] = _start(spec, rank, world, store.port, run_id, log_dir, restarts[rank])
        exits.watch(rank, running[rank].pids()[0])
        return f"restarting it ({restarts[rank]} of {spec.max_restarts})"

    summary = None
    try:
        while running:
            ended = {r: res for r, pc in running.items() if (res := pc.wait(0)) is not None}
            if any(res.is_failed() for res in ended.values()):
                ended.update(_reports_of_the_exited(running, ended, exits))
            for rank in exits.in_exit_order(ended):  # the first to die is the cause
                result = ended[rank]
                del running[rank]
                if not result.is_failed():
                    # the writing rank's (rank 0, or the one that took over from it)
                    summary = result.return_values.get(0) or summary
                    continue
                rank_log = _rank_log(log_dir, rank)
                cause = _cause(result.failures[0])
                where = f"log: {rank_log}" if rank_log else f"logs under {log_dir}"
                role = "dedicated server" if rank >= workers else "worker"
                if summary is not None:  # after rank 0 saved the results: report only
                    print(f"warning: {role} rank {rank} failed after the end: {cause}; {where}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    continue
                # a server rank restarted into the job is a live copy of the server again
                server_spares |= {r for r in range(workers, world) if _is_back(job, running, r)}
                if rank >= workers and rank in server_spares and job.started():
                    # its standby on a worker rank takes over: the workers move to it (or,
                    # this rank having rejoined as that server's standby, the server goes on)
                    server_spares.discard(rank)  # none left for it, until it is back
                    step = last_logged_step(out / "metrics.jsonl")
                    job.mark_lost(rank, step=step, cause=cause, log=str(rank_log), role=role)
                    # a restarted server rank held the live server's copy, or was promoted
                    copy = "its live copy serves" if rank in restarts else "its standby took over"
                    then = ""
                    if restarts.get(rank, 0) < spec.max_restarts:
                        # it rejoins as the live servers' standby (ParameterServer.rejoin)
                        then = "; " + _restart(rank)
                    print(
                        f"warning: {role} rank {rank} lost: {cause}; {where}; {copy}, "
                        f"training goes on{then}",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                if rank >= workers:  # a dedicated server: every worker depends on it
                    log.info("dedicated server rank %d failed (%s): fatal", rank, cause)
                    seen = _let_workers_fail(running, workers, log_dir)
                    raise WorkerFailed(f"{role} rank {rank} failed: {cause}; {where}{seen}")
                started = job.started()
                _forget_the_rejoined(lost, job, running)
                if (
                    (rank == 0 and not any_rank)
                    or not started
                    or (rank not in lost and len(lost) >= tolerated)
                ):
                    why = (
                        "rank 0" if rank == 0 and not any_rank
                        else "the strategy cannot lose a worker" if not tolerated
                        else "before training started" if not started
                        else f"{tolerated} tolerated loss(es) already"
                    )  # fmt: skip
                    log.info("rank %d failed (%s): fatal (%s); ending the others", rank, cause, why)
                    raise WorkerFailed(f"worker rank {rank} failed: {cause}; {where}")
                step = last_logged_step(out / "metrics.jsonl")
                lost[rank] = cause
                job.mark_lost(rank, step=step, cause=cause, log=str(rank_log))
                then = ""
                if restarts.get(rank, 0) < spec.max_restarts:
                    # it rejoins the running job from a live peer's state (a server's, or the
                    # members'), as under the torchrun recipe's --max-restarts
                    then = "; " + _restart(rank)
                print(
                    f"warning: worker rank {rank} lost at step {step}: {cause}; {where}; "
                    f"training goes on with {workers - len(lost)} of {workers} workers "
                    f"({tolerated - len(lost)} more loss(es) tolerated){then}",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.1)
    finally:
        for pc in running.values():  # a fatal failure (or Ctrl-C): end every survivor now
            pc.close(timeout=5)
        exits.close()
    return summary


def _is_back(job: JobControl, running: dict[int, Any], rank: int) -> bool:
    """Whether ``rank``'s running process is one restarted into the job that rejoined it."""
    at = job.rejoined(rank)
    return rank in running and at is not None and at[1] == running[rank].pids()[0]


def _forget_the_rejoined(lost: dict[int, str], job: JobControl, running: dict[int, Any]) -> None:
    """A restarted rank whose process rejoined the job is no longer lost: the job may lose
    as many again."""
    for rank in list(lost):
        if _is_back(job, running, rank):
            del lost[rank]
