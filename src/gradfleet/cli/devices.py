"""``--device``: where a run trains, which GPU each rank or tower gets, and how a step is timed.

``cpu`` (the default), ``cuda`` or ``cuda:N``. The workload's model and data and the optimizer
state go on the device. Ranks (``-n N`` processes, or torchrun's ranks on one machine) take one
GPU each: with ``cuda`` local rank ``r`` uses ``cuda:r``, and ``cuda:N`` is for a single rank.
NCCL refuses two ranks on one GPU, so more ranks than GPUs is bad input, as is a CUDA device on a
machine without one. Towers (one process) put tower ``t`` on ``cuda:t`` with ``cuda``, and every
tower on GPU ``N`` with ``cuda:N`` (as every tower shares the CPU with ``cpu``).

Nothing here touches CUDA unless a CUDA device is asked for: ``--help`` and CPU runs never
initialise it.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .config import ConfigError

__all__ = [
    "parse_device",
    "check_device",
    "rank_device",
    "tower_devices",
    "process_backend",
    "StepClock",
]

_FORM = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_device(value: object) -> str:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` in canonical form, or a :class:`ConfigError`."""
    text = str(value).strip().lower()
    match = _FORM.match(text)
    if not isinstance(value, str) or match is None or (match[1] == "cpu" and match[2]):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N (N >= 0), got {value!r}")
    return text if match[2] is None else f"cuda:{int(match[2])}"


def _cuda_count(device: str) -> int:
    """GPUs visible here; a :class:`ConfigError` when there are none."""
    if not torch.cuda.is_available():
        build = (
            "a CPU-only torch build"
            if torch.version.cuda is None
            else f"torch built for CUDA {torch.version.cuda}, but no GPU is visible"
        )
        raise ConfigError(
            f"--device {device}: CUDA is not available here ({build}); available: cpu"
        )
    return torch.cuda.device_count()


def _available(count: int) -> str:
    return "cpu, " + ", ".join(f"cuda:{i}" for i in range(count))


def check_device(device: str, processes: int, towers: int = 1) -> None:
    """Reject a CUDA device this machine lacks, and more ranks (``processes`` on this
    machine) or towers than GPUs. ``device`` is :func:`parse_device`'s result."""
    if device == "cpu":
        return
    count = _cuda_count(device)
    if ":" in device:
        index = int(device.split(":")[1])
        if index >= count:
            raise ConfigError(
                f"--device {device}: this machine has {count} CUDA device(s); available: "
                f"{_available(count)}"
            )
        if processes > 1:
            raise ConfigError(
                f"--device {device} names one GPU, but -n {processes} starts {processes} ranks "
                f"and NCCL needs one GPU per rank: use --device cuda (rank r on cuda:r)"
            )
        return
    if processes > count:
        raise ConfigError(
            f"--device cuda runs one rank per GPU: -n {processes} needs {processes} GPUs, this "
            f"machine has {count} ({_available(count)}); use -n <= {count}"
        )
    if towers > count:
        raise ConfigError(
            f"--device cuda puts tower t on cuda:t: -n {towers} towers need {towers} GPUs, this "
            f"machine has {count}; use -n <= {count}, or --device cuda:N for all towers on GPU N"
        )


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the rank with this local rank (its index on this machine)."""
    if device != "cuda":
        return torch.device(device)
    count = torch.cuda.device_count()
    if local_rank >= count:  # a launcher outside gradfleet's checks (torchrun, a job agent)
        raise RuntimeError(
            f"--device cuda: local rank {local_rank} has no GPU of its own (this machine has "
            f"{count}); start at most {count} ranks per machine"
        )
    return torch.device("cuda", local_rank)


def tower_devices(device: str, towers: int) -> list[str]:
    """One device per tower: ``cuda:0..T-1`` for ``cuda``, else ``device`` for every tower."""
    if device == "cuda":
        return [f"cuda:{t}" for t in range(towers)]
    return [device] * towers


def process_backend(device: torch.device) -> str:
    """gloo for CPU ranks; torch's combined backend for GPU ranks, so that parameter-sized CUDA
    tensors all-reduce over NCCL while the CPU tensors of the server strategies' control and
    staging paths stay on gloo."""
    from gradfleet.distributed import COMBINED_BACKEND

    return COMBINED_BACKEND if device.type == "cuda" else "gloo"


class StepClock:
    """Wall time of each training step on ``device``. CUDA kernels run asynchronously, so the
    device is synchronised before the clock is read at both ends: a step's time is the time
    its work took, not the time to enqueue it (nor the previous step's leftovers)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times_ms: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def step(self) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.times_ms.append((time.perf_counter() - start) * 1000.0)

    @property
    def last_ms(self) -> float:
        return self.times_ms[-1]

    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("nan")
