"""The torchrun recipe of docs/failures.md: one agent per worker (``--standalone --nnodes=1
--nproc-per-node=1``), gradfleet's rank and world in ``GRADFLEET_*``. A SIGKILLed worker is
restarted by its own agent and rejoins the running job (``local_step := global_step``) while the
others never stop."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from gradfleet.distributed.testing import free_port

from .launching import (
    GRADFLEET,
    TORCHRUN,
    finish,
    kill_midway,
    kill_rank,
    metrics,
    popen,
    running,
    stop,
    wait_for_step,
)

pytestmark = pytest.mark.timeout(300)


def recipe_env(
    rank: int, world: int, master: str, port: int, store: str = "rank0"
) -> dict[str, str]:
    return {
        "GRADFLEET_STORE": store,
        "GRADFLEET_RANK": str(rank),
        "GRADFLEET_WORLD_SIZE": str(world),
        "GRADFLEET_MASTER_ADDR": master,
        "GRADFLEET_MASTER_PORT": str(port),
    }


AGENT = [*TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=0.2"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        "sync-replicas:replicas_to_aggregate=2",
        "easgd:mode=async,period=4",
        # the all-reduce with a loss allowed: rank 2 heals from a live member's state
        "sync-replicas:replicas_to_aggregate=3,max_losses=1",
    ],
)
@pytest.mark.faults
def test_recipe_worker_killed_restarted_rejoins(tmp_path: Path, strategy: str) -> None:
    world, steps, port, out = 3, 500, free_port(), tmp_path / "run"
    train = ["-m", "gradfleet", "train", "-s", strategy, "-n", str(world)]
    train += ["--steps", str(steps), "--out", str(out), "-q"]
    procs = [
        popen(
            [*AGENT, "--max-restarts=1", *train], tmp_path, recipe_env(r, world, "127.0.0.1", port)
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + 270
    first, results = kill_midway(procs, out, at_step=40, rank=2, deadline=deadline, rejoin=[0, 1])
    for rank, (code, console) in enumerate(results):
        assert code == 0, (rank, console)
    said = re.findall(r"worker rank 2 rejoined the running job at step (\d+)", results[2][1])
    assert len(said) == 1, results[2][1]
    assert int((out / "pids" / "rank-2.pid").read_text()) != first  # a new process
    (event,) = [r for r in metrics(out) if r.get("event") == "worker_rejoined"]
    assert event["rank"] == 2 and event["at_step"] == int(said[0]) >= 40
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_workers"] == []  # it came back
    assert [r["step"] for r in metrics(out) if "loss" in r][-1] == steps
    assert summary["test_accuracy"] >= summary["target_accuracy"]


@pytest.mark.faults
def test_recipe_a_process_restarted_after_the_job_ended_exits_0(tmp_path: Path) -> None:
    """``GRADFLEET_STORE=own``: the store outlives the job.  The job trains to its end; then
    rank 2 starts as its agent's restart would (``TORCHELASTIC_RESTART_COUNT=1``).  It finds
    the job ended and exits 0 at once, saying so: an agent whose worker was restarted near the
    end must not report a finished job as failed (before, it waited for the job until the
    timeout, then failed)."""
    world, steps, port, out = 3, 60, free_port(), tmp_path / "run"
    train = ["-m", "gradfleet", "train", "-s", "sync-replicas:replicas_to_aggregate=2", "-n",
             str(world), "--steps", str(steps), "--out", str(out), "-q"]  # fmt: skip
    store = popen([*GRADFLEET, "store", "--port", str(port)], tmp_path)
    try:
        procs = [
            popen(
                [*AGENT, "--max-restarts=0", *train],
                tmp_path,
                recipe_env(r, world, "127.0.0.1", port, store="own"),
            )  # fmt: skip
            for r in range(world)
        ]
        results = finish(procs, time.monotonic() + 200, out)
        assert [code for code, _ in results] == [0, 0, 0], results
        late = popen(
            [sys.executable, *train], tmp_path,
            {**recipe_env(2, world, "127.0.0.1", port, store="own"),
             # what its agent gives the one process it restarts
             "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port()),
             "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1"},
        )  # fmt: skip
        ((code, console),) = finish([late], time.monotonic() + 60, out)
    finally:
        stop([store], out)
    assert code == 0, console
    assert "worker rank 2: the job ended before it could rejoin (it made its last update)" in (
        console
    ), console
    assert json.loads((out / "summary.json").read_text())["steps"] == steps  # its files kept


@pytest.mark.faults
@pytest.mark.parametrize(
    "strategy",
    ["sync-replicas:replicas_to_aggregate=2,transport=server", "easgd:mode=async,standby=true"],
)
def test_recipe_store_of_its_own_rank0_lost_rejoins_as_standby_then_second_loss(
    tmp_path: Path, strategy: str
) -> None:
    """``GRADFLEET_STORE=own``: the job's store runs in ``gradfleet store``, so rank 0, which
    holds the server (the SyncReplicas chief with one backup, or the asynchronous EASGD
    centre; its standby on rank 1), may be lost. Killed, its standby takes over and rank 1
    writes the run's files; restarted by its agent, rank 0 rejoins as the new server's
    standby, from its live state; then rank 1, the server's host now, is killed for good too,
    and rank 0's copy takes over: the run still makes every update."""
    sync = strategy.startswith("sync-replicas")
    # enough steps that ranks 1 and 2 are still training when the restarted rank 0 is back
    world, steps, port, out = 3, 8000, free_port(), tmp_path / "run"
    train = ["-m", "gradfleet", "train", "-s", strategy, "-n", str(world), "--steps",
             str(steps), "--out", str(out), "-q"]  # fmt: skip
    if not sync:  # EASGD's ranks wait for no one: rank 1 is slowed to be alive when killed
        train += ["--straggler", "1:5"]
    store = popen([*GRADFLEET, "store", "--port", str(port)], tmp_path)
    restarts = {0: 1, 1: 0, 2: 0}
    procs = [
        popen(
            [*AGENT, f"--max-restarts={restarts[r]}", *train],
            tmp_path,
            recipe_env(r, world, "127.0.0.1", port, store="own"),
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + 270
    try:
        wait_for_step(out, 40, procs, deadline)
        first = kill_rank(out, 0)
        while not [r for r in metrics(out) if r.get("event") == "worker_rejoined"]:
            assert time.monotonic() < deadline, "rank 0 never rejoined"
            assert procs[1].poll() is None, "the job ended before rank 0 was back"
            time.sleep(0.1)
        (joined,) = [r for r in metrics(out) if r.get("event") == "worker_rejoined"]
        wait_for_step(out, joined["at_step"] + 100, procs, deadline)  # its copy is current
        assert procs[1].poll() is None, "rank 1 ended before its loss"
        kill_rank(out, 1)
        results = finish(procs, deadline, out)
    finally:
        stop([*procs, store], out)
    assert [code for code, _ in results] == [0, results[1][0], 0], results
    assert results[1][0] != 0  # rank 1's agent had no restart left
    assert joined["rank"] == 0 and joined["at_step"] >= 40
    summary = json.loads((out / "summary.json").read_text())
    # rank 1, the chief's host then, named once its standby took over (rank 0 came back)
    (lost,) = summary["lost_workers"]
    assert lost["rank"] == 1 and lost["cause"] == "its standby took over", lost
    named = [r for r in metrics(out) if r.get("event") == "worker_lost"]
    assert [r["rank"] for r in named] == [0, 1], named  # each loss named once, as it came
    made = [r["step"] for r in metrics(out) if "loss" in r]
    # none logged twice, in order, to the last; the rank that takes over logs the updates it
    # saw (a worker whose gradient an update did not take sees the next one's step), and
    # EASGD logs the writer's own local steps, so a change of writer may skip some
    assert made == sorted(set(made)) and made[-1] == steps
    if sync:  # the chief's counts came through both takeovers: each update took R = 2
        accepted = [c["accepted"] for c in summary["gradients_per_worker"].values()]
        assert sum(accepted) == sum(summary["replicas"]) == 2 * steps, summary
    assert summary["test_accuracy"] >= summary["target_accuracy"]
    assert int((out / "pids" / "rank-0.pid").read_text()) != first  # a new process


@pytest.mark.faults
def test_recipe_worker_killed_not_restarted_rank0_stops_waiting(tmp_path: Path) -> None:
    """Rank 2's agent has no restart left: nothing tells rank 0 that rank 2 is gone, but its
    heartbeat stops, so rank 0 ends the run without waiting the job timeout (600 s here, longer
    than the test's deadline) and names rank 2 in the summary."""
    world, steps, port, out = 3, 300, free_port(), tmp_path / "run"
    train = ["-m", "gradfleet", "train", "-s", "sync-replicas:replicas_to_aggregate=2"]
    train += ["-n", str(world), "--steps", str(steps), "--timeout", "600", "--out", str(out)]
    train += ["-q"]
    procs = [
        popen(
            [*AGENT, "--max-restarts=0", *train], tmp_path, recipe_env(r, world, "127.0.0.1", port)
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + 270
    # before the heartbeat, rank 0 waited 600 s here: a hang
    _, results = kill_midway(procs, out, at_step=40, rank=2, deadline=deadline)
    for rank, (code, console) in enumerate(results[:2]):
        assert code == 0, (rank, console)
    assert results[2][0] != 0 and "exitcode  : -9" in results[2][1], results[2][1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_workers"] == [
        {"rank": 2, "step": None, "cause": "silent for 10s (no heartbeat)"}
    ]
    assert [r["step"] for r in metrics(out) if "loss" in r][-1] == steps
    assert summary["test_accuracy"] >= summary["target_accuracy"]


@pytest.mark.faults
def test_one_agent_for_all_workers_ends_the_job_when_one_is_killed(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node N``: one agent for the N workers ends every survivor when one
    is killed (``--max-restarts 0``), even where a backup could have covered it; no summary."""
    world, out = 3, tmp_path / "run"
    agent = [*TORCHRUN, "--standalone", "--nnodes=1", f"--nproc-per-node={world}"]
    agent += ["--monitor-interval=0.2", "--max-restarts=0"]
    train = ["-m", "gradfleet", "train", "-s", "sync-replicas:replicas_to_aggregate=2"]
    train += ["-n", str(world), "--steps", "100000", "--out", str(out), "-q"]
    procs = [popen([*agent, *train], tmp_path)]
    deadline = time.monotonic() + 270
    try:
        wait_for_step(out, 40, procs, deadline)
        pids = {r: int((out / "pids" / f"rank-{r}.pid").read_text()) for r in range(world)}
        kill_rank(out, 2)
        killed_at = time.monotonic()
        ((code, console),) = finish(procs, min(deadline, killed_at + 60), out)
        ended_after = time.monotonic() - killed_at
    finally:
        stop(procs, out)
    assert code != 0, console
    assert ended_after < 30, (ended_after, console)  # the agent's stop: SIGTERM, 30 s grace
    assert not [r for r, pid in pids.items() if running(pid)], console
    assert not (out / "summary.json").exists()
    assert "exitcode  : -9" in console and "rank      : 2" in console, console
