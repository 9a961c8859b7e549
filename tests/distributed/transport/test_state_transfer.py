"""A live peer's state broadcast to a group: the structure and every tensor bit for bit, on
the data plane (one buffer), the skeleton read with ``weights_only``."""

from __future__ import annotations

import torch

from gradfleet.distributed.transport.state_transfer import broadcast_state


class Recorder:
    """A two-member group seen from one side: member ``src``'s broadcasts are replayed to
    the other in order (what a process group does, without processes)."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.replay: list[torch.Tensor] | None = None

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.replay is None:
            self.sent.append(tensor.clone())
        else:
            tensor.copy_(self.replay.pop(0))


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
    assert broadcast_state(group, state, 0, 0, torch.device("cpu")) is state
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
    assert len(group.sent) == 3 and group.sent[2].numel() == tensor_bytes  # size, skeleton, data
    group.replay = list(group.sent)
    got = broadcast_state(group, None, 0, 1, torch.device("cpu"))
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
