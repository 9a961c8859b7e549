"""``SyncReplicasOptimizer.stream_reads(model)``: ``step()`` returns with its token and each
module's next forward waits for the shards of its own parameters.

The reference is the same optimizer reading in ``step()`` (itself checked against TF's oracles
and the float64 simulations in test_sync_replicas.py and test_sync_overlap.py): the servers see
the same pushes, the workers load the same values, so every forward must use bit-identical
parameters.  In process (servers on threads of the worker's process): a shard's load held back
shows that ``step()`` returns before it and that forward, ``state_dict()`` and the next step
wait for it.  Over real processes (gloo pairs): shards on the workers and on dedicated ranks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gradfleet.distributed.testing import run_ranks
from tests.distributed.sync import overlap_ranks

from .test_sync_overlap import _batch, _equal, _loss, _model, _sync


def _train(stream: bool, overlap: bool, shards: int, steps: int = 4, how="round_robin"):
    model = _model()
    opt = _sync(model, overlap, shards, shard_assignment=how)
    used = []
    try:
        if stream:
            opt.stream_reads(model)
        for step in range(steps):
            opt.zero_grad()
            loss = _loss(model, step)
            used.append([p.detach().clone() for p in model.parameters()])
            loss.backward()
            opt.step()
        final = [v.clone() for v in model.state_dict().values()]
        return used, final, opt.global_step, dict(opt.counters), opt.last_gradient_accepted
    finally:
        opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shards", [2, 3])
def test_forwards_use_the_values_a_read_in_step_loads(shards, overlap):
    streamed = _train(True, overlap, shards)
    read = _train(False, False, shards)
    for a, b in zip(streamed[0], read[0], strict=True):
        _equal(a, b)
    _equal(streamed[1], read[1])
    assert streamed[2:] == read[2:] == (4, {"accepted": 4, "dropped": 0}, True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
def test_backward_order_streamed_loads_what_a_read_in_step_loads(overlap):
    """Shards in backward order: with overlap the last layer's shard completes, is pushed and
    (streamed) lands during backward; every forward still uses the values of a read in step()."""
    streamed = _train(True, overlap, 2, how="backward_order")
    read = _train(False, False, 2, how="backward_order")
    for a, b in zip(streamed[0], read[0], strict=True):
        _equal(a, b)
    _equal(streamed[1], read[1])
    assert streamed[2:] == read[2:] == (4, {"accepted": 4, "dropped": 0}, True)


@pytest.mark.timeout(60)
def test_with_overlap_a_shards_answer_is_taken_while_backward_computes_earlier_layers():
    """R = N = 1: a push is an update.  The last layer's shard (backward order) is complete
    before backward reaches the input; by then its answer with the new values is being
    received, without step()."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5), torch.nn.Tanh(),
        torch.nn.Linear(5, 2),
    ).double()  # fmt: skip
    last = model[4].weight
    opt = _sync(model, True, 2, shard_assignment="backward_order")
    try:
        opt.stream_reads(model)
        layout = opt.exchange.layout
        assert any(layout.pieces[j].index == 4 for j in layout.parts[0])  # shard 0: last layer
        before = last.detach().clone()
        seen = []

        def at_the_input(grad):  # backward's last node: the first layer is being done
            end = time.monotonic() + 10
            while 0 not in opt.exchange.links.taker.answered and time.monotonic() < end:
                time.sleep(0.01)
            seen.append(0 in opt.exchange.links.taker.answered)
            return grad

        x, y = _batch(0)
        x = x.clone().requires_grad_()
        x.register_hook(at_the_input)
        ((model(x) - y) ** 2).mean().backward()
        # the in-process link copies the values in at the end of the step; gloo's receives
        # them in place as they arrive (the process test below): here its receive is posted
        assert seen == [True], "shard 0's answer waited for step()"
        opt.step()
        opt.wait_reads()
        assert opt.global_step == 1 and opt.last_gradient_accepted is True
        assert not torch.equal(last.detach(), before)
    finally:
        opt.close()


class _HeldLoad:
    """Holds the taker's load of shard ``k`` until :meth:`release` (then loads as before)."""

    def __init__(self, opt, k: int) -> None:
        self.taker, self.k = opt.exchange.links.taker, k
        self.load, self.gate, self.released = self.taker.load, threading.Event(), False
        self.taker.load = self._load

    def _load(self, k, values):
        if k == self.k:
            assert self.gate.wait(20), "never released"
        self.load(k, values)

    def release_later(self, seconds: float = 0.3) -> None:
        def go():
            self.released = True
            self.gate.set()

        threading.Timer(seconds, go).start()


def _one_step_streamed():
    """One streamed step with shard 1's load held back: (model, opt, hold, values before)."""
    model = _model()
    opt = _sync(model, False, 2, shard_assignment="round_robin")
    opt.stream_reads(model)
    hold = _HeldLoad(opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    opt.step()
    return model, opt, hold, before


def _after_one_step():
    used, *_ = _train(False, False, 2, steps=2)
    return used[1]


@pytest.mark.timeout(60)
def test_step_returns_before_a_shards_values_and_forward_waits_for_them():
    model, opt, hold, before = _one_step_streamed()
    try:
        assert opt.reads_pending and opt.local_step == 1
        # round robin: shard 1 holds the biases; they are still the old values
        params = list(model.parameters())
        _equal([params[1], params[3]], [before[1], before[3]])
        hold.release_later()
        model(_batch(1)[0])  # the first Linear holds a shard-1 bias: its forward waits
        assert hold.released, "forward ran before shard 1's values were loaded"
        assert not opt.reads_pending
        _equal([p.detach() for p in model.parameters()], _after_one_step())
        assert opt.last_gradient_accepted is True and opt.counters["accepted"] == 1
        assert opt.global_step == 1
    finally:
        opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use", ["model.state_dict", "opt.state_dict", "opt.step", "wait_reads"])
def test_every_other_use_waits_for_every_shard(use):
    model, opt, hold, _ = _one_step_streamed()
    try:
        hold.release_later()
        if use == "model.state_dict":
            values = [v.clone() for v in model.state_dict().values()]
        elif use == "opt.state_dict":
            assert opt.state_dict()["wrapper_state"]["counters"] == {"accepted": 1, "dropped": 0}
        elif use == "opt.step":  # no forward: the next step waits for the last one's reads
            for p in model.parameters():
                p.grad = torch.ones_like(p)  # the shape only: the values are not read
            opt.step()
            assert opt.counters["accepted"] == 1 and opt.reads_pending  # the second's pending
            opt.wait_reads()
            assert opt.counters["accepted"] == 2 and opt.global_step == 2
        else:
            opt.wait_reads()
        assert hold.released, f"{use} did not wait for shard 1"
        if use == "model.state_dict":
            _equal(values, _after_one_step())
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_close_removes_the_hooks_and_errors_name_what_is_allowed():
    model = _model()
    one = _sync(model, False, 1)
    with pytest.raises(ValueError, match=r"stream_reads: needs transport='server' with several"):
        one.stream_reads(model)
    one.close()
    opt = _sync(model, False, 2)
    try:
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, got list"):
            opt.stream_reads(list(model.parameters()))
        with pytest.raises(ValueError, match="no parameter of this optimizer is in model"):
            opt.stream_reads(torch.nn.Linear(2, 2))
        assert not opt.streaming
        opt.stream_reads(model)
        assert opt.streaming and model[0]._forward_pre_hooks
    finally:
        opt.close()
    assert not opt.streaming and not model[0]._forward_pre_hooks


# --------------------------------------------------------------------- real processes
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("world", "server_ranks", "how"),
    [(2, [0, 1], "bytes"), (4, [2, 3], "bytes"), (4, [2, 3] * 2, "backward_order")],
    ids=["on-workers", "dedicated", "dedicated-backward-order"],
)
def test_over_processes_same_as_reading_in_step(world, server_ranks, how):
    """In backward order with overlap, the last layers' shards are pushed, and (streamed) their
    values received in place, while backward computes the first layers."""
    args = (2, server_ranks, 5, how)
    out = run_ranks(overlap_ranks.streamed_lockstep, world, args=args, timeout=130)
    for rank in (0, 1):
        runs = out[rank]
        want = runs["read in step"]
        assert want["global_step"] == 5 and want["counters"] == {"accepted": 5, "dropped": 0}
        for mode in ("streamed", "streamed+overlap"):
            got = runs[mode]
            for a, b in zip(got["used"], want["used"], strict=True):
                _equal(a, b)
            _equal(got["final"], want["final"])
            assert (got["global_step"], got["counters"], got["accepted"]) == (
                want["global_step"], want["counters"], want["accepted"],
            )  # fmt: skip


def test_a_step_claims_only_the_global_step_whose_values_it_holds():
    """Stale pushes answered without values: the shards are at step 15 but this worker holds
    step 14 of both and its token is 14, so nothing is read again.  The step it has seen is
    14; claiming 15 would end a `while opt.global_step < last_step` loop on older values
    than the other workers end on."""
    from gradfleet.distributed.sync.worker.pending_step import PendingStep

    class Taker:
        def wait_loaded(self, k, timeout):
            return {"accepted": False, "step": 15, "version": 14}

        def end(self, timeout):
            return {k: self.wait_loaded(k, timeout) for k in (0, 1)}

    class Clients:
        def __init__(self):
            self.timeout, self.versions, self.reads = 5.0, {0: 14, 1: 14}, []

        def read(self, shards, into, load):
            self.reads.append(list(shards))

    token = {"token": 14, "global_step": 14, "accepted": False}
    clients = Clients()
    result = PendingStep(clients, Taker(), token, [0, 1], load=None).finish()
    assert clients.reads == [[]]  # none behind the token: nothing read again
    assert result["global_step"] == 14 and result["token"] == 14
