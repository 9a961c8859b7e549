"""The per-rank training loop: metrics (JSON lines), checkpoints, straggler delay, final model.

``run_worker(spec)`` is what every rank runs, under ``gradfleet train``'s own launcher, under
``torchrun`` or in the CLI's process for single-process strategies. ``spec`` is the resolved
:class:`~gradfleet.cli.spec.RunSpec` (``config.json`` in the run directory). Rank 0 writes
``metrics.jsonl``, ``model.pt`` and ``summary.json``; every rank writes its own checkpoint file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradfleet.distributed as gfd
from gradfleet.distributed.job_control import (
    JobControl,
    apply_job_env,
    restarts_left,
    server_host,
)
from gradfleet.distributed.transport import LINK_ERRORS, JobEnded
from gradfleet.registry import create_optimizer

from .devices import StepClock, process_backend, rank_device, tower_devices
from .logs import configure_logging
from .run_files import Metrics, atomic_save, last_logged_step, latest_checkpoint
from .servers import check_job_size, checkpoint_servers, is_server_rank, run_server, server_ranks
from .spec import RunSpec
from .strategies import Strategy
from .strategy_table import (
    STRATEGIES,
    centre_standby,
    chief_standby,
    serverless_losses,
    tolerated_losses,
)
from .torchrun import env_rank
from .workloads import Workload, batch_indices, load_workload, workload_to

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(workload: Workload, state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Test loss and accuracy of the parameters ``state`` (a copy of the model is used)."""
    model = workload.model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    x, y = workload.test
    out = model(x)
    result = {
        "test_loss": float(workload.loss_fn(out, y)),
        "test_accuracy": float((workload.predict(out) == y).float().mean()),
    }
    model.load_state_dict(saved)
    return result


def _save_checkpoint(out: Path, step: int, job: _Job, strategy: Strategy, extra: dict) -> None:
    rank = job.rank
    writer = rank == strategy.leader()
    ckpt_dir = out / "checkpoints" / f"step-{step:07d}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": strategy.model.state_dict(),
        "optimizer": strategy.opt.state_dict(),
        "bytes_sent": strategy.bytes_sent,
        **extra,
    }
    atomic_save(state, ckpt_dir / f"rank-{rank}.pt")
    # every (live) rank's file exists before the pointer moves; no collective where a
    # worker may be lost
    if job.control is None:
        dist.barrier()
    else:
        job.control.checkpoint_saved(step, rank)
        if writer:
            job.control.wait_checkpoint(step, job.timeout)
        if job.servers:
            # a lost server's state, written by the rank whose standby holds it now (rank 0
            # then waits for every server rank's file: one that no rank holds is named).  Asked
            # of every server rank that never came back, not only those the launcher has
            # reported lost: a standby takes over as soon as the workers move, and a loss
            # reported after this checkpoint began would leave the server's file unwritten
            servers = server_ranks(job.workers, job.servers)
            back = {r for r in servers if job.control.rejoined(r) is not None}
            asked = sorted({*job.control.lost_workers(servers), *(set(servers) - back)})
            for r in asked:
                server_state = strategy.server_state(r)
                if server_state is not None:
                    atomic_save(server_state, ckpt_dir / f"rank-{r}.pt")
                    job.control.server_checkpoint_saved(step, r)
            checkpoint_servers(job.control, job.rank, step, job.workers, job.servers, job.timeout)
        if writer:  # a lost worker's file, so that --resume starts every rank again
            # (and a restarted one's still asking in: it holds no state yet)
            ranks = range(job.workers)
            for r in sorted({*job.control.lost_workers(ranks), *job.control.joining(ranks)}):
                if r != rank:
                    atomic_save(strategy.stand_in(r, state), ckpt_dir / f"rank-{r}.pt")
    if writer:
        pointer = out / "checkpoints" / "latest"
        previous = latest_checkpoint(out)
        pointer.with_suffix(".tmp").write_text(str(step))
        os.replace(pointer.with_suffix(".tmp"), pointer)
        if previous is not None and previous != step:
            shutil.rmtree(out / "checkpoints" / f"step-{previous:07d}", ignore_errors=True)


def _load_checkpoint(out: Path, job: _Job, strategy: Strategy) -> dict[str, Any]:
    step = latest_checkpoint(out)
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {out / 'checkpoints'}")
    state = torch.load(
        out / "checkpoints" / f"step-{step:07d}" / f"rank-{job.rank}.pt",
        weights_only=True,
        map_location=job.device,
    )
    strategy.model.load_state_dict(state["model"])
    strategy.opt.load_state_dict(state["optimizer"])
    strategy.bytes_sent = int(state["bytes_sent"])
    return state


class _Job:
    """This rank's place in the job and, when a lost worker is tolerated, the job's control
    keys (:class:`~gradfleet.distributed.job_control.JobControl`): the launcher's and rank 0's
    messages, and this rank's heartbeat."""

    def __init__(self, spec: RunSpec) -> None:
        place = apply_job_env()  # one launcher agent per worker (the torchrun recipe)
        if place is not None and not tolerated_losses(
            spec.strategy, spec.strategy_args, place.world_size - spec.servers
        ):
            # Nothing would end the survivors of a lost rank but the collective timeout.
            raise RuntimeError(
                f"strategy {spec.strategy} cannot lose a worker (its ranks run collectives "
                "in lockstep), so it does not run one agent per worker (GRADFLEET_RANK): "
                "launch it with torchrun --nproc-per-node N, or one agent per host"
            )
        self.rejoining = place is not None and place.rejoining
        self.recipe = place is not None  # no launcher of ours reports a lost rank
        self.servers = spec.servers
        self.is_server = is_server_rank(self.servers)
        self.timeout = spec.timeout
        # One GPU per rank (local rank r on cuda:r); the device is current before the process
        # group exists, so that NCCL and torch.cuda calls without a device use it. Dedicated
        # servers (the last ranks) hold CPU tensors on every device, in the workers' backend.
        worker_device = torch.device("cpu" if spec.device == "cpu" else "cuda")
        self.device = (
            torch.device("cpu")
            if self.is_server
            else rank_device(spec.device, int(os.environ.get("LOCAL_RANK", 0)))
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = process_backend(worker_device)
        self.control: JobControl | None = None
        if self.rejoining:
            assert place is not None
            # The others have moved on: no process group with them, only the store and server.
            self.control = JobControl.connect(place.world_size - spec.servers, spec.timeout)
            if not self.is_server:  # the end does not wait for it until it is back
                self.control.mark_joining(place.rank, os.getpid())
            for key in ("RANK", "WORLD_SIZE"):
                os.environ.pop(key)
            gfd.init(backend=backend, set_device=False)
            self.rank, self.world = place.rank, place.world_size
        else:
            info = gfd.init(backend=backend, timeout=spec.timeout, set_device=False)
            self.rank, self.world = info.rank, info.world_size
        self.workers = self.world - self.servers  # ranks 0..workers-1 train, the rest serve
        check_job_size(self.servers, self.world, spec.workers)  # torchrun: its process count
        self.tolerated = tolerated_losses(spec.strategy, spec.strategy_args, self.workers)
        # Dedicated servers take their checkpoint and end-of-job cues from the store.
        if (self.tolerated or self.servers) and self.control is None:
            self.control = JobControl.connect(self.workers, spec.timeout)
        if self.control is not None and not self.is_server:
            # torchrun's agent or gradfleet's launcher says how often it restarts this rank
            self.control.start_heartbeat(self.rank, restarts_left())
        self.lost: dict[int, dict[str, Any]] = {}
        self._next_poll, self.step = 0.0, 0
        self._rejoins: dict[int, Any] = {}
        self._servers_named: set[int] = set()

    def poll(
        self,
        metrics: Metrics,
        step: int,
        now: bool = False,
        leader: int = 0,
        lost_servers: list[int] | None = None,
    ) -> None:
        """The writing rank (``leader``: rank 0, or the lowest live one where every rank holds
        the state), about twice a second: publish progress, log newly lost / rejoined workers.
        ``lost_servers``: the servers the strategy moved off to their standbys, named here
        under the torchrun recipe (no launcher of ours saw them die)."""
        self.step = step
        control = self.control
        if control is None or self.rank != leader:
            return
        if time.monotonic() < self._next_poll and not now:
            return
        self._next_poll = time.monotonic() + 0.5
        control.publish_progress(step)
        for r in (lost_servers or []) if self.recipe else []:
            if r not in self.lost and r not in self._servers_named:  # once: it may rejoin
                self._servers_named.add(r)
                self.lost[r] = {"rank": r, "step": step, "cause": "its standby took over"}
                log.info("server rank %d lost at step %s, its standby took over", r, step)
                metrics.write(event="worker_lost", **self.lost[r])
        # the dedicated server ranks too: one whose standby took over is named
        for r, info in control.lost_workers(range(self.workers + self.servers)).items():
            if r not in self.lost:
                self.lost[r] = {"step": step, **info}
                log.info("rank %d lost at step %s, training goes on: %s", r, step, info)
                metrics.write(event="worker_lost", **self.lost[r])
        for r in range(self.workers + self.servers):  # a dedicated server rank rejoins too
            at = control.rejoined(r)
            if at is not None and self._rejoins.get(r) != at:
                self._rejoins[r] = at
                self.lost.pop(r, None)
                log.info("rank %d rejoined at step %d (pid %d)", r, *at)
                metrics.write(step=step, event="worker_rejoined", rank=r, at_step=at[0])

    def close(self) -> None:
        if self.control is not None:
            self.control.close()


def _setup(spec: RunSpec, job: _Job) -> tuple[Workload, Strategy]:
    torch.set_num_threads(spec.threads)
    rank = job.rank
    # Built on the CPU from the seed, then moved: every device starts from the same model.
    workload = workload_to(load_workload(spec.workload, spec.seed), job.device)
    opt = create_optimizer(workload.model.parameters(), spec.optimizer)
    name = spec.strategy
    args = dict(spec.strategy_args)
    if name == "sync-replicas":  # internal: release every worker at the last update
        args.update(last_step=spec.steps, timeout=spec.timeout)
    if name == "towers":
        args["devices"] = tower_devices(spec.device, spec.workers)
    if name in ("sync-replicas", "easgd"):  # where servers listen, or the running job's
        args.update(host=server_host(), timeout=spec.timeout)
        if job.servers:  # the dedicated ranks after the workers
            ranks = server_ranks(job.workers, job.servers)
            args.update(server_ranks=ranks, server_rank=ranks[0])
        every_rank = serverless_losses(name, spec.strategy_args, job.workers, spec.device)
        if job.rejoining and not job.servers and every_rank:
            # the members heal it from their state
            args.update(worker=rank, max_losses=every_rank)
        elif job.rejoining:
            assert job.control is not None
            address = job.control.reachable_server_address(spec.timeout)
            if address is None:
                raise RuntimeError("rejoining: the running job published no server address")
            args.update(server_address=address, worker=rank)
            live_ranks = job.control.server_ranks()  # where they are now (a standby took over)
            if name == "sync-replicas" and live_ranks is not None:
                args["server_ranks"] = live_ranks
            if name == "easgd" and live_ranks is not None:
                args["live_server_rank"] = live_ranks[0]
            if name == "sync-replicas" and chief_standby(
                spec.strategy_args, job.workers, job.servers, spec.device
            ):
                # the job keeps a standby of its chief: a restarted process becomes it where
                # the chief has none (its own was lost with this rank, or took over)
                args["standby"] = True
            if name == "easgd" and centre_standby(spec.strategy_args, job.workers, job.servers):
                args["standby"] = True  # the same for the asynchronous EASGD centre
    # Towers run as threads of this one process: the "world" is the tower count.
    info = STRATEGIES[name]
    strategy = info.adapter(args, rank, job.workers if info.spawns else spec.workers)
    strategy.setup(workload.model, opt)
    if job.control is not None and rank == 0 and strategy.server_address is not None:
        job.control.publish_server(strategy.server_address, strategy.live_server_ranks())
    if spec.straggler:
        slow_rank, delay_ms = spec.straggler
        strategy.straggle_s = delay_ms / 1000 if slow_rank == rank or name == "towers" else 0.0
        strategy.straggler_tower = slow_rank  # type: ignore[attr-defined]
    return workload, strategy


def _loss_fn(workload: Workload):
    return lambda model, x, y: workload.loss_fn(model(x), y)


def run_worker(spec: RunSpec) -> dict[str, Any] | None:
    """Train as this rank; rank 0 returns the summary dict."""
    configure_logging(spec.log_level, env_rank())
    out = Path(spec.out)
    job = _Job(spec)
    try:
        if job.is_server:
            run_server(spec, job.rank, job.control, out, rejoining=job.rejoining)
            gfd.shutdown()
            return None
        return _train(spec, job, out)
    finally:
        job.close()


def _ended(exc: BaseException | None) -> JobEnded | None:
    """The ``JobEnded`` behind ``exc`` (itself, or a cause or context of it), if any."""
    seen = 0
    while exc is not None and seen < 16:  # a chain, not a cycle
        if isinstance(exc, JobEnded):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _job_over(job: _Job, exc: BaseException | None) -> str | None:
    """Why a restarted process has nothing to rejoin, or None: the job made its last update
    (its store says so), or joining it failed because it ended (``JobEnded``)."""
    if not job.rejoining or job.control is None:
        return None
    ended = _ended(exc)
    if ended is not None:
        return str(ended)
    try:
        return "it made its last update" if job.control.ended() else None
    except LINK_ERRORS:  # the store's host is gone too: that is not known to be the end
        return None


def _train(spec: RunSpec, job: _Job, out: Path) -> dict[str, Any] | None:
    why = _job_over(job, None)
    if why is None:
        try:
            workload, strategy = _setup(spec, job)
        except Exception as exc:
            why = _job_over(job, exc)
            if why is None:
                raise
    if why is not None:
        # restarted after the others finished (its loss came near the end, or it started
        # slowly): nothing is left to train, and the agent that restarted it must not report
        # the job failed
        log.warning("the job ended before this restarted process could rejoin: %s", why)
        print(f"worker rank {job.rank}: the job ended before it could rejoin ({why})", flush=True)
        gfd.shutdown()
        return None
    rank, workers = job.rank, job.workers
    start, wall_before, samples = 0, 0.0, 0
    pids = out / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"rank-{rank}.pid").write_text(str(os.getpid()))
    if job.rejoining:  # TF's restarted worker: carry on from where the job is
        assert job.control is not None
        # rank 0's last published step, or the step the strategy already holds (the
        # all-reduce's members healed this rank to theirs)
        start = max(job.control.progress(), strategy.updates(0))
        job.control.mark_rejoined(rank, start, os.getpid())
        log.info("rejoined the running job at step %d", start)
        print(f"worker rank {rank} rejoined the running job at step {start}", flush=True)
    elif spec.resume:
        state = _load_checkpoint(out, job, strategy)
        start, wall_before, samples = state["step"], state["wall"], state["samples"]
        log.info("resumed from the checkpoint of step %d", start)
    # rank 0 writes the run's files; a rank 0 restarted into the running job does not (the rank
    # that took over from it does) until it is the leader again
    writer = rank == 0 and not job.rejoining
    metrics = Metrics(out / "metrics.jsonl" if writer else None, start if spec.resume else None)
    recent: deque[dict[str, Any]] = deque(maxlen=32)  # a non-writer's records, for a takeover
    x_train, y_train = workload.train
    batch = spec.batch_size or workload.batch_size
    assert spec.steps is not None
    steps, eval_every, ckpt_every = spec.steps, spec.eval_every or 0, spec.checkpoint_every
    loss_fn = _loss_fn(workload)
    clock = StepClock(job.device)
    if not job.rejoining:
        dist.barrier()  # start the clock together
    if job.control is not None and rank == 0:
        job.control.mark_started()  # from now on a lost worker is tolerated
    t0 = time.perf_counter() - wall_before
    loss = float("nan")
    step = start
    published = strategy.server_address  # (rank 0's, at set-up)
    # ``steps`` counts model updates: local steps for most strategies, server updates for
    # sync-replicas (where ranks run different numbers of local steps); the cap stops a
    # wrapper that never reports progress.
    while strategy.updates(step) < steps and step < start + 4 * steps:
        step += 1
        idx = batch_indices(len(y_train), batch, spec.seed, rank, step).to(job.device)
        with clock.step():
            loss = strategy.train_step(x_train[idx], y_train[idx], loss_fn)
        samples += batch
        wall = time.perf_counter() - t0
        done = strategy.updates(step)
        record = {"step": done, "loss": loss, "wall": wall, "samples": samples,
                  "bytes": strategy.bytes_sent, "step_ms": clock.last_ms}  # fmt: skip
        if writer and rank != strategy.leader():  # a leader is back or took over: it writes
            metrics.close()
            metrics, writer = Metrics(None, None), False
            log.info("rank %d hands the run's files to rank %d", rank, strategy.leader())
        if not writer and rank == strategy.leader():  # the writer was lost: this rank takes over
            writer = True
            logged = last_logged_step(out / "metrics.jsonl")
            logged = done - 1 if logged is None else min(logged, done - 1)
            metrics = Metrics(out / "metrics.jsonl", logged)  # appends after its last record
            for earlier in recent:  # the updates made since, as this rank saw them
                if earlier["step"] > logged:
                    metrics.write(**earlier)
            log.info("rank %d writes the run's files from step %d on", rank, logged + 1)
        metrics.write(**record)
        if not writer:
            recent.append(record)
        leader = strategy.leader()
        job.poll(metrics, done, leader=leader, lost_servers=strategy.lost_servers())
        if job.control is not None and rank == leader:
            # a lost server's standby took over: a restarted worker must join it there
            live = strategy.live_server_address()
            if live is not None and live != published:
                job.control.publish_server(live, strategy.live_server_ranks())
                published = live
        if writer and eval_every and step % eval_every == 0 and done < steps:
            metrics.write(step=done, wall=wall, **evaluate(workload, strategy.export()))
        if ckpt_every and step % ckpt_every == 0:
            _save_checkpoint(out, step, job, strategy, {"wall": wall, "samples": samples})
    _finish(job, strategy, metrics)
    wall = time.perf_counter() - t0
    result = None
    if rank == strategy.leader():
        final_state = strategy.export()
        # model.pt loads on any machine, with or without the GPU it was trained on
        atomic_save({k: v.detach().cpu() for k, v in final_state.items()}, out / "model.pt")
        result = _summary(spec, workload, strategy, loss, wall, samples, workers)
        result["median_step_ms"] = clock.median_ms()
        result["lost_workers"] = sorted(job.lost.values(), key=lambda w: w["rank"])
        # each loss that came back (whoever led when it did)
        result["rejoined_workers"] = job.control.rejoins() if job.control is not None else []
        result.update(evaluate(workload, final_state))
        metrics.write(step=steps, wall=wall, final=True, **evaluate(workload, final_state))
        (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    strategy.close()
    metrics.close()
    gfd.shutdown()
    return result


def _finish(job: _Job, strategy: Strategy, metrics: Metrics) -> None:
    """End of training on every rank. Lockstep strategies: the wrapper's collective end and a
    barrier. Tolerant ones must not touch the process group again (a dead member breaks
    gloo's collectives): workers say they finished through the store, and rank 0 waits for
    every rank that is neither finished, nor reported lost, nor silent (its heartbeat stopped:
    dead without a launcher that saw it), then tells the server who is gone."""
    control = job.control
    if control is None:
        strategy.finish()
        dist.barrier()
        return
    if job.rank != strategy.leader():
        # finished first: a rank that hosts a server (a standby that took over a shard) ends
        # it once every worker said done, the leader's too, which waits for this mark
        control.finished(job.rank)
        strategy.finish()
        return
    control.mark_ended()  # a process restarted from now on has nothing to rejoin
    control.finished(job.rank)
    missing = control.wait_finished(job.timeout)
    job.poll(metrics, job.step, now=True, leader=job.rank, lost_servers=strategy.lost_servers())
    for r, cause in missing.items():  # dead without a launcher that saw it (torchrun), or stuck
        job.lost.setdefault(r, {"rank": r, "step": None, "cause": cause})
    workers = sorted(r for r in job.lost if r < job.workers)  # not a lost server's rank
    if workers:
        log.info("forgetting lost ranks %s at the server", workers)
    strategy.forget(workers)
    strategy.finish()


def _summary(
    spec: RunSpec,
    workload: Workload,
    strategy: Strategy,
    loss: float,
    wall: float,
    samples: int,
    workers: int,
) -> dict[str, Any]:
    assert spec.steps is not None
    steps = spec.steps
    return {
        "workload": workload.name,
        "optimizer": spec.optimizer,
        "strategy": spec.strategy,
        "strategy_args": spec.strategy_args,
        "workers": spec.workers,
        "servers": spec.servers,
        "device": spec.device,
        "steps": steps,
        "final_loss": loss,
        "wall_s": wall,
        "steps_per_s": steps / wall if wall > 0 else float("nan"),
        "samples_per_s": samples * workers / wall if wall > 0 else float("nan"),  # not servers
        "bytes_sent": strategy.bytes_sent,
        # sync-replicas: the gradients each update took (replicas_to_aggregate=auto: chosen)
        "replicas": getattr(strategy, "replicas_history", None),
        # sync-replicas: each worker's gradients the chief accepted into updates and dropped
        "gradients_per_worker": getattr(strategy, "gradients_per_worker", None),
        # sync-replicas with max_losses: each loss and join the group saw (step, members after)
        "membership_changes": getattr(strategy, "membership_changes", None),
        "target_accuracy": workload.target,
        "model": str(Path(spec.out) / "model.pt"),
    }
