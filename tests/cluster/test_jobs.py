"""Training across emulated hosts, launched as users launch: one torchrun per host, c10d
rendezvous on host 0 (``cluster_job.py``: SyncReplicas with one backup worker, R = N - 1, its
variables sharded over the ranks on hosts 0 and 1).  A job trains; a worker SIGKILLed mid-run
leaves the others finishing; a lost shard host gives every other worker one error naming it;
a job that ends well ends at once on every host."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from benchmarks.cluster.netcluster import Cluster, stop

from .netns import ROOT

pytestmark = [pytest.mark.timeout(240), pytest.mark.multihost]
JOB = ROOT / "tests" / "cluster" / "cluster_job.py"
STEPS = 40
DEADLINE = 150  # start-up alone (4 torchruns, 4 workers) is ~40 s on 2 loaded cores


def _run(
    cluster: Cluster, out: Path, hosts: list[int], *extra: str, exits: tuple[int, ...] = ()
) -> tuple[list[int | None], dict]:
    """Start the job; wait until the workers on ``hosts`` wrote their records (a failed
    node's peers sit in torch's 300 s exit barrier, so the agents are not waited for), then
    end every process; the agents of ``exits`` are given until the deadline to exit.  Returns
    the agents' exit codes (None: still running) and the records."""
    port = 29100 + int(time.time()) % 300
    records = out / "records"
    procs = cluster.torchrun(
        [str(JOB), "--steps", str(STEPS), "--out", str(records), *extra],
        cwd=ROOT, port=port, logs=out,
    )  # fmt: skip
    deadline = time.monotonic() + DEADLINE
    try:
        while time.monotonic() < deadline:
            if all((records / f"host-{h}.json").exists() for h in hosts):
                break
            time.sleep(0.2)
        # an agent exits once its workers closed (a server waits for every worker to leave)
        while time.monotonic() < deadline and any(procs[h].poll() is None for h in exits):
            time.sleep(0.2)
        time.sleep(1)  # the other agents see their workers' exit
        codes = [p.poll() for p in procs]
    finally:
        stop(procs)
    logs = "\n".join(f"--- host {h}\n{p.read_text()[-3000:]}" for h, p in
                     enumerate(sorted(out.glob("host*.log"))))  # fmt: skip
    found = {int(p.stem.split("-")[1]): json.loads(p.read_text())
             for p in records.glob("host-*.json")}  # fmt: skip
    assert sorted(found) == hosts, f"records of {sorted(found)} in {DEADLINE} s\n{logs}"
    return codes, found | {"logs": logs}


def test_sync_replicas_with_a_backup_trains_across_hosts(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(3, "200mbit")
    codes, found = _run(cluster, tmp_path, [0, 1, 2], exits=(0, 1, 2))
    logs = found.pop("logs")
    assert codes == [0, 0, 0], logs
    for record in found.values():
        assert sorted(record["hosts"]) == [0, 1, 2]  # one worker on each host
        assert record["errors"] == [] and record["global_step"] == STEPS
    losses = found[0]["losses"]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses  # it learns the teacher's labels


def test_a_sigkilled_worker_and_the_job_goes_on(make_cluster, tmp_path: Path) -> None:
    """R = 3 of N = 4: the worker on host 3 (not a shard host) dies after 8 steps."""
    cluster = make_cluster(4, "200mbit")
    codes, found = _run(
        cluster, tmp_path, [0, 1, 2], "--kill-host", "3", "--kill-at", "8", exits=(3,)
    )
    logs = found.pop("logs")
    assert codes[3] not in (None, 0), (codes, logs)  # host 3's agent reports its dead worker
    for record in found.values():
        assert record["errors"] == [] and record["global_step"] == STEPS


def test_a_lost_shard_host_gives_every_worker_one_error_naming_it(
    make_cluster, tmp_path: Path
) -> None:
    """The worker on host 1 also hosts shard 1; it dies after 8 steps.  Every other worker
    gets one error naming that rank instead of hanging or training on half the variables."""
    cluster = make_cluster(3, "200mbit")
    codes, found = _run(cluster, tmp_path, [0, 2], "--kill-host", "1", "--kill-at", "8")
    found.pop("logs")
    lost = found[0]["hosts"].index(1)
    for record in found.values():
        assert len(record["errors"]) == 1, record["errors"]
        (error,) = record["errors"]
        assert error["type"] == "ServerUnreachable", error
        assert f"rank {lost}" in error["message"], error
        assert record["global_step"] < STEPS


CLEAN_END = 20  # seconds: the end takes 1-4 s here; torch's exit barrier would wait 300
TIMEOUT = 60  # the job's SyncReplicas timeout: what a stuck teardown would wait for
CLOSE = 10  # seconds a close() may take: under 0.1 s here (0.9 s at 4M parameters)


def test_every_host_exits_0_within_seconds_of_the_last_update(make_cluster, tmp_path: Path) -> None:
    """Three runs of a 4-host job ending as a user's script ends (``close()``, then the
    interpreter's own exit; R = N, shards over every worker, the model given; the third run's
    program never calls ``close()``, which is then done at the interpreter's exit): every host's
    torchrun agent exits 0 within seconds of the last worker's last update, and no worker's
    ``close()`` waits out its timeout.  An agent whose worker outlived the others (stuck in
    teardown) would hold every other agent in torch's 300 s exit barrier, then exit 1 once
    host 0's store is gone.  An agent whose worker aborted at exit exits 1 at once and leaves
    the others in that barrier: a program without ``close()`` did so on most hosts before it
    was closed at exit (threads woken inside torch calls during finalization: SIGABRT).  The
    timeout is a user's (60 s, not the other tests' 10 s), so a teardown that waits for it
    cannot hide inside the window: a server rank's ``close()`` returns once every worker said
    ``done``, within a step's time of its own last update."""
    cluster = make_cluster(4, "200mbit")
    for run in range(3):
        out = tmp_path / f"run-{run}"
        out.mkdir()
        records = out / "records"
        port = 29100 + (int(time.time()) + 17 * run) % 300
        procs = cluster.torchrun(
            [str(JOB), "--steps", "12", "--all", "--plain-end", "--timeout", str(TIMEOUT),
             "--out", str(records), *(["--no-close"] if run == 2 else [])],
            cwd=ROOT, port=port, logs=out, rdzv_id=f"gfc-end-{run}",
        )  # fmt: skip
        try:
            deadline = time.monotonic() + DEADLINE
            while time.monotonic() < deadline and not all(
                (records / f"host-{h}.json").exists() for h in range(4)
            ):
                time.sleep(0.1)
            last = time.monotonic()
            while time.monotonic() < last + CLEAN_END and any(p.poll() is None for p in procs):
                time.sleep(0.1)
            codes = [p.poll() for p in procs]
        finally:
            stop(procs)
        logs = "\n".join(f"--- host {h}\n{p.read_text()[-2000:]}" for h, p in
                         enumerate(sorted(out.glob("host*.log"))))  # fmt: skip
        found = [json.loads((records / f"host-{h}.json").read_text()) for h in range(4)
                 if (records / f"host-{h}.json").exists()]  # fmt: skip
        assert len(found) == 4, f"run {run}: records of {len(found)} hosts\n{logs}"
        assert all(r["errors"] == [] and r["global_step"] == 12 for r in found), found
        closing = [r.get("close_s", 0.0) for r in found]
        assert max(closing) < CLOSE, f"run {run}: close() took {closing} s\n{logs}"
        assert codes == [0, 0, 0, 0], f"run {run}: agents' exit codes {codes}\n{logs}"
