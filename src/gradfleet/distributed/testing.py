"""Run a function in N separate rank processes with a gloo group, never hanging (for tests).

``run_ranks(fn, world_size)`` starts ``world_size`` processes (``forkserver`` with torch
preloaded, or ``spawn``; never a fork of the caller), gives each a process group on a per-run
``FileStore`` (no TCP port; ``rendezvous="env"`` instead picks one free loopback port in the
parent and exports torchrun's variables, for code that calls ``gradfleet.distributed.init()``),
calls ``fn(ctx, *args)`` and returns every rank's result.

It cannot hang: the group's collective timeout is ``pg_timeout`` seconds; when a rank fails the
others get ``grace`` seconds to finish or fail; ``timeout`` seconds after every rank started (its
stack dump armed: a rank's start, the forkserver's imports included, can take seconds on a
loaded machine, at most ``START_S``) every live rank dumps its Python stacks (``faulthandler``
on SIGUSR1) and is killed. Failures raise :class:`MultiProcessError`
with every rank's traceback or stack dump. ``kill_on={rank: "name"}`` SIGKILLs a rank as soon as
it calls ``ctx.signal("name")``; ``kill_after={rank: seconds}`` kills it after a delay. Killed ranks
report a :class:`RankKilled` result instead of failing the run.

``fn`` must be importable by module path (a module-level function): the ranks import it.
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["RankContext", "RankKilled", "MultiProcessError", "run_ranks", "free_port"]

START_S = 120.0
"""The longest a rank may take to start (the forkserver's imports of torch, on a loaded
machine): ``timeout`` counts from when every rank has."""

log = logging.getLogger(__name__)

ERROR_EXIT = 10


@dataclass(frozen=True)
class RankContext:
    """What a rank function receives: its rank, the world size and a scratch directory."""

    rank: int
    world_size: int
    workdir: str

    def signal(self, name: str) -> None:
        """Tell the parent this rank reached ``name`` (see ``kill_on``)."""
        Path(self.workdir, f"signal-{self.rank}-{name}").touch()

    def wait_signal(self, rank: int, name: str, timeout: float = 10.0) -> None:
        """Block until ``rank`` called ``signal(name)`` (simple cross-rank ordering in tests)."""
        path = Path(self.workdir, f"signal-{rank}-{name}")
        end = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > end:
                raise TimeoutError(f"rank {self.rank}: no signal {name!r} from rank {rank}")
            time.sleep(0.01)


@dataclass(frozen=True)
class RankKilled:
    """Result of a rank the harness killed on request."""

    rank: int


@dataclass
class _Config:
    backend: str
    pg_timeout: float
    init_process_group: bool
    rendezvous: str
    port: int
    deadline_s: float
    env: dict[str, str] = field(default_factory=dict)


class MultiProcessError(AssertionError):
    """A rank failed or the run hit its deadline; ``reports`` holds every rank's story."""

    def __init__(self, summary: str, reports: dict[int, str]) -> None:
        self.reports = reports
        parts = [summary] + [f"--- rank {r} ---\n{text}" for r, text in sorted(reports.items())]
        super().__init__("\n".join(parts))


def free_port() -> int:
    """One free loopback port, chosen once in the parent."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fn_ref(fn: Callable) -> Any:
    """A module-level function travels as (module, qualname) so the child can install its
    stack-dump handler before importing the (possibly slow) module."""
    qual = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", None) and qual and "<" not in qual:
        return (fn.__module__, qual)
    return fn


def _resolve(ref: Any) -> Callable:
    if isinstance(ref, tuple):
        obj = importlib.import_module(ref[0])
        for part in ref[1].split("."):
            obj = getattr(obj, part)
        return obj
    return ref


def _child(rank: int, world_size: int, ref: Any, args: tuple, workdir: str, cfg: _Config):
    os.environ.update(cfg.env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(cfg.port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
    )
    stacks = open(Path(workdir, f"stacks-{rank}.txt"), "w")  # open until os._exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # Second line of defence if the parent itself dies: dump and exit on our own (after the
    # parent's deadline, which starts once the last rank has started).
    faulthandler.dump_traceback_later(cfg.deadline_s + START_S + 10, exit=True, file=stacks)
    Path(workdir, f"started-{rank}").touch()  # the parent may now ask for the stacks
    code = 0
    started = time.monotonic()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn = _resolve(ref)
        if cfg.init_process_group:
            store = dist.FileStore(str(Path(workdir, "store")), world_size)
            dist.init_process_group(
                cfg.backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=cfg.pg_timeout),
            )
            # Connect every pair now: a rank that finishes early must not close its sockets
            # while a slower peer is still connecting (bounded by pg_timeout).
            dist.barrier()
        result = fn(RankContext(rank, world_size, workdir), *args)
        _write(Path(workdir, f"result-{rank}.pkl"), ("ok", result, time.time()))
    except BaseException:  # the traceback goes to the parent, which reports it
        log.info("rank %d failed", rank)
        # when it failed (one clock for all ranks): the rank that failed first has the cause
        now = time.time()
        when = f"failed at {_clock(now)}, {time.monotonic() - started:.2f} s after its start\n"
        _write(Path(workdir, f"result-{rank}.pkl"), ("error", when + traceback.format_exc(), now))
        code = ERROR_EXIT
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # a dead peer: the rank's result is written already
            log.warning("rank %d: destroy_process_group failed: %s", rank, exc)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip atexit handlers that could block on a dead peer


def _write(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        data = pickle.dumps(payload)
    except Exception as exc:  # unpicklable result: report instead of dying silently
        log.error("result of rank is not picklable: %r", exc)
        data = pickle.dumps(("error", f"result of rank is not picklable: {exc!r}"))
    tmp.write_bytes(data)
    tmp.rename(path)


def _context(start_method: str) -> Any:
    """``"forkserver"`` (default): a clean server process with torch preloaded forks the ranks,
    so each rank starts in milliseconds instead of re-importing torch; never inherits the
    parent's threads or CUDA state. ``"spawn"``: a fresh interpreter per rank."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(
            f"run_ranks: start_method must be 'forkserver' or 'spawn', got {start_method!r}"
        )
    mpc = mp.get_context(start_method)
    if start_method == "forkserver":
        # torch._dynamo is what the first optimizer construction imports lazily (seconds).
        mpc.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    return mpc


def _read(path: Path) -> tuple[str, Any] | None:
    if not path.exists():
        return None
    return pickle.loads(path.read_bytes())


def _started(workdir: str, rank: int) -> bool:
    return Path(workdir, f"started-{rank}").exists()


def _dump_and_kill(procs: list, workdir: str) -> None:
    """Every live rank that armed its stack dump dumps its stacks; then every live rank is
    killed (one that had not started yet would die of SIGUSR1's default action, stackless)."""
    live = [(r, p) for r, p in enumerate(procs) if p.exitcode is None]
    for r, p in live:
        if not _started(workdir, r):
            continue
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if live:
        time.sleep(0.5)
    for _, p in live:
        p.kill()
    for p in procs:
        p.join(5)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    timeout: float = 60.0,
    pg_timeout: float = 30.0,
    grace: float = 3.0,
    backend: str = "gloo",
    init_process_group: bool = True,
    rendezvous: str = "file",
    kill_on: dict[int, str] | None = None,
    kill_after: dict[int, float] | None = None,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; return the per-rank results.

    ``pg_timeout`` is 30 s, not less: a server rank's start opens several c10d store
    connections, and c10d looks each one's address up by name; with a slow resolver one lookup
    waits for its timeout (5 s, once in about 50, on the VM the suite runs on), and a start
    with two such waits outlasted a 10 s collective timeout (docs/failures.md)."""
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be >= 1, got {world_size}")
    if rendezvous not in ("file", "env"):
        raise ValueError(f"run_ranks: rendezvous must be 'file' or 'env', got {rendezvous!r}")
    workdir = tempfile.mkdtemp(prefix="gradfleet-ranks-")
    cfg = _Config(
        backend=backend,
        pg_timeout=pg_timeout,
        init_process_group=init_process_group and rendezvous == "file",
        rendezvous=rendezvous,
        port=free_port(),
        deadline_s=timeout,
        env=dict(env or {}),
    )
    mpc = _context(start_method)
    ref = _fn_ref(fn)
    procs = [
        mpc.Process(target=_child, args=(r, world_size, ref, args, workdir, cfg), daemon=True)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        status = _supervise(procs, workdir, timeout, grace, kill_on or {}, kill_after or {})
        return _collect(procs, workdir, status)
    finally:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                p.kill()
                p.join(5)
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(procs, workdir, timeout, grace, kill_on, kill_after) -> dict:
    start = time.monotonic()
    killed: set[int] = set()
    failed_at = None
    began = None  # when every rank had started (ended ones count as started)
    while True:
        now = time.monotonic() - start
        if began is None and all(
            _started(workdir, r) or p.exitcode is not None for r, p in enumerate(procs)
        ):
            began = now
        for r, name in kill_on.items():
            if r not in killed and Path(workdir, f"signal-{r}-{name}").exists():
                procs[r].kill()
                killed.add(r)
        for r, delay in kill_after.items():
            if r not in killed and now >= delay:
                procs[r].kill()
                killed.add(r)
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            return {"killed": killed, "timeout": False}
        bad = any(c not in (None, 0) and r not in killed for r, c in enumerate(codes))
        if bad and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > grace:
            _dump_and_kill(procs, workdir)
            return {"killed": killed, "timeout": False}
        if now > (START_S if began is None else began) + timeout:
            _dump_and_kill(procs, workdir)
            return {"killed": killed, "timeout": True}
        time.sleep(0.05)


def _collect(procs, workdir: str, status: dict) -> list[Any]:
    results: list[Any] = []
    reports: dict[int, str] = {}
    fates: list[str] = []  # every rank's end, for the error's summary
    for r, p in enumerate(procs):
        outcome = _read(Path(workdir, f"result-{r}.pkl"))
        fates.append(_fate(r, p.exitcode, outcome, r in status["killed"]))
        stacks_path = Path(workdir, f"stacks-{r}.txt")
        stacks = stacks_path.read_text() if stacks_path.exists() else ""
        if r in status["killed"]:
            results.append(RankKilled(r))
        elif outcome is not None and outcome[0] == "ok" and p.exitcode == 0:
            results.append(outcome[1])
            continue
        elif outcome is not None and outcome[0] == "error":
            reports[r] = outcome[1]
        elif not _started(workdir, r):
            reports[r] = f"no result (exit code {p.exitcode}): it had not started its function"
        else:
            reports[r] = f"no result (exit code {p.exitcode}); stacks:\n{stacks or '(none)'}"
    if reports:
        what = "deadline exceeded" if status["timeout"] else "rank failure"
        summary = f"run_ranks: {what} on ranks {sorted(reports)} ({'; '.join(fates)})"
        raise MultiProcessError(summary, reports)
    return results


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _fate(rank: int, exitcode: int | None, outcome: tuple | None, killed: bool) -> str:
    """How one rank ended, in a few words (a peer that returned early, say, shows here)."""
    if killed:
        return f"rank {rank} killed as asked"
    if outcome is None:
        return f"rank {rank}: no result, exit code {exitcode}"
    at = f" at {_clock(outcome[2])}" if len(outcome) > 2 else ""
    return f"rank {rank} {'returned' if outcome[0] == 'ok' else 'raised'}{at}"
