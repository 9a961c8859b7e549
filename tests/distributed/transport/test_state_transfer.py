"""A live peer's state sent to the ranks behind: the structure and every tensor bit for bit,
on the data plane (one buffer), the skeleton read with ``weights_only``; a rank neither
sending nor receiving takes no part."""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed.transport import state_transfer
from gradfleet.distributed.transport.state_transfer import send_state


class Recorder:
    """Point-to-point messages seen from one rank: each send is kept per destination, and a
    receiving rank's receives replay that rank's in order (what a process group does between
    two ranks, without processes)."""

    def __init__(self) -> None:
        self.sent: dict[int, list[torch.Tensor]] = {}
        self.replay: list[torch.Tensor] | None = None

    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        self.sent.setdefault(dst, []).append(tensor.clone())

    def irecv(self, tensor: torch.Tensor, src: int) -> None:
        assert self.replay is not None and src == 0
        tensor.copy_(self.replay.pop(0))

    def wait(self, handle: None) -> None:
        pass


def test_an_optimizer_state_arrives_whole():
    w = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam([w, b], lr=0.1)
    for _ in range(3):
        (w.sum() ** 2 + (b * 2).sum()).backward()
        opt.step()
    books = {"global_step": 3, "stats": {0: {"a": 1}}}
    flags = torch.tensor([True, False])
    state = {"optimizer": opt.state_dict(), "books": books, "flags": flags,
             "empty": torch.empty(0, 4), "n": None}  # fmt: skip
    group = Recorder()
    assert send_state(group, state, 0, 0, [2, 3], torch.device("cpu")) is state
    tensor_bytes = (
        sum(
            t.numel() * t.element_size()
            for t in [
                *opt.state_dict()["state"][0].values(),
                *opt.state_dict()["state"][1].values(),
            ]
        )
        + 2
    )  # the flags
    assert sorted(group.sent) == [2, 3]  # only the ranks named
    for sent in group.sent.values():  # size, skeleton, data
        assert len(sent) == 3 and sent[2].numel() == tensor_bytes
    bystander = Recorder()
    assert send_state(bystander, None, 0, 1, [2, 3], torch.device("cpu")) is None
    assert bystander.sent == {}
    group.replay = list(group.sent[3])
    got = send_state(group, None, 0, 3, [2, 3], torch.device("cpu"))
    assert group.replay == []
    assert got["books"] == state["books"] and got["n"] is None
    assert torch.equal(got["flags"], state["flags"]) and got["empty"].shape == (0, 4)
    fresh = torch.optim.Adam(
        [torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(b.detach().clone())], lr=0.5
    )
    fresh.load_state_dict(got["optimizer"])
    mine, theirs = fresh.state_dict(), opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for i in (0, 1):
        for key, value in theirs["state"][i].items():
            assert mine["state"][i][key].dtype == value.dtype
            assert torch.equal(mine["state"][i][key], value), key


def test_a_state_larger_than_a_piece_arrives_whole_in_pieces_a_window_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state_transfer, "CHUNK_BYTES", 7)
    waited: list[int] = []

    class Counting(Recorder):
        """Counts what is in flight: posted and not yet waited for."""

        def __init__(self) -> None:
            super().__init__()
            self.posted = 0

        def isend(self, tensor: torch.Tensor, dst: int) -> int:
            super().isend(tensor, dst)
            self.posted += 1
            return self.posted

        def irecv(self, tensor: torch.Tensor, src: int) -> int:
            super().irecv(tensor, src)
            self.posted += 1
            return self.posted

        def wait(self, handle: int) -> None:
            waited.append(self.posted - len(waited))

    state = {"a": torch.arange(10, dtype=torch.float64), "b": [torch.arange(3).to(torch.int8)]}
    sender = Counting()
    send_state(sender, state, 0, 0, [1], torch.device("cpu"))
    data = sender.sent[1][2:]  # after the size and the skeleton
    assert [c.numel() for c in data] == [7] * 11 + [6]  # 83 bytes
    assert max(waited) <= state_transfer.WINDOW  # never more pieces in flight
    receiver = Counting()
    receiver.replay = list(sender.sent[1])
    got = send_state(receiver, None, 0, 1, [1], torch.device("cpu"))
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"][0], state["b"][0])
