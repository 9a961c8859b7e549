"""The per-rank training loop: metrics (JSON lines), checkpoints, straggler delay, final model.

``run_worker(spec)`` is what every rank runs, under ``gradfleet train``'s own launcher, under
``torchrun`` or in the CLI's process for single-process strategies. ``spec`` is the resolved run
configuration (``config.json`` in the run directory). Rank 0 writes ``metrics.jsonl``,
``model.pt`` and ``summary.json``; every rank writes its own checkpoint file.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradfleet.distributed as gfd
from gradfleet.distributed import elastic
from gradfleet.registry import create_optimizer

from .devices import StepClock, process_backend, rank_device, tower_devices
from .strategies import STRATEGIES, Strategy, make_strategy, tolerated_losses
from .workloads import Workload, batch_indices, load_workload, workload_to

__all__ = ["run_worker", "latest_checkpoint"]


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def latest_checkpoint(out: Path) -> int | None:
    """The step of the newest complete checkpoint in run directory ``out`` (or None)."""
    pointer = out / "checkpoints" / "latest"
    return int(pointer.read_text()) if pointer.is_file() else None


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


class _Metrics:
    """Rank 0's metrics file; other ranks write nothing."""

    def __init__(self, path: Path | None, resume_step: int | None) -> None:
        self._f = None
        if path is None:
            return
        kept: list[str] = []
        if resume_step is not None and path.is_file():
            # Drop what the interrupted run logged after its last checkpoint.
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["step"] <= resume_step and not rec.get("final"):
                    kept.append(line + "\n")
        self._f = open(path, "w")  # noqa: SIM115
        self._f.writelines(kept)

    def write(self, **record: Any) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()  # the CLI's progress bar tails this file

    def close(self) -> None:
        if self._f:
            self._f.close()


def _save_checkpoint(out: Path, step: int, job: _Job, strategy: Strategy, extra: dict) -> None:
    rank, timeout = job.rank, extra.pop("timeout")
    ckpt_dir = out / "checkpoints" / f"step-{step:07d}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": strategy.model.state_dict(),
        "optimizer": strategy.opt.state_dict(),
        "bytes_sent": strategy.bytes_sent,
        **extra,
    }
    _atomic_save(state, ckpt_dir / f"rank-{rank}.pt")
    # every (live) rank's file exists before the pointer moves; no collective where a
    # worker may be lost
    if job.store is None:
        dist.barrier()
    else:
        elastic.arrive(job.store, f"checkpoint-{step}", rank)
        if rank == 0:
            elastic.wait_arrived(job.store, f"checkpoint-{step}", job.world, timeout)
    if rank == 0:
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
    """This rank's place in the job, and (when a lost worker is tolerated) the job store that
    carries the launcher's and rank 0's control messages (:mod:`gradfleet.distributed.elastic`).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        place = elastic.apply_job_env()  # one launcher agent per worker (the torchrun recipe)
        if place is not None and not tolerated_losses(
            spec["strategy"], spec["strategy_args"], place.world_size
        ):
            # Nothing would end the survivors of a lost rank but the collective timeout.
            raise RuntimeError(
                f"strategy {spec['strategy']} cannot lose a worker (its ranks run collectives "
                "in lockstep), so it does not run one agent per worker (GRADFLEET_RANK): "
                "launch it with torchrun --nproc-per-node N, or one agent per host"
            )
        self.rejoining = place is not None and place.rejoining
        # One GPU per rank (local rank r on cuda:r); the device is current before the process
        # group exists, so that NCCL and torch.cuda calls without a device use it.
        self.device = rank_device(spec.get("device", "cpu"), int(os.environ.get("LOCAL_RANK", 0)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = process_backend(self.device)
        self.store: Any = None
        if self.rejoining:
            assert place is not None
            # The others have moved on: no process group with them, only the store and server.
            self.store = elastic.job_store(float(spec.get("timeout", 120)))
            for key in ("RANK", "WORLD_SIZE"):
                os.environ.pop(key)
            gfd.init(backend=backend, set_device=False)
            self.rank, self.world = place.rank, place.world_size
        else:
            timeout = float(spec.get("timeout", 120))
            info = gfd.init(backend=backend, timeout=timeout, set_device=False)
            self.rank, self.world = info.rank, info.world_size
        self.tolerated = tolerated_losses(spec["strategy"], spec["strategy_args"], self.world)
        if self.tolerated and self.store is None:
            self.store = elastic.job_store(float(spec.get("timeout", 120)))
        self.lost: dict[int, dict[str, Any]] = {}
        self._next_poll, self.step = 0.0, 0
        self._rejoins: dict[int, Any] = {}

    def poll(self, metrics: _Metrics, step: int, now: bool = False) -> None:
        """Rank 0, about twice a second: publish progress, log newly lost / rejoined workers."""
        self.step = step
        if self.store is None or self.rank != 0 or (time.monotonic() < self._next_poll and not now):
            return
        self._next_poll = time.monotonic() + 0.5
        elastic.publish(self.store, "progress", step)
        for r, info in elastic.lost_workers(self.store, self.world).items():
            if r not in self.lost:
                self.lost[r] = {"step": step, **info}
                metrics.write(event="worker_lost", **self.lost[r])
        for r in range(1, self.world):
            at = elastic.read_key(self.store, f"rejoined/{r}")
            if at is not None and self._rejoins.get(r) != at:
                self._rejoins[r] = at
                self.lost.pop(r, None)
                metrics.write(step=step, event="worker_rejoined", rank=r, at_step=at[0])


def _setup(spec: dict[str, Any], job: _Job) -> tuple[Workload, Strategy]:
    torch.set_num_threads(int(spec.get("threads", 1)))
    rank, world = job.rank, job.world
    # Built on the CPU from the seed, then moved: every device starts from the same model.
    workload = workload_to(load_workload(spec["workload"], spec["seed"]), job.device)
    opt = create_optimizer(workload.model.parameters(), spec["optimizer"])
    name = spec["strategy"]
    args = dict(spec["strategy_args"])
    timeout = float(spec.get("timeout", 120))
    if name == "sync-replicas":  # internal: release every worker at the last update
        args.update(last_step=int(spec["steps"]), timeout=timeout)
    if name == "towers":
        args["devices"] = tower_devices(spec.get("device", "cpu"), int(spec["workers"]))
    if name in ("sync-replicas", "easgd"):  # where servers listen, or the running job's
        args.update(host=elastic.server_host(), timeout=timeout)
        if job.rejoining:
            address = elastic.read_key(job.store, "server")
            if address is None:
                raise RuntimeError("rejoining: the running job published no server address")
            args.update(server_address=address, worker=rank)
    # Towers run as threads of this one process: the "world" is the tower count.
    strategy = make_strategy(
        name, args, rank, world if STRATEGIES[name].spawns else spec["workers"]
    )
    strategy.setup(workload.model, opt)
    if job.store is not None and rank == 0 and strategy.server_address is not None:
        elastic.publish(job.store, "server", strategy.server_address)
    if spec.get("straggler"):
        slow_rank, delay_ms = spec["straggler"]
        strategy.straggle_s = delay_ms / 1000 if slow_rank == rank or name == "towers" else 0.0
        strategy.straggler_tower = slow_rank  # type: ignore[attr-defined]
    return workload, strategy


def _loss_fn(workload: Workload):
    return lambda model, x, y: workload.loss_fn(model(x), y)


def run_worker(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train as this rank; rank 0 returns the summary dict."""
    out = Path(spec["out"])
    job = _Job(spec)
    workload, strategy = _setup(spec, job)
    rank, world = job.rank, job.world
    start, wall_before, samples = 0, 0.0, 0
    pids = out / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"rank-{rank}.pid").write_text(str(os.getpid()))
    if job.rejoining:  # TF's restarted worker: carry on from where the job is
        start = int(elastic.read_key(job.store, "progress", 0))
        elastic.publish(job.store, f"rejoined/{rank}", [start, os.getpid()])
        print(f"worker rank {rank} rejoined the running job at step {start}", flush=True)
    elif spec.get("resume"):
        state = _load_checkpoint(out, job, strategy)
        start, wall_before, samples = state["step"], state["wall"], state["samples"]
    metrics = _Metrics(
        out / "metrics.jsonl" if rank == 0 else None, start if spec.get("resume") else None
    )
    x_train, y_train = workload.train
    batch = int(spec.get("batch_size") or workload.batch_size)
    steps, eval_every = int(spec["steps"]), int(spec.get("eval_every") or 0)
    ckpt_every = int(spec.get("checkpoint_every") or 0)
    loss_fn = _loss_fn(workload)
    clock = StepClock(job.device)
    if not job.rejoining:
        dist.barrier()  # start the clock together
    if job.store is not None and rank == 0:
        elastic.publish(job.store, "started", True)  # from now on a lost worker is tolerated
    t0 = time.perf_counter() - wall_before
    loss = float("nan")
    step = start
    # ``steps`` counts model updates: local steps for most strategies, server updates for
    # sync-replicas (where ranks run different numbers of local steps); the cap stops a
    # wrapper that never reports progress.
    while strategy.updates(step) < steps and step < start + 4 * steps:
        step += 1
        idx = batch_indices(len(y_train), batch, spec["seed"], rank, step).to(job.device)
        with clock.step():
            loss = strategy.train_step(x_train[idx], y_train[idx], loss_fn)
        samples += batch
        wall = time.perf_counter() - t0
        done = strategy.updates(step)
        metrics.write(
            step=done,
            loss=loss,
            wall=wall,
            samples=samples,
            bytes=strategy.bytes_sent,
            step_ms=clock.last_ms,
        )
        job.poll(metrics, done)
        if rank == 0 and eval_every and step % eval_every == 0 and done < steps:
            metrics.write(step=done, wall=wall, **evaluate(workload, strategy.export()))
        if ckpt_every and step % ckpt_every == 0:
            extra = {"wall": wall, "samples": samples, "timeout": float(spec.get("timeout", 120))}
            _save_checkpoint(out, step, job, strategy, extra)
    _finish(job, strategy, metrics, float(spec.get("timeout", 120)))
    wall = time.perf_counter() - t0
    result = None
    if rank == 0:
        final_state = strategy.export()
        # model.pt loads on any machine, with or without the GPU it was trained on
        _atomic_save({k: v.detach().cpu() for k, v in final_state.items()}, out / "model.pt")
        result = _summary(spec, workload, strategy, loss, wall, samples, world)
        result["median_step_ms"] = clock.median_ms()
        result["lost_workers"] = sorted(job.lost.values(), key=lambda w: w["rank"])
        result.update(evaluate(workload, final_state))
        metrics.write(step=steps, wall=wall, final=True, **evaluate(workload, final_state))
        (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    strategy.close()
    metrics.close()
    gfd.shutdown()
    return result


def _finish(job: _Job, strategy: Strategy, metrics: _Metrics, timeout: float) -> None:
    """End of training on every rank. Lockstep strategies: the wrapper's collective end and a
    barrier. Tolerant ones must not touch the process group again (a dead member breaks
    gloo's collectives): workers say they finished through the store, and rank 0 waits for
    every rank that is neither finished nor reported lost, then tells the server who is gone."""
    if job.store is None:
        strategy.finish()
        dist.barrier()
        return
    if job.rank != 0:
        strategy.finish()
        elastic.arrive(job.store, "finished", job.rank)
        return
    elastic.arrive(job.store, "finished", 0)
    missing = elastic.wait_arrived(job.store, "finished", job.world, timeout)
    job.poll(metrics, job.step, now=True)
    for r in missing:  # dead without a launcher that saw it (torchrun), or stuck
        job.lost.setdefault(r, {"rank": r, "step": None, "cause": f"not finished in {timeout:g}s"})
    strategy.forget(sorted(job.lost))
    strategy.finish()


def _summary(
    spec: dict,
    workload: Workload,
    strategy: Strategy,
    loss: float,
    wall: float,
    samples: int,
    world: int,
) -> dict[str, Any]:
    steps = int(spec["steps"])
    return {
        "workload": workload.name,
        "optimizer": spec["optimizer"],
        "strategy": spec["strategy"],
        "strategy_args": spec["strategy_args"],
        "workers": spec["workers"],
        "device": spec.get("device", "cpu"),
        "steps": steps,
        "final_loss": loss,
        "wall_s": wall,
        "steps_per_s": steps / wall if wall > 0 else float("nan"),
        "samples_per_s": samples * world / wall if wall > 0 else float("nan"),
        "bytes_sent": strategy.bytes_sent,
        "target_accuracy": workload.target,
        "model": str(Path(spec["out"]) / "model.pt"),
    }
