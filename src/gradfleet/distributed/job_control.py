"""Job control: one worker's death does not end the job, and a restarted worker rejoins it.

torch's launchers end or restart a whole *worker group* when one member fails: ``torchrun
--nproc-per-node N`` kills the survivors (``--max-restarts 0``) or restarts all of them, and a
multi-node c10d job waits for every agent at exit. The wrappers that tolerate a lost worker
(``SyncReplicasOptimizer`` with backup workers, asynchronous EASGD) need each worker to be its
own group: one launcher agent per worker, with gradfleet's rank and world size given here::

    GRADFLEET_RANK=2 GRADFLEET_WORLD_SIZE=3 \\
    GRADFLEET_MASTER_ADDR=10.0.0.1 GRADFLEET_MASTER_PORT=29500 \\
    GRADFLEET_SERVER_HOST=10.0.0.3 \\
    torchrun --standalone --nnodes=1 --nproc-per-node=1 --max-restarts=3 train.py

:func:`apply_job_env` maps these onto the ``env://`` variables torch reads (rank 0 hosts the
job's TCPStore at the master address; with ``GRADFLEET_STORE=own`` a process of its own does,
``gradfleet store``, and rank 0 may be lost too), so ``gradfleet.distributed.init()`` joins
gradfleet's job instead of the agent's one-process job. When the agent restarts a worker
(``TORCHELASTIC_RESTART_COUNT > 0``) the others have moved on: the process must not rejoin the
process group; :attr:`JobPlace.rejoining` says so, and :class:`JobControl` gives it what the
running job published (the server address, the step), so it reconnects as TF's restarted
worker does (``local_step := global_step``).

:class:`JobControl` owns every control key of the job store, the small messages between the
launcher, rank 0 and the workers: started, progress, the server's address, a worker lost /
rejoined / alive, and the arrivals at checkpoints and at the end. The store has no
authentication, like every c10d store and gloo connection: bind servers to the cluster network
only (:func:`server_host`).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import torch.distributed as dist

from .hosting.hosted_server import env_server_host
from .transport.errors import LINK_ERRORS

__all__ = ["JobControl", "JobPlace", "apply_job_env", "job_store", "restarts_left", "server_host"]

log = logging.getLogger(__name__)
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class JobPlace:
    """This process in gradfleet's job: rank, world size, and whether it rejoins a running job."""

    rank: int
    world_size: int
    rejoining: bool
    restarts_left: int = 0
    """How many more times this worker's agent restarts it (torchrun's ``--max-restarts``
    less the restarts done): rank 0 keeps waiting for a silent rank that will come back."""


def _int_env(name: str, minimum: int) -> int:
    raw = os.environ[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


STORE_HOSTS: Final = ("rank0", "own")
"""``GRADFLEET_STORE``: who hosts the job's store. ``rank0`` (default): rank 0's process, so
the job cannot lose rank 0; ``own``: a process of its own (``gradfleet store``), so any rank
may be lost where the strategy has a spare for what it held."""


def apply_job_env() -> JobPlace | None:
    """Read ``GRADFLEET_RANK`` etc. (module doc) and export them as ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (rank 0 hosts the store, or with ``GRADFLEET_STORE=own``
    a process of its own: :data:`STORE_HOSTS`). None when not set."""
    if "GRADFLEET_RANK" not in os.environ:
        return None
    missing = [f"GRADFLEET_{k}" for k in _ENV if f"GRADFLEET_{k}" not in os.environ]
    if missing:
        raise ValueError(f"GRADFLEET_RANK is set but {', '.join(missing)} is not")
    rank = _int_env("GRADFLEET_RANK", 0)
    world = _int_env("GRADFLEET_WORLD_SIZE", 1)
    if rank >= world:
        raise ValueError(f"GRADFLEET_RANK={rank} must be < GRADFLEET_WORLD_SIZE={world}")
    _int_env("GRADFLEET_MASTER_PORT", 1)
    hosted_by = os.environ.get("GRADFLEET_STORE", "rank0")
    if hosted_by not in STORE_HOSTS:
        raise ValueError(
            f"GRADFLEET_STORE must be one of {', '.join(STORE_HOSTS)} (who hosts the job's "
            f"store at GRADFLEET_MASTER_ADDR), got {hosted_by!r}"
        )
    for key in _ENV:
        os.environ[key] = os.environ[f"GRADFLEET_{key}"]
    # one process per agent under the recipe; gradfleet's launcher, restarting a rank, keeps
    # its local rank (its GPU)
    os.environ.setdefault("LOCAL_RANK", "0")
    # The agent's own store serves its one-process job; gradfleet's job store is rank 0's, or
    # a process of its own (``gradfleet store``), which every rank then joins as a client:
    # torch's env:// rendezvous reads this flag so (some torch releases also read the attempt).
    own = hosted_by == "own"
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(own)
    os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return JobPlace(rank, world, restarts > 0, restarts_left())


def restarts_left() -> int:
    """How many more times this process's launcher restarts it: torch elastic's
    ``TORCHELASTIC_MAX_RESTARTS`` less ``TORCHELASTIC_RESTART_COUNT`` (torchrun's agent and
    gradfleet's launcher both set them)."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return max(int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restarts, 0)


def job_store(timeout: float = 60.0) -> dist.TCPStore:
    """A client of the job's store at ``MASTER_ADDR:MASTER_PORT`` (for gradfleet's keys)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )


def server_host() -> str:
    """The address wrapper servers listen on: ``GRADFLEET_SERVER_HOST`` if set, loopback for a
    job on loopback, else this host's address on the route to ``MASTER_ADDR`` (the interface
    the process group's rendezvous uses). Never the wildcard address."""
    return env_server_host()


# ----------------------------------------------------------------------------- control keys
HEARTBEAT_S: Final = 1.0
"""How often a worker's heartbeat thread says it is alive."""
SILENT_S: Final = 10.0
"""A rank whose heartbeat has not moved for this long, at a point rank 0 waits at, and whose
agent has no restart left for it, is gone: its process died and no launcher reported it
(torchrun's per-worker recipe without a restart). The beat comes from a thread of its own, so
a worker that is merely slow keeps beating; one with restarts left is waited for until the
timeout, as its agent brings it back."""


class JobControl:
    """The control keys of one job on its store, and every read and write of them.

    Keys (all under ``gradfleet/``): ``started`` (rank 0 began training: from then on a lost
    worker is tolerated), ``progress`` (rank 0's step), ``server`` and ``server_ranks`` (the
    wrapper servers' address and ranks now, for a rejoining worker), ``lost/R`` (the launcher
    saw rank R die), ``joining/R`` (R's restarted process asks in and has not rejoined yet),
    ``rejoined/R`` (R was restarted and rejoined at a step), ``ended`` (the writing rank made the
    last update: a process restarted from then on has nothing to rejoin), ``alive/R`` (R's
    heartbeat counter), ``restarts/R`` (how often R's agent will still restart it),
    ``<point>/R`` (R arrived at ``finished`` or ``checkpoint-<step>``), and for dedicated
    server ranks ``servers/checkpoint`` (the step rank 0 asks them to save),
    ``servers/checkpoint-<step>/R`` (server R saved it) and ``checkpoint-<step>/complete``."""

    PREFIX: Final = "gradfleet/"

    def __init__(
        self,
        store: dist.Store,
        world_size: int,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        silent_after: float = SILENT_S,
    ) -> None:
        if not silent_after >= 3 * heartbeat_s > 0:
            raise ValueError(
                f"silent_after must be >= 3 * heartbeat_s > 0 (a live rank misses no more than "
                f"a beat or two), got silent_after={silent_after}, heartbeat_s={heartbeat_s}"
            )
        self.store, self.world_size = store, world_size
        self.heartbeat_s, self.silent_after = heartbeat_s, silent_after
        self._beating = threading.Event()
        self._beat: threading.Thread | None = None

    @classmethod
    def connect(cls, world_size: int, timeout: float) -> JobControl:
        """A client of the job's store at ``MASTER_ADDR:MASTER_PORT`` (rank 0 hosts it)."""
        return cls(job_store(timeout), world_size)

    # ------------------------------------------------------------------ plain values
    def _set(self, name: str, value: Any) -> None:
        self.store.set(self.PREFIX + name, json.dumps(value))

    def _get(self, name: str, default: Any = None) -> Any:
        key = self.PREFIX + name
        if not self.store.check([key]):
            return default
        return json.loads(self.store.get(key))

    def mark_started(self) -> None:
        self._set("started", True)

    def started(self) -> bool:
        return bool(self._get("started", False))

    def publish_progress(self, step: int) -> None:
        self._set("progress", step)

    def progress(self) -> int:
        return int(self._get("progress", 0))

    def publish_server(self, address: Any, ranks: list[int] | None = None) -> None:
        """The servers' address(es) now and, where known, the ranks hosting them (a lost
        server's standby's rank once it took over): a restarted worker joins them there."""
        if ranks is not None:
            self._set("server_ranks", [int(r) for r in ranks])
        self._set("server", address)  # last: a reader that sees it sees the ranks too

    def server_address(self) -> Any:
        """The wrapper server's address rank 0 published, or None."""
        return self._get("server")

    def reachable_server_address(self, timeout: float) -> Any:
        """The servers' published address, once each accepts a connection.  The writing rank
        publishes a standby that took over after its next update, so a process restarted
        sooner reads the lost server's address: it reads again, for up to ``timeout``
        seconds (then the caller's client names the unreachable server)."""
        from .transport.client import store_client

        end = time.monotonic() + timeout
        while True:
            address = self.server_address()
            if address is None:
                return None
            try:
                for one in [address] if isinstance(address, str) else address:
                    host, port = str(one).rsplit(":", 1)
                    store_client(host, int(port), 5.0)
                return address
            except LINK_ERRORS as exc:
                if time.monotonic() > end:
                    return address
                log.info("the published server %s is unreachable (%s): reading it again",
                         address, exc)  # fmt: skip
                time.sleep(0.5)

    def publish_server_spec(self, rank: int, spec: dict[str, Any]) -> None:
        """What dedicated server ``rank`` serves (the spec rank 0 announced to it: the job,
        its layout, shapes and parameter groups; no tensor), for its restarted process."""
        # pickled, as rank 0's broadcast_object_list sent it: it holds the job's dataclasses
        self.store.set(self.PREFIX + f"server_spec/{rank}", pickle.dumps(spec))

    def server_spec(self, rank: int) -> dict[str, Any] | None:
        """:meth:`publish_server_spec`'s spec of ``rank``, or None."""
        key = self.PREFIX + f"server_spec/{rank}"
        if not self.store.check([key]):
            return None
        return pickle.loads(self.store.get(key))  # noqa: S301 - written by this job's rank

    def server_ranks(self) -> list[int] | None:
        """The ranks hosting the servers at :meth:`server_address`, or None if not published."""
        ranks = self._get("server_ranks")
        return None if ranks is None else [int(r) for r in ranks]

    # ------------------------------------------------------------------ lost and rejoined
    def mark_lost(self, rank: int, **info: Any) -> None:
        """Record that ``rank`` is gone (the launcher saw it die): rank 0 stops waiting for it."""
        log.info("rank %d reported lost: %s", rank, info)
        # lost again after a rejoin (restarted): no longer back
        self.store.delete_key(self.PREFIX + f"rejoined/{rank}")
        self._set(f"lost/{rank}", {"rank": rank, **info})

    def mark_joining(self, rank: int, pid: int) -> None:
        """``rank``'s restarted process ``pid`` asks into the running job (until
        :meth:`mark_rejoined`): the end and checkpoints do not wait for it
        (:meth:`wait_finished`, :meth:`wait_checkpoint`)."""
        self._set(f"joining/{rank}", pid)

    def mark_rejoined(self, rank: int, step: int, pid: int) -> None:
        """``rank``'s process ``pid`` rejoined the running job at ``step``; the job's record
        of rejoins (:meth:`rejoins`) gains its loss, as the launcher reported it."""
        self.store.delete_key(self.PREFIX + f"joining/{rank}")
        loss = self._get(f"lost/{rank}", {"rank": rank})
        n = self.store.add(self.PREFIX + "rejoins", 1)
        self._set(f"rejoin/{n}", {**loss, "rejoined_at_step": step})
        self._set(f"rejoined/{rank}", [step, pid])

    def rejoins(self) -> list[dict[str, Any]]:
        """Every rejoin so far, in order: the loss (``rank``, and where a launcher reported
        it ``step``, ``cause``, ...) and ``rejoined_at_step``."""
        n = self.store.add(self.PREFIX + "rejoins", 0)
        return [self._get(f"rejoin/{i}") for i in range(1, n + 1)]

    def rejoined(self, rank: int) -> tuple[int, int] | None:
        """``(step, pid)`` of ``rank``'s latest rejoin, or None."""
        at = self._get(f"rejoined/{rank}")
        return None if at is None else (int(at[0]), int(at[1]))

    def lost_workers(self, ranks: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
        """Ranks the launcher reported lost and that are not (yet) back: ``{rank: info}``
        (among ``ranks``; default every worker rank, ``range(world_size)``)."""
        out = {}
        for r in range(self.world_size) if ranks is None else ranks:
            info = self._get(f"lost/{r}")
            if info is not None and self._get(f"rejoined/{r}") is None:
                out[r] = info
        return out

    # ------------------------------------------------------------------ heartbeat
    def start_heartbeat(self, rank: int, restarts_left: int = 0) -> None:
        """Beat ``alive/rank`` every ``heartbeat_s`` seconds from a daemon thread until
        :meth:`close` (or the process's death), on a store connection of its own.
        ``restarts_left``: how often this rank's agent will still restart it (while any are
        left, a silent rank is waited for until the timeout: it is coming back)."""
        self._set(f"restarts/{rank}", restarts_left)
        store = self.store
        if isinstance(store, dist.TCPStore):
            store = dist.TCPStore(store.host, store.port, is_master=False, timeout=store.timeout)
        key = f"{self.PREFIX}alive/{rank}"

        def beat() -> None:
            while not self._beating.wait(self.heartbeat_s):
                try:
                    store.add(key, 1)
                except LINK_ERRORS:  # the store's host is gone: the job is over
                    log.warning("rank %d: heartbeat stopped, the job store is unreachable", rank)
                    return

        store.add(key, 1)
        self._beat = threading.Thread(target=beat, name=f"gradfleet-heartbeat-{rank}", daemon=True)
        self._beat.start()

    def close(self) -> None:
        """Stop the heartbeat (the store itself belongs to whoever made it)."""
        self._beating.set()
        if self._beat is not None:
            self._beat.join(timeout=2 * self.heartbeat_s)

    # ------------------------------------------------------------------ arrivals
    def finished(self, rank: int) -> None:
        self._arrive("finished", rank)

    def mark_ended(self) -> None:
        """The writing rank made the job's last update."""
        self._set("ended", True)

    def ended(self) -> bool:
        return bool(self._get("ended"))

    def wait_finished(self, timeout: float) -> dict[int, str]:
        """Rank 0: wait until every rank finished, was reported lost or fell silent (at most
        ``timeout`` s), but for a restarted process still asking in (:meth:`mark_joining`):
        the members take no one in once they stopped stepping, so it would wait for them as
        they wait for it.  Returns ``{rank: cause}`` for the silent, the late and the joining
        ranks."""
        return self._wait_arrived("finished", timeout, late=f"not finished in {timeout:g}s")

    def checkpoint_saved(self, step: int, rank: int) -> None:
        self._arrive(f"checkpoint-{step}", rank)

    def wait_checkpoint(self, step: int, timeout: float) -> dict[int, str]:
        """Rank 0: wait for every live rank's checkpoint file of ``step`` (as
        :meth:`wait_finished`: a restarted process still asking in is not waited for, as the
        members take no one in while they wait here; the writer writes its file)."""
        point = f"checkpoint-{step}"
        return self._wait_arrived(point, timeout, late=f"no checkpoint {step} in {timeout:g}s")

    def joining(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` whose restarted process asks in and has not rejoined yet."""
        return [r for r in ranks if self._get(f"joining/{r}") is not None]

    # ------------------------------------------------------------------ dedicated servers
    # A dedicated server rank (one that only serves) checkpoints its own state while every
    # worker waits: rank 0 asks once every live worker saved (nothing is in flight then),
    # waits for each server's file, and then releases the workers.
    def request_server_checkpoint(self, step: int) -> None:
        self._set("servers/checkpoint", step)

    def server_checkpoint_requested(self) -> int | None:
        """The newest checkpoint step rank 0 asked the dedicated servers for (or None)."""
        return self._get("servers/checkpoint")

    def server_checkpoint_saved(self, step: int, rank: int) -> None:
        self._arrive(f"servers/checkpoint-{step}", rank)

    def wait_server_checkpoints(self, step: int, ranks: list[int], timeout: float) -> None:
        """Rank 0: wait until every dedicated server rank in ``ranks`` saved ``step``; a server
        that does not within ``timeout`` s raises ``TimeoutError`` naming it."""
        deadline = time.monotonic() + timeout
        while True:
            missing = [r for r in ranks if not self._get(f"servers/checkpoint-{step}/{r}")]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"dedicated server rank(s) {missing} saved no checkpoint of step {step} in "
                    f"{timeout:g}s"
                )
            time.sleep(0.05)

    def release_checkpoint(self, step: int) -> None:
        """Rank 0: every file of checkpoint ``step`` exists; the workers may go on."""
        self._set(f"checkpoint-{step}/complete", True)

    def wait_checkpoint_released(self, step: int, timeout: float) -> None:
        """A worker other than rank 0: wait for :meth:`release_checkpoint` (``TimeoutError``
        after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while not self._get(f"checkpoint-{step}/complete"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not complete checkpoint {step} in {timeout:g}s")
            time.sleep(0.05)

    def _arrive(self, point: str, rank: int) -> None:
        self._set(f"{point}/{rank}", True)

    def _wait_arrived(self, point: str, timeout: float, late: str) -> dict[int, str]:
        """A barrier that neither a dead member nor a restarted process that has not rejoined
        (the members take no one in while they wait here) can block."""
        start = time.monotonic()
        beats: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        while True:
            now = time.monotonic()
            lost = self.lost_workers()
            missing = [
                r for r in range(self.world_size)
                if r not in lost and not self._get(f"{point}/{r}")
            ]  # fmt: skip
            joining = self.joining(missing)
            silent = {r: f"restarted, and still joining at {point}" for r in joining}
            missing = [r for r in missing if r not in silent]
            for r in missing:
                count = self.store.add(f"{self.PREFIX}alive/{r}", 0)
                if beats.get(r, (None,))[0] != count:
                    beats[r] = (count, now)
                if now - beats[r][1] >= self.silent_after and not self._get(f"restarts/{r}"):
                    silent[r] = f"silent for {self.silent_after:g}s (no heartbeat)"
            if all(r in silent for r in missing):
                break
            if now - start > timeout:
                silent.update({r: late for r in missing if r not in silent})
                break
            time.sleep(0.05)
        for r, cause in silent.items():
            log.warning("rank %d did not arrive at %s: %s; going on without it", r, point, cause)
        return silent
