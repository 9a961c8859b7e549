"""gradfleet.distributed.job_control: the per-worker agent recipe's environment, the server host
(never the wildcard address) and the job's control keys (a barrier that neither a rank the
launcher reported lost nor a rank whose heartbeat stopped can block)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from gradfleet.distributed import job_control as elastic
from gradfleet.distributed.job_control import JobControl

RECIPE = {
    "GRADFLEET_RANK": "2",
    "GRADFLEET_WORLD_SIZE": "3",
    "GRADFLEET_MASTER_ADDR": "127.0.0.1",
    "GRADFLEET_MASTER_PORT": "29511",
}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # set, then deleted: the monkeypatch records each one's state before the test and restores
    # it after, also for what apply_job_env() exports (a leak would make every later launch
    # in this process a rank of this test's job)
    for key in (*RECIPE, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GRADFLEET_STORE",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):  # fmt: skip
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    # set here so that the monkeypatch restores what apply_job_env() exports
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "unset")
    monkeypatch.setenv("LOCAL_RANK", "unset")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("GRADFLEET_SERVER_HOST", raising=False)
    return monkeypatch


def test_recipe_env_overrides_the_agents_one_process_job(env) -> None:
    assert elastic.apply_job_env() is None  # not under the recipe: nothing changes
    for k, v in {**RECIPE, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "40000"}.items():
        env.setenv(k, v)  # torchrun's own single-worker job
    env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    place = elastic.apply_job_env()
    assert place == elastic.JobPlace(rank=2, world_size=3, rejoining=False, restarts_left=0)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == (
        "2",
        "3",
        "29511",
    )
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 hosts the store
    assert os.environ["LOCAL_RANK"] == "0"  # the agent's one process
    env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    env.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    env.setenv("LOCAL_RANK", "2")  # gradfleet's launcher restarting rank 2 keeps its GPU
    assert elastic.apply_job_env() == elastic.JobPlace(2, 3, rejoining=True, restarts_left=2)
    assert os.environ["LOCAL_RANK"] == "2"
    assert elastic.restarts_left() == 2


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("GRADFLEET_RANK", "3", "GRADFLEET_RANK=3 must be < GRADFLEET_WORLD_SIZE=3"),
        ("GRADFLEET_RANK", "x", "GRADFLEET_RANK must be an integer >= 0, got 'x'"),
        ("GRADFLEET_WORLD_SIZE", "0", "GRADFLEET_WORLD_SIZE must be an integer >= 1, got 0"),
        ("GRADFLEET_MASTER_ADDR", None, "GRADFLEET_MASTER_ADDR is not"),
        ("GRADFLEET_STORE", "rank1", "GRADFLEET_STORE must be one of rank0, own .*'rank1'"),
    ],
)
def test_recipe_env_errors_name_the_variable(env, key, value, message) -> None:
    for k, v in RECIPE.items():
        env.setenv(k, v)
    if value is None:
        env.delenv(key)
    else:
        env.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        elastic.apply_job_env()
    assert "RANK" not in os.environ  # nothing was exported


def test_store_of_its_own_makes_every_rank_a_client(env) -> None:
    """GRADFLEET_STORE=own: torch's env:// rendezvous joins the store at the master address as
    a client on every rank, rank 0 too (nothing is hosted in a worker): a real rank 0 reads a
    key set by the store's own process."""
    for k, v in {**RECIPE, "GRADFLEET_RANK": "0", "GRADFLEET_WORLD_SIZE": "1"}.items():
        env.setenv(k, v)
    served = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env.setenv("GRADFLEET_MASTER_PORT", str(served.port))
    env.setenv("GRADFLEET_STORE", "own")
    assert elastic.apply_job_env() == elastic.JobPlace(0, 1, rejoining=False)
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=10)))
    served.set("from-the-store-process", "here")
    assert (rank, world) == (0, 1)
    assert store.get("from-the-store-process") == b"here"  # a client of the served store
    env.setenv("GRADFLEET_STORE", "rank0")
    elastic.apply_job_env()
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 hosts it


def test_server_address_and_ranks_published_together() -> None:
    control = JobControl(dist.HashStore(), 3)
    assert (control.server_address(), control.server_ranks()) == (None, None)
    control.publish_server("10.0.0.2:4100")
    assert (control.server_address(), control.server_ranks()) == ("10.0.0.2:4100", None)
    control.publish_server("10.0.0.3:4200", [1])  # the chief's standby on rank 1 took over
    assert (control.server_address(), control.server_ranks()) == ("10.0.0.3:4200", [1])


def test_server_host_explicit_loopback_never_wildcard(env) -> None:
    assert elastic.server_host() == "127.0.0.1"  # no master: a local job
    env.setenv("MASTER_ADDR", "localhost")
    assert elastic.server_host() == "127.0.0.1"
    env.setenv("GRADFLEET_SERVER_HOST", "10.231.0.7")
    assert elastic.server_host() == "10.231.0.7"
    for wildcard in ("0.0.0.0", "::"):
        env.setenv("GRADFLEET_SERVER_HOST", wildcard)
        with pytest.raises(ValueError, match="not the wildcard"):
            elastic.server_host()


def test_lost_rank_does_not_block_the_barrier() -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    job = JobControl(store, 3)  # no heartbeats: a silent rank is late only after 10 s
    job.finished(0)
    job.finished(2)
    t0 = time.monotonic()
    assert job.wait_finished(timeout=0.3) == {1: "not finished in 0.3s"}  # rank 1: late
    assert time.monotonic() - t0 >= 0.3
    job.mark_lost(1, step=17, cause="killed by signal 9")
    t0 = time.monotonic()
    assert job.wait_finished(timeout=30) == {}  # returns at once
    assert time.monotonic() - t0 < 5
    assert job.lost_workers() == {1: {"rank": 1, "step": 17, "cause": "killed by signal 9"}}
    job.mark_rejoined(1, 40, 1234)
    assert job.rejoined(1) == (40, 1234)
    assert job.lost_workers() == {}  # it came back
    assert job.rejoins() == [
        {"rank": 1, "step": 17, "cause": "killed by signal 9", "rejoined_at_step": 40}
    ]
    job.mark_lost(1, step=50, cause="killed by signal 9")  # lost again, after its restart
    assert job.rejoined(1) is None
    assert job.lost_workers() == {1: {"rank": 1, "step": 50, "cause": "killed by signal 9"}}


def _job(store: dist.TCPStore) -> JobControl:
    return JobControl(store, 2, heartbeat_s=0.05, silent_after=0.5)


def test_a_beating_rank_is_waited_for_a_silent_one_is_not() -> None:
    """Rank 1 dies without a launcher that reports it: rank 0 stops waiting once its heartbeat
    has not moved for ``silent_after``, not after the whole timeout; a live but slow rank is
    waited for until the timeout."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank0 = _job(server)
    rank1 = _job(dist.TCPStore("127.0.0.1", server.port, is_master=False))
    rank1.start_heartbeat(1, restarts_left=1)  # its agent will restart it once
    try:
        rank0.finished(0)
        t0 = time.monotonic()
        assert rank0.wait_finished(timeout=1.5) == {1: "not finished in 1.5s"}  # alive: late
        assert time.monotonic() - t0 >= 1.5
    finally:
        rank1.close()  # its process dies: no more beats
    t0 = time.monotonic()  # silent, but a restart is coming: waited for until the timeout
    assert rank0.wait_finished(timeout=1.5) == {1: "not finished in 1.5s"}
    assert time.monotonic() - t0 >= 1.5
    rank1.start_heartbeat(1, restarts_left=0)  # restarted: no restart left
    rank1.close()  # and dead again
    t0 = time.monotonic()
    assert rank0.wait_finished(timeout=60) == {1: "silent for 0.5s (no heartbeat)"}
    assert 0.5 <= time.monotonic() - t0 < 10
    rank1.finished(1)
    assert rank0.wait_finished(timeout=60) == {}


def test_the_end_does_not_wait_for_a_restarted_process_still_joining() -> None:
    """Rank 1 was restarted and asks in while the others stopped stepping (they take no one
    in any more): rank 0's end, and a checkpoint's barrier, do not wait for it, as they would
    for a live rank until the timeout; once rank 1 has rejoined it is waited for again.
    ``ended`` tells a process restarted after the last update that there is nothing to
    rejoin."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank0 = _job(server)
    rank1 = _job(dist.TCPStore("127.0.0.1", server.port, is_master=False))
    rank1.start_heartbeat(1, restarts_left=0)  # alive and beating
    try:
        assert not rank1.ended()
        rank1.mark_joining(1, 4321)
        rank0.mark_ended()
        rank0.finished(0)
        t0 = time.monotonic()
        assert rank0.wait_finished(timeout=30) == {1: "restarted, and still joining at finished"}
        assert time.monotonic() - t0 < 5  # not the 30 s a beating rank gets
        rank0.checkpoint_saved(40, 0)  # a checkpoint: the same (the writer writes its file)
        assert rank0.wait_checkpoint(40, timeout=30) == {
            1: "restarted, and still joining at checkpoint-40"
        }
        assert rank0.joining(range(2)) == [1]
        assert rank1.ended()
        rank1.mark_rejoined(1, 12, 4321)  # back in: a member again, waited for
        assert rank0.joining(range(2)) == []
        t0 = time.monotonic()
        assert rank0.wait_finished(timeout=1.0) == {1: "not finished in 1s"}
        assert time.monotonic() - t0 >= 1.0
    finally:
        rank1.close()


def test_heartbeat_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="silent_after must be >= 3 \\* heartbeat_s"):
        JobControl(dist.HashStore(), 2, heartbeat_s=1.0, silent_after=2.0)


def test_job_control_owns_the_store_keys() -> None:
    """No module of the CLI reads or writes the job store itself, nor spells the keys' prefix:
    every control key goes through JobControl."""
    import re
    from pathlib import Path

    import gradfleet.cli

    for path in Path(gradfleet.cli.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"store\.(set|get|add|check|wait|compare_set)\(", text), path.name
        assert JobControl.PREFIX not in text, path.name
