"""``gradfleet train --servers K``: sync-replicas' servers and asynchronous EASGD's centre on
ranks that only serve, launched as users launch them.

References: the same run with the servers inside the workers (the library's tests check that
one against a float64 simulation, and dedicated against colocated servers bit for bit where
the run is deterministic: sync-replicas in lockstep, R = N with one gradient per worker per
update (the default token rule), and EASGD
with one worker), and the uninterrupted run for ``--resume``. Failures: a killed server ends
the run with one ``error:`` line naming it, every worker's own error names it too; a lost
worker with a backup left does not end it. Bad ``--servers`` values: one ``error:`` line,
exit 2, nothing written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradfleet.cli import launch
from gradfleet.cli.launch import _let_workers_fail, _reported_error
from gradfleet.cli.main import app

from .launching import (
    GRADFLEET,
    finish,
    kill_midway,
    kill_rank,
    metrics,
    popen,
    stop,
    wait_for_step,
)

LOCKSTEP = "sync-replicas:replicas_to_aggregate=2"
EASGD = "easgd:mode=async,period=2"


def _start(tmp_path: Path, name: str, *args: str):
    out = tmp_path / name
    return out, popen([*GRADFLEET, "train", *args, "--out", str(out), "-q"], tmp_path)


def _run_all(runs: list[tuple[Path, object]], deadline: float) -> None:
    procs = [p for _, p in runs]
    try:
        results = finish(procs, deadline)
    finally:
        stop(procs)
    for (out, _), (code, console) in zip(runs, results, strict=True):
        assert code == 0, (out.name, console)


def _model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def _trained(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(out) if "loss" in r]


def _assert_same_run(a: Path, b: Path) -> None:
    """Bit-equal final models and the same (step, loss) sequence."""
    ma, mb = _model(a), _model(b)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), (a.name, b.name, k)
    assert _trained(a) == _trained(b), (a.name, b.name)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("strategy", "workers", "servers"),
    [(LOCKSTEP, 2, (1, 2)), (EASGD, 1, (1,))],
    ids=["sync-replicas", "easgd-async"],
)
def test_dedicated_servers_equal_colocated_and_resume_exactly(
    tmp_path: Path, strategy: str, workers: int, servers: tuple[int, ...]
) -> None:
    """The same job with its servers inside the workers and on dedicated ranks (sync: one
    server, then two shards): equal models and losses. The last server count runs checkpointed
    at step 10 (each server saving its own state), stopped at 13 and resumed to 24: it equals
    the uninterrupted run (fewer launches: each costs seconds of start-up per process)."""
    common = ["-s", strategy, "-n", str(workers), "--seed", "3"]
    deadline = time.monotonic() + 360
    full = {
        k: _start(tmp_path, f"full-k{k}", *common, "--steps", "24", "--servers", str(k))
        for k in (0, *servers[:-1])
    }
    k = servers[-1]
    part = _start(
        tmp_path, "part", *common, "--steps", "13", "--checkpoint-every", "10",
        "--servers", str(k),
    )  # fmt: skip
    _run_all([*full.values(), part], deadline)
    part_out = part[0]
    _run_all([(part_out, popen([*GRADFLEET, "train", "--resume", str(part_out), "--steps",
                                "24", "-q"], tmp_path))], deadline)  # fmt: skip

    reference = full[0][0]
    for k_, (out, _) in full.items():
        if k_:
            _assert_same_run(reference, out)
        s = _summary(out)
        # the servers are no workers: not in the count, nor in the throughput
        assert (s["workers"], s["servers"]) == (workers, k_)
        samples = [r["samples"] for r in metrics(out) if "loss" in r][-1]
        assert s["samples_per_s"] == pytest.approx(samples * workers / s["wall_s"], rel=1e-12)
        assert (s["bytes_sent"] > 0) == (workers > 1 or k_ > 0)  # a dedicated centre too
    _assert_same_run(reference, part_out)
    s = _summary(part_out)
    assert (s["workers"], s["servers"]) == (workers, k) and s["bytes_sent"] > 0
    assert [st for st, _ in _trained(part_out)] == list(range(1, 25))
    # one checkpoint file per rank, the servers' holding their own state (step 20 now)
    ckpt = part_out / "checkpoints" / "step-0000020"
    assert sorted(p.name for p in ckpt.iterdir()) == [f"rank-{r}.pt" for r in range(workers + k)]
    states = [
        torch.load(ckpt / f"rank-{r}.pt", weights_only=True) for r in range(workers, workers + k)
    ]
    if strategy == EASGD:
        assert states[0]["kind"] == "AsyncCentre"
        centre = states[0]["centre"]
        assert [c.shape for c in centre] == [v.shape for v in _model(reference).values()]
    else:
        assert states[0]["kind"] == "SyncReplicasOptimizer"
        assert states[0]["server"]["global_step"] == 20  # the chief: the step and tokens
        assert states[0]["shards"] == {}
        assert list(states[1]["shards"]) == [1] and states[1]["server"] is None


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("strategy", "servers", "victim"),
    [("sync-replicas", 2, 3), ("easgd:mode=async,standby=false", 1, 2)],  # no standby
    ids=["sync-shard", "easgd-centre"],
)
@pytest.mark.faults
def test_killed_server_ends_the_run_naming_it(
    tmp_path: Path, strategy: str, servers: int, victim: int
) -> None:
    out, proc = _start(
        tmp_path, "run", "-s", strategy, "-n", "2", "--servers", str(servers),
        "--steps", "100000", "--log-level", "info",
    )  # fmt: skip
    deadline = time.monotonic() + 200
    try:
        wait_for_step(out, 20, [proc], deadline)
        kill_rank(out, victim)
        killed = time.monotonic()
        ((code, console),) = finish([proc], deadline, out)
        took = time.monotonic() - killed
    finally:
        stop([proc], out)
    assert code == 1, console
    errors = [ln for ln in console.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, console
    head = f"error: dedicated server rank {victim} failed: killed by signal 9; log: "
    assert errors[0].startswith(head), errors[0]
    # what a worker saw names the server's rank and address
    assert f"ServerUnreachable: server rank {victim}" in errors[0], errors[0]
    assert "127.0.0.1:" in errors[0].split("; worker rank")[1], errors[0]
    for worker in (0, 1):  # each worker failed on its own, with the same error
        logs = " ".join(p.read_text() for p in (out / "logs" / f"rank-{worker}").rglob("*.*"))
        assert f"ServerUnreachable: server rank {victim}" in logs, worker
    # the workers fail within about a second; the bound is the grace for their own errors
    # (10 s, on a loaded machine) and the SIGTERM wait (5 s)
    assert took < 30, took
    assert not (out / "summary.json").exists()


def test_a_workers_reported_error_counts_before_its_process_ends(tmp_path: Path) -> None:
    """After a server loss the launcher names the first worker's error as soon as torch
    elastic's error file is written: the interpreter's teardown after it took more than the
    10 s grace on a loaded machine, and the run ended without the worker's words."""
    attempt = tmp_path / "rank-1" / "run_abc" / "attempt_0" / "0"
    assert _reported_error(tmp_path, 1) is None  # no logs yet
    attempt.mkdir(parents=True)
    (attempt / "stderr.log").write_text("")
    assert _reported_error(tmp_path, 1) is None  # no error file yet
    (attempt / "error.json").write_text('{"message": {"message": "Serv')  # being written
    assert _reported_error(tmp_path, 1) is None
    said = "ServerUnreachable: server rank 2 at 127.0.0.1:5 closed the connection"
    payload = {"message": {"message": f"Traceback\n{said}", "extraInfo": {}}}
    (attempt / "error.json").write_text(json.dumps(payload))
    assert _reported_error(tmp_path, 1) == said


class _Running:
    """A worker process that has not ended (what it failed with is in its error file)."""

    def wait(self, timeout: float) -> None:
        return None


def _report(log_dir: Path, rank: int, said: str) -> None:
    """Write rank ``rank``'s torch elastic error file, as a failing worker does."""
    attempt = log_dir / f"rank-{rank}" / "run_abc" / "attempt_0" / "0"
    attempt.mkdir(parents=True, exist_ok=True)
    (attempt / "stderr.log").write_text("")
    payload = {"message": {"message": f"Traceback\n{said}", "extraInfo": {}}}
    (attempt / "error.json").write_text(json.dumps(payload))


def test_every_worker_reports_its_own_error_before_the_survivors_are_ended(
    tmp_path: Path,
) -> None:
    """After a server loss the launcher ends the workers once each has failed on its own: the
    first to report does not cut the others short (each worker's log must name the server)."""
    said = "ServerUnreachable: server rank 2 at 127.0.0.1:5 closed the connection"
    _report(tmp_path, 1, said)
    later = threading.Timer(0.5, _report, (tmp_path, 0, said))
    running = {0: _Running(), 1: _Running(), 2: _Running()}  # 2 workers, rank 2 serves
    start = time.monotonic()
    later.start()
    try:
        seen = _let_workers_fail(running, 2, tmp_path)
        took = time.monotonic() - start
    finally:
        later.join()
    assert took >= 0.5  # it waited for worker 0's own error
    assert seen == f"; worker rank 1: {said}"  # the first to fail
    assert set(running) == {0, 1, 2}  # still running: the caller ends them


def test_a_worker_that_never_reports_is_ended_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch, "SERVER_LOSS_GRACE_S", 0.3)
    said = "ServerUnreachable: server rank 2 at 127.0.0.1:5 closed the connection"
    _report(tmp_path, 1, said)
    start = time.monotonic()
    seen = _let_workers_fail({0: _Running(), 1: _Running()}, 2, tmp_path)
    assert 0.3 <= time.monotonic() - start < 5
    assert seen == f"; worker rank 1: {said}"


@pytest.mark.faults
@pytest.mark.timeout(240)
def test_lost_worker_with_a_backup_goes_on_with_a_dedicated_server(tmp_path: Path) -> None:
    steps = 200
    out, proc = _start(
        tmp_path, "run", "-s", "sync-replicas:replicas_to_aggregate=2", "-n", "3",
        "--servers", "1", "--steps", str(steps),
    )  # fmt: skip
    deadline = time.monotonic() + 200
    _, ((code, console),) = kill_midway([proc], out, at_step=30, rank=2, deadline=deadline)
    assert code == 0, console
    warning = [ln for ln in console.splitlines() if ln.startswith("warning: worker rank 2 lost")]
    assert len(warning) == 1 and "2 of 3 workers" in warning[0], console
    s = _summary(out)
    ((lost),) = s["lost_workers"]
    assert lost["rank"] == 2 and lost["cause"] == "killed by signal 9"
    assert (s["workers"], s["servers"]) == (3, 1)
    assert _trained(out)[-1][0] == steps  # the survivors made every update


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--servers", "-1"], "--servers must be an integer >= 0, got -1"),
        (
            ["-s", "allreduce", "-n", "2", "--servers", "1"],
            "--servers 1: strategy allreduce has no server to run on a process of its own; "
            "--servers is for sync-replicas (K=1: one server, K>1: shards) and "
            "easgd:mode=async (K=1: its centre)",
        ),
        (["-s", "easgd", "-n", "2", "--servers", "1"], "strategy easgd:mode=sync has no server"),
        (["-s", "towers", "-n", "2", "--servers", "1"], "strategy towers has no server"),
        (["-s", "model-average", "-n", "2", "--servers", "1"], "model-average has no server"),
        (["-s", "easgd:mode=async", "-n", "2", "--servers", "2"], "has one centre"),
        (
            ["-s", "sync-replicas", "-n", "2", "--servers", "5"],
            "--servers 5: the workload's model has 4 parameter tensors, so at most 4 shards",
        ),
        (
            ["-s", "sync-replicas:total_num_replicas=2", "-n", "3", "--servers", "1"],
            "needs every worker in the job (total_num_replicas = --workers = 3)",
        ),
        (
            ["-s", "sync-replicas", "-n", "2", "--servers", "1", "--checkpoint-every", "5"],
            "--checkpoint-every with sync-replicas needs dedicated servers (--servers K) in "
            "lockstep",
        ),
        (
            # TF's shared queue: a fast worker may give two gradients to one update and run
            # a local step ahead of the others, so there is no common step to stop at
            [
                "-s",
                "sync-replicas:replicas_to_aggregate=2,num_tokens=0",
                "-n",
                "2",
                "--servers",
                "1",
                "--checkpoint-every",
                "5",
            ],
            "--checkpoint-every with sync-replicas needs dedicated servers (--servers K) in "
            "lockstep (replicas_to_aggregate = --workers, without num_tokens or tokens=shared",
        ),
        (
            ["-s", "sync-replicas:num_tokens=-2", "-n", "2", "--servers", "1"],
            "num_tokens must be an integer >= -1, got -2",
        ),
    ],
)
def test_bad_servers_value_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["train", *args, "-q"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert message in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_servers_from_a_config_file_and_back_from_config_json(tmp_path: Path) -> None:
    from gradfleet.cli.spec import RunSpec, resolve

    cfg = tmp_path / "c.py"
    cfg.write_text("strategy = {'class': 'sync-replicas'}\nworkers = 2\nservers = 2\n")
    spec = resolve({"config": str(cfg)})
    assert (spec.strategy, spec.workers, spec.servers) == ("sync-replicas", 2, 2)
    assert resolve({"config": str(cfg), "servers": 1}).servers == 1  # the flag wins
    assert RunSpec.from_json(spec.to_json()) == spec
    assert resolve({}).servers == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_runs_the_last_ranks_as_servers(tmp_path: Path) -> None:
    """Under torchrun the last K of the job's processes serve: the same numbers as the CLI's
    own launcher with the servers inside the workers; a process count that does not leave
    --workers workers is refused on every rank."""
    from .launching import TORCHRUN

    common = ["-s", LOCKSTEP, "-n", "2", "--seed", "1", "--steps", "12", "-q"]
    ref = tmp_path / "ref"
    out = tmp_path / "torchrun"
    wrong = tmp_path / "wrong"
    agent = [*TORCHRUN, "--standalone", "--nnodes=1", "--monitor-interval=0.2"]
    runs = [
        popen([*GRADFLEET, "train", *common, "--out", str(ref)], tmp_path),
        popen(
            [*agent, "--nproc-per-node=4", "-m", "gradfleet", "train", *common,
             "--servers", "2", "--out", str(out)],
            tmp_path,
        ),
        popen(
            [*agent, "--nproc-per-node=2", "-m", "gradfleet", "train", *common,
             "--servers", "1", "--out", str(wrong)],
            tmp_path,
        ),
    ]  # fmt: skip
    try:
        results = finish(runs, time.monotonic() + 270)
    finally:
        stop(runs)
    assert results[0][0] == 0 and results[1][0] == 0, results[:2]
    _assert_same_run(ref, out)
    assert (_summary(out)["workers"], _summary(out)["servers"]) == (2, 2)
    code, console = results[2]
    assert code != 0
    assert "--servers 1 with 2 processes leaves 1 worker(s), but --workers is 2" in console


def test_server_checkpoint_handshake_on_the_job_store() -> None:
    """Rank 0 asks, each server saves and says so, rank 0 releases the waiting workers; a
    server that never saves is named after the timeout instead of a hang."""
    import threading

    import torch.distributed as dist

    from gradfleet.distributed.job_control import JobControl

    job = JobControl(dist.HashStore(), world_size=2)
    assert job.server_checkpoint_requested() is None
    job.request_server_checkpoint(10)
    assert job.server_checkpoint_requested() == 10
    job.server_checkpoint_saved(10, 2)
    with pytest.raises(TimeoutError, match=r"dedicated server rank\(s\) \[3\] saved no checkpoint"):
        job.wait_server_checkpoints(10, [2, 3], timeout=0.2)
    job.server_checkpoint_saved(10, 3)
    job.wait_server_checkpoints(10, [2, 3], timeout=0.2)
    with pytest.raises(TimeoutError, match="rank 0 did not complete checkpoint 10"):
        job.wait_checkpoint_released(10, timeout=0.2)
    released: list[bool] = []

    def worker() -> None:
        job.wait_checkpoint_released(10, 5.0)
        released.append(True)

    waiter = threading.Thread(target=worker)
    waiter.start()
    job.release_checkpoint(10)
    waiter.join(timeout=5.0)
    assert released == [True]


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_recipe_worker_rejoins_a_job_with_sharded_servers(tmp_path: Path) -> None:
    """One torchrun agent per rank (docs/failures.md's recipe), ranks 3 and 4 serve two
    shards: a SIGKILLed worker is restarted by its agent and rejoins both shards."""
    from gradfleet.distributed.testing import free_port

    from .test_torchrun import AGENT, recipe_env

    workers, servers, steps, port = 3, 2, 300, free_port()
    out = tmp_path / "run"
    train = ["-m", "gradfleet", "train", "-s", "sync-replicas:replicas_to_aggregate=2"]
    train += ["-n", str(workers), "--servers", str(servers), "--steps", str(steps)]
    train += ["--out", str(out), "-q"]
    world = workers + servers
    procs = [
        popen(
            [*AGENT, "--max-restarts=1", *train], tmp_path, recipe_env(r, world, "127.0.0.1", port)
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + 270
    # the servers just wait while workers 0 and 1 are frozen
    _, results = kill_midway(procs, out, at_step=30, rank=2, deadline=deadline, rejoin=[0, 1])
    for rank, (code, console) in enumerate(results):
        assert code == 0, (rank, console)
    assert "worker rank 2 rejoined the running job" in results[2][1]
    (event,) = [r for r in metrics(out) if r.get("event") == "worker_rejoined"]
    assert event["rank"] == 2
    assert _trained(out)[-1][0] == steps
    assert (_summary(out)["workers"], _summary(out)["servers"]) == (workers, servers)


def _recipe_with_a_server(tmp_path: Path, strategy: str, steps: int, *more: str):
    """The torchrun recipe for 3 workers (an agent each, one restart) and one dedicated server
    rank, 3 (an agent with no restart: a server cannot rejoin).  Returns the run's folder and
    the agents."""
    from gradfleet.distributed.testing import free_port

    from .test_torchrun import AGENT, recipe_env

    workers, port, out = 3, free_port(), tmp_path / "run"
    train = ["-m", "gradfleet", "train", "-s", strategy, "-n", str(workers), "--servers", "1"]
    train += ["--steps", str(steps), "--out", str(out), "-q", *more]
    procs = [
        popen(
            [*AGENT, f"--max-restarts={0 if r == workers else 1}", *train],
            tmp_path,
            recipe_env(r, workers + 1, "127.0.0.1", port),
        )  # fmt: skip
        for r in range(workers + 1)
    ]
    return out, procs


def _rank_2_restarted_to_the_end(out: Path, procs: list, deadline: float) -> list:
    """SIGKILL worker rank 2 and let its agent restart it (the other workers held until the
    new process waits), then wait for every agent: each worker's exits 0, the server rank's
    (killed for good before) does not, and rank 2 rejoined.  Returns each agent's (code,
    console)."""
    from .launching import hold_until_replaced

    again = kill_rank(out, 2)
    hold_until_replaced(out, [0, 1], procs[2], again, deadline)
    results = finish(procs, deadline, out)
    for rank in range(3):
        assert results[rank][0] == 0, f"rank {rank}:\n{results[rank][1]}"  # all of it
    assert results[3][0] != 0  # the server's rank
    assert "worker rank 2 rejoined the running job" in results[2][1]
    return results


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_recipe_a_restarted_worker_becomes_the_chiefs_standby_and_a_second_loss_is_survived(
    tmp_path: Path,
) -> None:
    """The recipe, the chief on a dedicated rank (3) with its standby on worker rank 1
    (``standby=1``).  Rank 1 is SIGKILLed: the chief serves alone.  Its agent restarts it; it
    rejoins and, as the job keeps a standby of its chief, becomes the chief's standby again
    from the chief's live state.  Then the chief's rank is SIGKILLed too (its agent has no
    restart): the workers move to the standby on rank 1.  Last, rank 2 is SIGKILLed and
    restarted: it rejoins the chief where it is now (rank 0 published its address once it
    moved), and every step is trained."""
    from .launching import hold_until_replaced, wait_for_rejoin

    steps = 900
    out, procs = _recipe_with_a_server(
        tmp_path, "sync-replicas:replicas_to_aggregate=2,standby=1", steps, "--log-level", "info"
    )
    deadline = time.monotonic() + 270
    try:
        wait_for_step(out, 30, procs, deadline)
        first = kill_rank(out, 1)
        hold_until_replaced(out, [0, 2], procs[1], first, deadline)
        # with R = 2 of 3 the others go on while the replacement becomes the standby (slow on
        # a loaded machine): the chief is lost only once it has one again
        wait_for_rejoin(out, 1, procs, deadline)
        wait_for_step(out, 200, procs, deadline)
        kill_rank(out, 3)
        wait_for_step(out, 400, procs[:3], deadline)  # on rank 1's copy
        results = _rank_2_restarted_to_the_end(out, procs, deadline)
    finally:
        stop(procs, out)
    restarted = results[1][1]
    assert "worker rank 1 rejoined the running job" in restarted
    assert "worker rank 1: the chief's standby, from its live state" in restarted
    for rank in (0, 2):  # the second loss: every worker moved to the new standby
        assert "moving to its standby on rank 1" in results[rank][1], results[rank][1]
    assert _trained(out)[-1][0] == steps


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_recipe_a_worker_restarted_after_the_centre_moved_joins_it_there(tmp_path: Path) -> None:
    """The recipe, the asynchronous EASGD centre on a dedicated rank (3) with its default
    standby on worker rank 0.  The centre's rank is SIGKILLed for good: the workers move to
    the standby.  Then rank 2 is SIGKILLed and restarted: it joins the centre where it is now
    (rank 0 published the standby's address once it moved), and every step is trained."""
    steps = 600
    out, procs = _recipe_with_a_server(tmp_path, "easgd:mode=async,period=4", steps)
    deadline = time.monotonic() + 270
    try:
        wait_for_step(out, 30, procs, deadline)
        kill_rank(out, 3)
        wait_for_step(out, 150, procs[:3], deadline)  # on rank 0's copy
        _rank_2_restarted_to_the_end(out, procs, deadline)
    finally:
        stop(procs, out)
    assert _trained(out)[-1][0] == steps


def test_compare_refuses_servers_for_a_strategy_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["compare", "-s", "easgd:mode=async", "-s", "allreduce",
                                   "--servers", "1", "-q"])  # fmt: skip
    assert res.exit_code == 2, res.output
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: --servers 1: strategy allreduce has no server"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_compare_runs_each_strategy_with_dedicated_servers(tmp_path: Path) -> None:
    """`compare --servers K` gives every run K dedicated servers: the lockstep run equals the
    same `train` with its server inside rank 0."""
    common = ["-n", "2", "--steps", "12", "--seed", "4", "-q"]
    ref = _start(tmp_path, "ref", "-s", LOCKSTEP, *common)
    cmp_out = tmp_path / "cmp"
    compare = popen(
        [*GRADFLEET, "compare", "-s", LOCKSTEP, "--servers", "1",
         "--straggler", "1:1", "--out", str(cmp_out), *common],
        tmp_path,
    )  # fmt: skip
    _run_all([ref, (cmp_out, compare)], time.monotonic() + 180)
    rows = json.loads((cmp_out / "compare.json").read_text())
    assert [(r["strategy"], r["workers"], r["servers"]) for r in rows] == [("sync-replicas", 2, 1)]
    (run0,) = cmp_out.glob("run0-*")
    assert (_summary(run0)["final_loss"], _trained(run0)) == (
        _summary(ref[0])["final_loss"],
        _trained(ref[0]),
    )
