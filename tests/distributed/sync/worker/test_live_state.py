"""Healing from a live member, in one process: members as threads of a small in-memory group
(sums over a barrier, point-to-point messages through queues), so each case -- one behind, a
fresh process, all even, a model of another shape -- is exact and quick."""

from __future__ import annotations

import queue
import threading

import torch

from gradfleet.distributed.sync.worker.live_state import LiveState


class ThreadGroup:
    """``size`` members, one thread each, meeting at a barrier for every collective."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier = size, threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.members = list(range(size))
        self.device = torch.device("cpu")
        self.queues: dict[tuple[int, int], queue.SimpleQueue] = {
            (a, b): queue.SimpleQueue() for a in range(size) for b in range(size)
        }

    def member(self, index: int, continuing: bool = True) -> ThreadMember:
        return ThreadMember(self, index, continuing)


class ThreadMember:
    def __init__(self, group: ThreadGroup, index: int, continuing: bool = True) -> None:
        self.shared, self.index, self.rank = group, index, index
        self.continuing = continuing
        self.size, self.members, self.device = group.size, group.members, group.device

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.shared.slots[self.index] = tensor.clone()
        self.shared.barrier.wait()
        total = sum(self.shared.slots)  # type: ignore[arg-type]
        self.shared.barrier.wait()
        tensor.copy_(total)

    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        self.shared.queues[(self.rank, dst)].put(tensor.clone())

    def irecv(self, tensor: torch.Tensor, src: int) -> None:
        tensor.copy_(self.shared.queues[(src, self.rank)].get(timeout=10))

    def wait(self, handle: None) -> None:
        pass


def _member(
    steps: int, width: int = 4, scale: float = 1.0
) -> tuple[torch.nn.Parameter, torch.optim.Optimizer, dict]:
    """A member that made ``steps`` Adam updates from a fixed start (gradients x ``scale``)."""
    w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, width, dtype=torch.float64))
    opt = torch.optim.Adam([w], lr=0.1)
    for k in range(steps):
        w.grad = torch.cos(w.detach() * (k + 1)) * scale
        opt.step()
    return w, opt, {"global_step": steps, "stats": {0: {"accepted": steps}}}


def _heal_all(
    held: list[int], widths: list[int] | None = None, back: frozenset[int] = frozenset()
) -> list:
    """Heal members holding the steps ``held``; those in ``back`` do not continue (they made
    their updates from other gradients)."""
    group = ThreadGroup(len(held))
    widths = widths or [4] * len(held)
    members = [_member(max(h, 0), widths[i], 3.0 if i in back else 1.0) for i, h in enumerate(held)]
    out: list = [None] * len(held)

    def run(i: int) -> None:
        w, opt, books = members[i]

        def load(b: dict) -> None:
            books.clear()
            books.update(b)

        live = LiveState([w], opt, lambda: dict(books), load, "Owner")
        try:
            out[i] = live.heal(group.member(i, i not in back), held[i])
        except ValueError as exc:
            out[i] = exc
            group.barrier.abort()  # the others' collectives end too

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(held))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [(out[i], *members[i]) for i in range(len(held))]


def test_members_behind_take_the_newest_state_exactly():
    healed = _heal_all([5, 6, 5])
    reference_w, reference_opt, reference_books = healed[1][1:]
    for step, w, opt, books in healed:
        assert step == 6
        assert torch.equal(w.detach(), reference_w.detach())
        assert books == reference_books
        mine, theirs = opt.state_dict()["state"][0], reference_opt.state_dict()["state"][0]
        assert set(mine) == set(theirs)
        for key in theirs:
            assert torch.equal(mine[key], theirs[key]), key
    # and they go on alike: one more identical update leaves them bit-identical
    for _, w, opt, _ in healed:
        w.grad = torch.cos(w.detach() * 7)
        opt.step()
    assert all(torch.equal(w.detach(), healed[0][1].detach()) for _, w, _, _ in healed)


def test_a_fresh_process_heals_from_a_member():
    (step0, w0, opt0, books0), (step1, w1, opt1, books1) = _heal_all([4, -1])
    assert step0 == step1 == 4 and books1 == books0 and torch.equal(w1, w0)
    assert torch.equal(
        opt1.state_dict()["state"][0]["exp_avg"], opt0.state_dict()["state"][0]["exp_avg"]
    )


def test_even_members_move_nothing():
    (s0, w0, _, _), (s1, w1, _, _) = _heal_all([3, 3])
    assert s0 == s1 == 3 and torch.equal(w0, w1)


def test_another_model_is_refused_naming_both():
    (_, w0, _, _), (err, w1, _, books1) = _heal_all([3, -1], widths=[4, 5])
    assert isinstance(err, ValueError)
    assert "has parameters [([5], 'torch.float64')]" in str(
        err
    ) and "([4], 'torch.float64')" in str(err)
    assert books1["global_step"] == 0  # nothing loaded


def test_a_member_that_comes_back_at_the_same_step_takes_the_state_of_one_that_continued():
    """Rank 0 hung, was left out, and came back holding step 5 made otherwise (a collective the
    others gave up on, completed when it came back): its state never counts, even as the
    first member at the newest step."""
    healed = _heal_all([5, 5, 5], back=frozenset({0}))
    reference = _member(5)[0]
    for step, w, _, _ in healed:
        assert step == 5
        assert torch.equal(w.detach(), reference.detach())


def test_the_newest_step_is_that_of_the_members_that_continue():
    healed = _heal_all([7, 5, 6], back=frozenset({0}))
    reference = _member(6)[0]
    for step, w, _, books in healed:
        assert step == 6 and books["global_step"] == 6
        assert torch.equal(w.detach(), reference.detach())
