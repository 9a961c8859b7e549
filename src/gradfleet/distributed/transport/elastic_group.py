"""A group of ranks that loses members and takes restarted ones back: one process group per
generation.

A c10d process group cannot lose a rank: once a member dies every collective on it fails.  An
:class:`ElasticGroup` keeps its members' collectives on a gloo group of its own and, when one
fails or a restarted rank asks to join, forms the next *generation*: the live candidates agree
on the new members through the job's store, and build a fresh process group among them under
a prefix of that generation.

* **Failing fast.**  A member whose collective failed drops its group at once: its sockets
  close, so a member still blocked in the same collective on another link fails within
  milliseconds instead of at the collective's timeout (a 4-rank gloo job with one rank
  SIGKILLed: every survivor raised within 40 ms).  Gloo closes a group's sockets only when
  the last reference to its context goes -- the group's and each work's -- so the works never
  leave this object (callers hold numbers) and none survives in a traceback's frame.
* **A member that hangs.**  A stopped process, or a host cut off from the network, closes no
  socket: gloo would wait for it until the collective's timeout.  A member waiting on a
  collective looks at the others' heartbeats every ``_WATCH_S``
  (:class:`..common.quorum.Silence`); one that stood still for ``dead_after`` seconds is taken
  as lost, and so is this rank once a newer generation has formed without it (it was the one
  that hung, and has come back).  The collective is *abandoned*: gloo cannot cancel it, so its
  thread may still write into the tensor if the hung member comes back, and the caller must
  never use that tensor again.  The group is dropped as on any loss (its destructor, on a
  thread of its own, waits for the abandoned collective until its timeout).
* **A member that left.**  Once another member begins the next generation (it took a member
  for lost, or takes a restarted process in), no collective of this one can complete: a member
  waiting on one leaves it too (:meth:`ElasticGroup.reforming`).  Before, a member that a
  loaded machine's late heartbeat made another take for lost waited in the all-reduce until
  gloo's timeout, while the other waited for it, beating, to arrive in the next generation.
* **Who is in** (:class:`..common.quorum.Quorum`): every candidate (the last generation's
  members and the ranks asking to join) announces itself; the others are waited for until
  their heartbeat -- a counter each process adds to from a thread of its own every
  ``heartbeat_s`` -- stands still for ``dead_after`` seconds.  A member that is merely slow
  keeps beating and is waited for.  The first decision written wins (the store's
  ``compare_set``), so every member builds the same group.
* **Joining.**  A restarted process asks (``join/R``) and waits for a generation that names it;
  each member's heartbeat thread notices the request and raises :attr:`joiners_waiting`, which
  the caller passes through its next step's all-reduce so that every member forms the next
  generation at the same step.

Store keys (under ``gradfleet/elastic/`` on the job's store, never parameter-sized):
``beat/R``, ``join/R``, ``closed/R`` (R's process closed the group: a process restarted after
every other member did is told the job ended, :class:`~.errors.JobEnded`), ``gG/here/R`` (the
process's incarnation: a restarted rank has a new one), ``gG/members`` (JSON ``[[rank,
incarnation], ...]``), and ``gG/pg/...`` (generation G's own rendezvous).  A rank restarted so
fast that the survivors find it *here* before its old process counts as dead is simply a
member of the next generation; its new incarnation tells that it came back
(:meth:`ElasticGroup.reform`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..common.quorum import Quorum, Silence
from .errors import LINK_ERRORS, JobEnded, LinkLost, gloo_link

__all__ = ["ElasticGroup", "root_store"]

log = logging.getLogger(__name__)

NAMESPACE = "gradfleet/elastic/"
HEARTBEAT_S = 0.1
DEAD_AFTER_S = 1.0
_POLL_S = 0.01  # a member forming a generation: the gap after a loss
_JOIN_POLL_S = 0.05  # a joining process waiting, maybe long, for the members to see it
_FORM_S = 5.0  # a member decided in connects within this, or the next generation is decided
_WATCH_S = 0.25  # a member blocked in a collective looks at the others' heartbeats (< dead_after/2)


def root_store(store: dist.Store) -> dist.Store:
    """The store under any prefixes (``init_process_group`` wraps the job's in one)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _own_connection(store: dist.Store) -> dist.Store:
    """A store client of its own for a thread (a TCPStore client serialises its calls)."""
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=store.timeout)
    return store


class _PointToPointWaiter:
    """One thread that waits for gloo's point-to-point works, in the order they are handed
    to it, and sets each one's event (its error noted).  A thread of its own per work cost
    about 1.5 ms a wait on a loaded 2-core machine, several a step for backup workers; the
    callers wait one work at a time, so one thread keeps up.  A work that never ends (a hung
    peer) holds this thread: the caller gives it up (:meth:`ElasticGroup._watch`) and drops
    the group, and the next generation gets a new waiter (:meth:`retire`)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event, list] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._run, name="gradfleet-elastic-p2p", daemon=True)
        self.thread.start()

    def submit(self, work: Any, done: threading.Event, failure: list[BaseException]) -> None:
        self._jobs.put((work, done, failure))

    def retire(self) -> None:
        """No more works: the thread ends after the one it waits for (if any)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, done, failure = job
            try:
                work.wait()
            except RuntimeError as exc:
                failure.append(exc)
            finally:
                del work, job  # gloo's context must not outlive the group in this frame
                done.set()


class ElasticGroup:
    """Rank ``rank`` (of ranks ``0 .. world-1``) in a group that may lose and regain members
    (module docstring).  ``joining``: this process restarts a rank of a running job and waits
    until a generation takes it in."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        *,
        timeout: float,
        joining: bool = False,
        heartbeat_s: float = HEARTBEAT_S,
        dead_after: float = DEAD_AFTER_S,
    ) -> None:
        self.root = root = root_store(store)
        self.store = dist.PrefixStore(NAMESPACE, root)
        self.rank, self.world = int(rank), int(world)
        self.timeout, self.dead_after = float(timeout), min(float(dead_after), float(timeout))
        self.generation = -1
        self.device = torch.device("cpu")  # gloo: its collectives take CPU tensors
        self.members: list[int] = []
        self.incarnations: dict[int, str] = {}
        self.continuing = True  # this process was a member of the generation before this one
        self.incarnation = uuid.uuid4().hex[:12]
        self.pg: Any = None
        self.joiners_waiting = False
        self._pending: dict[int, Any] = {}  # in-flight collectives, by handle
        self._handles = 0
        self._silence: Silence | None = None  # what the last watch saw, for the next quorum
        self.abandoned = 0  # collectives given up on a silent member (module docstring)
        self._stop = threading.Event()
        self._dropping: list[threading.Thread] = []  # groups let go of, still closing
        self._p2p: _PointToPointWaiter | None = None  # this generation's
        beat_store = dist.PrefixStore(NAMESPACE, _own_connection(root))
        self.store.add(f"beat/{self.rank}", 1)
        self._beat = threading.Thread(
            target=self._beating, args=(beat_store, heartbeat_s),
            name=f"gradfleet-elastic-beat-{rank}", daemon=True,
        )  # fmt: skip
        self._beat.start()
        if joining:
            self.store.set(f"join/{self.rank}", "1")
            self._enter(self._newest_generation())
        else:
            # generation 0: every rank, as the job started
            self.store.set(f"g0/here/{self.rank}", self.incarnation)
            first = [[r, self._incarnation_of(0, r)] for r in range(world)]
            self.store.compare_set("g0/members", "", json.dumps(first))  # alike from each rank
            self._form(0, dict(first), timeout=self.timeout)  # ranks start at their own pace

    # ------------------------------------------------------------------ who is here
    @property
    def index(self) -> int:
        """This rank's place in the current generation."""
        return self.members.index(self.rank)

    @property
    def size(self) -> int:
        return len(self.members)

    def _beating(self, store: dist.Store, every: float) -> None:
        """Add to this rank's counter; notice ranks that ask to join."""
        while not self._stop.wait(every):
            try:
                store.add(f"beat/{self.rank}", 1)
                outside = [r for r in range(self.world) if r not in self.members]
                self.joiners_waiting = any(store.check([f"join/{r}"]) for r in outside)
            except LINK_ERRORS as exc:  # the store's host is gone: nothing to beat to
                log.warning("rank %d: elastic heartbeat stopped: %s", self.rank, exc)
                return

    def _incarnation_of(self, generation: int, rank: int) -> str:
        return self.store.get(f"g{generation}/here/{rank}").decode()  # waits for it

    def _decided(self, generation: int) -> dict[int, str] | None:
        """Generation ``generation``'s members and their incarnations, once decided."""
        key = f"g{generation}/members"
        if not self.store.check([key]):
            return None
        return {int(r): str(i) for r, i in json.loads(self.store.get(key))}

    def _newest_generation(self) -> int:
        g = 0
        while self.store.check([f"g{g + 1}/members"]):
            g += 1
        return g

    def _enter(self, after: int) -> None:
        """Announce this rank for the generations after ``after`` until one takes it in."""
        generation = after + 1
        deadline = time.monotonic() + self.timeout
        last, was_member = self.generation, self.incarnations.get(self.rank) == self.incarnation
        while True:
            previous = self._decided(generation - 1) or {}
            log.debug("rank %d: here for generation %d", self.rank, generation)
            self.store.set(f"g{generation}/here/{self.rank}", self.incarnation)
            members = self._decided(generation) or self._decide(generation, list(previous))
            if members.get(self.rank) == self.incarnation:
                if self._formed(generation, members):
                    break
                generation += 1  # a member died between the decision and the forming
                self._check_deadline(deadline)
                continue
            # decided before this rank arrived (or judged it gone): ask to join the next one
            log.info(
                "rank %d: generation %d formed without it (%s); asking to join the next",
                self.rank, generation, members,
            )  # fmt: skip
            self.store.set(f"join/{self.rank}", "1")
            generation += 1
            self._check_deadline(deadline)
        self.store.delete_key(f"join/{self.rank}")
        # holds the state: a member of the last generation it formed, and in every generation
        # decided since (one that did not form made no update)
        self.continuing = was_member and all(
            (self._decided(g) or {}).get(self.rank) == self.incarnation
            for g in range(last + 1, generation)
        )

    def _check_deadline(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {self.rank}: no generation of the elastic group took it in within "
                f"{self.timeout:g}s"
            )

    def _decide(self, generation: int, previous: Sequence[int]) -> dict[int, str]:
        """Wait until every candidate of ``generation`` is here or gone; write the decision
        unless another candidate wrote one first; return the one that stands.  Only a member
        of the previous generation decides: a process that is joining holds no state, and must
        never form a generation of its own from members it merely does not hear (stopped, or
        busy); it waits for theirs."""
        if self.rank not in previous or self.incarnations.get(self.rank) != self.incarnation:
            return self._wait_decided(generation)
        candidates = set(previous) | {self.rank}
        candidates |= {r for r in range(self.world) if self.store.check([f"join/{r}"])}
        # a silence the watch already saw counts on: the gap after a hung member is one dead_after
        quorum = Quorum(
            candidates, self.dead_after, self.timeout, time.monotonic(), silence=self._silence
        )
        self._silence = None
        while True:
            decided = self._decided(generation)
            if decided is not None:
                return decided
            here = [r for r in candidates if self.store.check([f"g{generation}/here/{r}"])]
            beats = {r: self.store.add(f"beat/{r}", 0) for r in candidates if r not in here}
            members = quorum.observe(time.monotonic(), here, beats)
            if members is not None:
                mine = [[r, self._incarnation_of(generation, r)] for r in members]
                self.store.compare_set(f"g{generation}/members", "", json.dumps(mine))
                decided = self._decided(generation)
                assert decided is not None  # compare_set wrote it, or another candidate did
                if list(decided) == members:
                    gone = sorted(candidates - set(members))
                    log.warning(
                        "elastic group generation %d: members %s (gone: %s%s)",
                        generation, members, gone or "none",
                        f"; stuck: {sorted(quorum.stuck)}" if quorum.stuck else "",
                    )  # fmt: skip
                return decided
            time.sleep(_POLL_S)

    def _wait_decided(self, generation: int) -> dict[int, str]:
        """A joining process: the members' decision on ``generation`` (they see the request
        in their next step).  ``JobEnded`` once every other member of the generation before
        has closed the group: the job ended before it could take this process in."""
        deadline = time.monotonic() + self.timeout
        while (decided := self._decided(generation)) is None:
            if self._members_left(generation - 1):
                raise JobEnded(
                    f"rank {self.rank}: every member of the running job's group (generation "
                    f"{generation - 1}) has left it: the job ended before this process could join"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.rank}: the running job's members formed no generation with it "
                    f"within {self.timeout:g}s (stopped, or gone)"
                )
            time.sleep(_JOIN_POLL_S)
        return decided

    def _members_left(self, generation: int) -> bool:
        """Whether every member of ``generation`` but this rank (whose old process is gone:
        this one restarts it) has closed the group -- as that process, not an earlier one."""
        others = {r: i for r, i in (self._decided(generation) or {}).items() if r != self.rank}
        for r, incarnation in others.items():
            key = f"closed/{r}"
            if not self.store.check([key]) or self.store.get(key).decode() != incarnation:
                return False
        return bool(others)

    def _formed(self, generation: int, members: dict[int, str]) -> bool:
        """Generation ``generation``'s group, formed (True); or False when a member decided in
        died before it connected: gloo would wait for it until the job's timeout, so the
        members give up after ``_FORM_S`` and decide the next generation, without it."""
        try:
            self._form(generation, members, timeout=min(self.timeout, _FORM_S))
        except LINK_ERRORS as exc:
            log.warning(
                "rank %d: generation %d of the elastic group did not form (%s); deciding "
                "the next", self.rank, generation, exc,
            )  # fmt: skip
            return False
        self.pg._set_default_timeout(timedelta(seconds=self.timeout))
        return True

    def _form(self, generation: int, members: dict[int, str], timeout: float) -> None:
        """Build generation ``generation``'s process group among ``members`` (rank ->
        incarnation), each peer connected within ``timeout`` seconds; this rank takes the
        generation only once it is formed."""
        log.debug("rank %d: forming generation %d: %s", self.rank, generation, members)
        store = dist.PrefixStore(f"g{generation}/pg/", self.store)
        size, index = len(members), sorted(members).index(self.rank)
        with gloo_link(f"generation {generation}'s members {sorted(members)}", "connecting"):
            pg = dist.ProcessGroupGloo(store, index, size, timedelta(seconds=timeout))
        self.generation, self.members, self.incarnations = generation, sorted(members), members
        self.pg = pg
        log.debug("rank %d: generation %d formed", self.rank, generation)
        self.joiners_waiting = False

    # ------------------------------------------------------------------ changing generation
    def reform(self) -> tuple[list[int], list[int]]:
        """Drop this generation's group and form the next one (its members decided through
        the store, module docstring).  Returns the ranks gone -- old members not in it, or
        in it as a new process -- and the ranks that came (back): new members, or new
        processes of old ones."""
        old = dict(self.incarnations)
        self.drop()
        self._enter(self.generation)
        gone = [r for r in old if self.incarnations.get(r) != old[r]]
        came = [r for r in self.members if old.get(r) != self.incarnations[r]]
        return gone, came

    def drop(self) -> None:
        """Let go of the current process group, so that its links close: a member still
        blocked in one of its collectives fails at once.  Its works are finished on a thread
        of its own (the group's destructor runs what is queued)."""
        pg, self.pg = self.pg, None
        self._pending.clear()  # the last references to gloo's context are the group's
        self._retire_waiter()
        if pg is None:
            return
        holder = [pg]
        del pg
        dropping = threading.Thread(target=holder.clear, name="gradfleet-drop-group", daemon=True)
        dropping.start()
        self._dropping.append(dropping)

    def close(self) -> None:
        """The end: stop the heartbeat and release the group here and now (nothing is in
        flight), not on a thread the interpreter's exit could cut short inside gloo's
        destructor (``terminate called without an active exception``)."""
        self._stop.set()
        with contextlib.suppress(*LINK_ERRORS):  # a process restarted too late is told (_enter)
            self.store.set(f"closed/{self.rank}", self.incarnation)
        self._pending.clear()
        self._retire_waiter()
        self.pg = None  # the last reference: gloo's destructor runs on this thread
        self._beat.join(timeout=1.0)
        # groups let go after a loss: their destructors end once their works have (a lost
        # peer's at once, a silent one's at the group's timeout)
        for dropping in self._dropping:
            dropping.join(timeout=self.timeout)
        self._dropping = [t for t in self._dropping if t.is_alive()]
        if self._dropping:
            log.warning("elastic group: %d released group(s) still closing", len(self._dropping))

    # ------------------------------------------------------------------ collectives
    def _peer(self) -> str:
        return f"a member of the elastic group (generation {self.generation}: {self.members})"

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> int | None:
        """Sum ``tensor`` over the members; with ``async_op`` a handle for :meth:`wait`."""
        with gloo_link(self._peer(), "all_reduce"):  # no local holds the group (``wait``)
            handle = self._hold(self._live().allreduce([tensor]))
        if async_op:
            return handle
        self.wait(handle)
        return None

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``tensor`` := member index ``src``'s."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        with gloo_link(self._peer(), "broadcast"):
            handle = self._hold(self._live().broadcast([tensor], opts))
        self.wait(handle)

    def isend(self, tensor: torch.Tensor, dst: int) -> int:
        """Send ``tensor`` to member ``dst`` (a rank); a handle for :meth:`wait`, which
        returns once ``dst`` has received it."""
        with gloo_link(self._peer(), "send"):
            return self._hold(self._live().send([tensor], self.members.index(dst), 0))

    def irecv(self, tensor: torch.Tensor, src: int) -> int:
        """Receive ``tensor`` from member ``src`` (a rank); a handle for :meth:`wait`."""
        with gloo_link(self._peer(), "recv"):
            return self._hold(self._live().recv([tensor], self.members.index(src), 0))

    def reforming(self) -> str | None:
        """Why this generation is ending, or None: another member has begun forming the next
        one (it met a lost member, or takes a restarted one in), or it was formed already."""
        after = self.generation + 1
        if self._decided(after) is not None:
            return f"generation {after} formed"
        for r in self.members:
            if r != self.rank and self.store.check([f"g{after}/here/{r}"]):
                return f"rank {r} is forming generation {after}"
        return None

    def wait(self, handle: int) -> None:
        """Until the collective ``handle`` is done; a lost member's error as ``LinkLost``."""
        work = self._pending.pop(handle)
        failure: list[BaseException] = []
        silent = None
        try:
            done, waited = self._done_event(work, failure)
            silent = self._watch(done)
            if silent is None and not waited:
                work.wait()  # done: raises the collective's own error, if it had one
        except RuntimeError as exc:
            failure.append(exc)
        finally:
            # no frame of a traceback may keep the work: it holds gloo's context, whose
            # sockets must close when the group is dropped (module docstring)
            del work
        if silent is not None:
            self.abandoned += 1
            raise LinkLost(f"{self._peer()}: collective abandoned: {silent}")
        if failure:
            with gloo_link(self._peer(), "collective"):
                raise failure[0]

    def _done_event(self, work: Any, failure: list[BaseException]) -> tuple[threading.Event, bool]:
        """An event set when ``work`` is done, and whether it was waited for already.  A
        collective's future says so; gloo's point-to-point works have no future (and never
        report themselves completed), so this generation's waiter thread waits for them --
        once: a second ``wait()`` of a receive waits for another message -- holding the work
        until gloo ends it (a lost peer fails it at once, a silent one at the group's
        timeout), and notes its error."""
        done = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _: done.set())
            return done, False
        except RuntimeError:  # "Work::getFuture not implemented"
            pass
        if self._p2p is None:
            self._p2p = _PointToPointWaiter()
        self._p2p.submit(work, done, failure)
        return done, True

    def _retire_waiter(self) -> None:
        """The waiter of a generation that ends: it stops after the work it holds (one a hung
        peer never ends stays with it until gloo's timeout, behind no other)."""
        if self._p2p is not None:
            self._p2p.retire()
            self._p2p = None

    def _watch(self, done: threading.Event) -> str | None:
        """Wait until ``done`` is set (None), or say why it never will be (:meth:`watcher`)."""
        check = self.watcher()
        while not done.wait(_WATCH_S):
            if why := check():
                return why
        return None

    def watcher(self) -> Callable[[], str | None]:
        """A check to call every ``_WATCH_S`` or so while waiting on the members: why the
        wait will never end, or None -- a member whose heartbeat stood still for
        ``dead_after``, a newer generation formed without this rank, or another member
        forming the next one (module docstring: a member that left)."""
        others = [r for r in self.members if r != self.rank]
        silence = Silence(self.dead_after)

        def check() -> str | None:
            beats = {r: self.store.add(f"beat/{r}", 0) for r in others}
            silent = silence.observe(time.monotonic(), beats)
            if silent:
                self._silence = silence  # the next quorum goes on from these observations
                return (
                    f"the heartbeat of rank(s) {sorted(silent)} stood still for "
                    f"{self.dead_after:g}s (stopped, or cut off)"
                )
            if self._decided(self.generation + 1) is not None:
                return (
                    f"generation {self.generation + 1} formed without rank {self.rank} (it "
                    "was silent, and is back)"
                )
            return self.reforming()  # a peer this waits for may be among those re-forming

        return check

    def hold(self, work: Any) -> int:
        """Keep a work of another process group among the members (the first-R exchange's
        groups of an update's members) here, to be waited for, watched, with :meth:`wait`."""
        return self._hold(work)

    def _live(self) -> Any:
        if self.pg is None:
            raise ConnectionError(f"rank {self.rank}: the elastic group is being re-formed")
        return self.pg

    def _hold(self, work: Any) -> int:
        """Keep ``work`` here only (callers hold a number)."""
        self._handles += 1
        self._pending[self._handles] = work
        return self._handles
