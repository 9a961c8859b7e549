"""The exchange a SyncReplicasOptimizer gets when ``transport`` is left out, and the losses it
goes on without when ``max_losses`` is (``sync.arguments``; no process group: one process is
a world of one, so N = 1 is "one process per worker" and a worker rejoining stands for N)."""

from __future__ import annotations

import pytest

from gradfleet.distributed.sync.arguments import check_standby, choose_transport, default_losses


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # R = N = the world, one gradient each, no server named: the all-reduce
        ({"R": 1, "N": 1}, "allreduce"),
        # backups (a rejoining worker stands for a world of N), CPU on gloo: no server either
        ({"R": 2, "N": 3, "rejoining": True}, "allreduce"),
        ({"R": 3, "N": 3, "chosen": True, "rejoining": True}, "allreduce"),
        # backups with CUDA parameters (NCCL): the server
        ({"R": 2, "N": 3, "rejoining": True, "cpu_gloo": False}, "server"),
        ({"R": 3, "N": 3, "rejoining": True, "cpu_gloo": False}, "allreduce"),  # R = N: DDP's
        # a server named, TF's shared queue, an option only a server has, or the asked-for one
        ({"R": 2, "N": 3, "rejoining": True, "named": True}, "server"),
        ({"R": 2, "N": 3, "rejoining": True, "tokens": "shared"}, "server"),
        ({"R": 2, "N": 3, "rejoining": True, "server_only": True}, "server"),
        ({"R": 2, "N": 3, "rejoining": True, "transport": "server"}, "server"),
        ({"R": 3, "N": 2, "rejoining": True, "tokens": "shared"}, "server"),  # R > N
        # more workers than processes (or dedicated server ranks): the server
        ({"R": 2, "N": 3}, "server"),
    ],
)
def test_the_exchange_left_to_choose(args: dict, expected: str) -> None:
    got = choose_transport(
        args.get("transport"), args["R"], args["N"], args.get("tokens", "distinct"),
        args.get("named", False), args.get("chosen", False), args.get("rejoining", False),
        cpu_gloo=args.get("cpu_gloo", True), server_only=args.get("server_only", False),
    )  # fmt: skip
    assert got == expected


def test_losses_allowed_by_default_where_every_rank_keeps_the_state() -> None:
    # backups without a server: as many as leave an update possible
    assert default_losses(None, "allreduce", True, 3, 4, False) == 1
    assert default_losses(None, "allreduce", True, 1, 4, False) == 3
    assert default_losses(None, "allreduce", True, 4, 4, True) == 3  # "auto": R follows
    # R = N (a loss ends it, as DDP), or a server (rank 0 holds the state): none
    assert default_losses(None, "allreduce", False, 4, 4, False) == 0
    assert default_losses(None, "server", True, 3, 4, False) == 0
    # given: as given (0 turns it off)
    assert default_losses(0, "allreduce", True, 3, 4, False) == 0
    assert default_losses(2, "allreduce", False, 4, 4, False) == 2


def test_a_servers_checkpoint_is_refused_by_the_default_exchange_naming_the_way_back() -> None:
    """A checkpoint of a job that ran with a server (an earlier default) is not loaded into
    the exchange without one: the error says how to resume it as it ran, and nothing changes."""
    import torch

    import gradfleet
    from gradfleet.distributed import SyncReplicasOptimizer

    x = torch.nn.Parameter(torch.ones(2))
    with SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer([x], 0.5), 1, transport="server"
    ) as served:
        x.grad = torch.ones(2)
        served.step()
        saved = served.state_dict()
    y = torch.nn.Parameter(torch.zeros(2))
    with SyncReplicasOptimizer(gradfleet.GradientDescentOptimizer([y], 0.5), 1) as default:
        assert type(default.exchange).__name__ == "AllReduceExchange"
        with pytest.raises(ValueError, match="pass transport='server' to resume it as it ran"):
            default.load_state_dict(saved)
        assert default.global_step == 0 and torch.equal(y.detach(), torch.zeros(2))


@pytest.mark.parametrize(
    ("given", "transport", "ranks", "R", "N", "chosen", "joining", "grouped", "expected"),
    [
        # default: on with one server where the job does without a host
        (None, "server", [0], 2, 3, False, False, True, True),  # backups
        (None, "server", [3], 3, 3, False, False, True, True),  # a dedicated chief, R = N
        (None, "server", [0], 3, 3, False, False, True, False),  # lockstep on a worker
        (None, "server", [0, 1], 2, 3, False, False, True, False),  # several shards
        (None, "server", [0], 3, 3, True, False, True, True),  # a chosen R: backups
        (None, "server", [0, 1], 3, 3, True, False, True, False),  # ... over several shards
        (None, "server", [0], 2, 3, False, True, True, False),  # a process joining
        (None, "server", [0], 2, 3, False, False, False, False),  # no process group
        (None, "allreduce", [0], 2, 3, False, False, True, False),  # no server
        # asked for: kept
        (True, "server", [0], 3, 3, False, False, True, True),
        (2, "server", [0], 2, 3, False, False, True, 2),
        (False, "server", [0], 2, 3, False, False, True, False),
        (True, "server", [0], 2, 3, False, True, False, True),  # joining: become the standby
        (True, "server", [0, 1], 2, 3, False, False, True, True),  # a standby per shard
        (True, "server", [3, 4], 3, 3, False, False, True, True),  # per dedicated server
        # a chosen R: its standby takes each R from the chief
        (True, "server", [0], 3, 3, True, False, True, True),
        (1, "server", [3], 3, 3, True, False, True, 1),  # the chief on a dedicated rank
        (True, "server", [0, 1], 3, 3, True, False, True, True),  # ... a standby per shard
    ],
)
def test_standby_default_and_kept(given, transport, ranks, R, N, chosen, joining, grouped,
                                  expected):  # fmt: skip
    got = check_standby(given, transport, ranks, R, N, chosen, joining, grouped)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    ("given", "transport", "ranks", "chosen", "grouped", "words"),
    [
        ("yes", "server", [0], False, True, "True (chosen), False (none) or a worker rank"),
        (3, "server", [0], False, True, "a worker rank in [0, 3)"),
        (0, "server", [0], False, True, "other than the chief's"),
        (True, "allreduce", [0], False, True, "transport='allreduce' has none"),
        (2, "server", [0, 1], False, True, "pass standby=True (a standby per shard"),
        (True, "server", [0], False, False, "initialise torch.distributed first"),
    ],
)
def test_a_standby_that_cannot_be_kept_is_refused_naming_it(given, transport, ranks, chosen,
                                                            grouped, words):  # fmt: skip
    with pytest.raises(ValueError, match="standby") as err:
        check_standby(given, transport, ranks, 2, 3, chosen, False, grouped)
    assert words in str(err.value)
