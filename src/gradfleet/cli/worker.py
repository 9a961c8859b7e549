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
from gradfleet.registry import create_optimizer

from .strategies import STRATEGIES, Strategy, make_strategy
from .workloads import Workload, batch_indices, load_workload

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


def _save_checkpoint(out: Path, step: int, rank: int, strategy: Strategy, extra: dict) -> None:
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
    dist.barrier()  # every rank's file exists before the pointer moves
    if rank == 0:
        pointer = out / "checkpoints" / "latest"
        previous = latest_checkpoint(out)
        pointer.with_suffix(".tmp").write_text(str(step))
        os.replace(pointer.with_suffix(".tmp"), pointer)
        if previous is not None and previous != step:
            shutil.rmtree(out / "checkpoints" / f"step-{previous:07d}", ignore_errors=True)


def _load_checkpoint(out: Path, rank: int, strategy: Strategy) -> dict[str, Any]:
    step = latest_checkpoint(out)
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {out / 'checkpoints'}")
    state = torch.load(
        out / "checkpoints" / f"step-{step:07d}" / f"rank-{rank}.pt", weights_only=True
    )
    strategy.model.load_state_dict(state["model"])
    strategy.opt.load_state_dict(state["optimizer"])
    strategy.bytes_sent = int(state["bytes_sent"])
    return state


def _setup(spec: dict[str, Any]) -> tuple[Workload, Strategy, int, int]:
    torch.set_num_threads(int(spec.get("threads", 1)))
    info = gfd.init(backend="gloo", timeout=float(spec.get("timeout", 120)))
    rank, world = info.rank, info.world_size
    workload = load_workload(spec["workload"], spec["seed"])
    opt = create_optimizer(workload.model.parameters(), spec["optimizer"])
    name = spec["strategy"]
    args = dict(spec["strategy_args"])
    if name == "sync-replicas":  # internal: release every worker at the last update
        args.update(last_step=int(spec["steps"]), timeout=float(spec.get("timeout", 120)))
    # Towers run as threads of this one process: the "world" is the tower count.
    strategy = make_strategy(
        name, args, rank, world if STRATEGIES[name].spawns else spec["workers"]
    )
    strategy.setup(workload.model, opt)
    if spec.get("straggler"):
        slow_rank, delay_ms = spec["straggler"]
        strategy.straggle_s = delay_ms / 1000 if slow_rank == rank or name == "towers" else 0.0
        strategy.straggler_tower = slow_rank  # type: ignore[attr-defined]
    return workload, strategy, rank, world


def _loss_fn(workload: Workload):
    return lambda model, x, y: workload.loss_fn(model(x), y)


def run_worker(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train as this rank; rank 0 returns the summary dict."""
    out = Path(spec["out"])
    workload, strategy, rank, world = _setup(spec)
    start, wall_before, samples = 0, 0.0, 0
    if spec.get("resume"):
        state = _load_checkpoint(out, rank, strategy)
        start, wall_before, samples = state["step"], state["wall"], state["samples"]
    metrics = _Metrics(
        out / "metrics.jsonl" if rank == 0 else None, start if spec.get("resume") else None
    )
    x_train, y_train = workload.train
    batch = int(spec.get("batch_size") or workload.batch_size)
    steps, eval_every = int(spec["steps"]), int(spec.get("eval_every") or 0)
    ckpt_every = int(spec.get("checkpoint_every") or 0)
    loss_fn = _loss_fn(workload)
    dist.barrier()  # start the clock together
    t0 = time.perf_counter() - wall_before
    loss = float("nan")
    step = start
    # ``steps`` counts model updates: local steps for most strategies, server updates for
    # sync-replicas (where ranks run different numbers of local steps); the cap stops a
    # wrapper that never reports progress.
    while strategy.updates(step) < steps and step < start + 4 * steps:
        step += 1
        idx = batch_indices(len(y_train), batch, spec["seed"], rank, step)
        loss = strategy.train_step(x_train[idx], y_train[idx], loss_fn)
        samples += batch
        wall = time.perf_counter() - t0
        done = strategy.updates(step)
        metrics.write(step=done, loss=loss, wall=wall, samples=samples, bytes=strategy.bytes_sent)
        if rank == 0 and eval_every and step % eval_every == 0 and done < steps:
            metrics.write(step=done, wall=wall, **evaluate(workload, strategy.export()))
        if ckpt_every and step % ckpt_every == 0:
            _save_checkpoint(out, step, rank, strategy, {"wall": wall, "samples": samples})
    strategy.finish()
    wall = time.perf_counter() - t0
    dist.barrier()
    result = None
    if rank == 0:
        final_state = strategy.export()
        _atomic_save(final_state, out / "model.pt")
        result = _summary(spec, workload, strategy, loss, wall, samples, world)
        result.update(evaluate(workload, final_state))
        metrics.write(step=steps, wall=wall, final=True, **evaluate(workload, final_state))
        (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    strategy.close()
    metrics.close()
    gfd.shutdown()
    return result


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
        "steps": steps,
        "final_loss": loss,
        "wall_s": wall,
        "steps_per_s": steps / wall if wall > 0 else float("nan"),
        "samples_per_s": samples * world / wall if wall > 0 else float("nan"),
        "bytes_sent": strategy.bytes_sent,
        "target_accuracy": workload.target,
        "model": str(Path(spec["out"]) / "model.pt"),
    }
