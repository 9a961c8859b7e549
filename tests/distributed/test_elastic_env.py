"""gradfleet.distributed.elastic: the per-worker agent recipe's environment, the server host
(never the wildcard address) and the job store's control keys (a barrier a lost rank cannot
block)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from gradfleet.distributed import elastic

RECIPE = {
    "GRADFLEET_RANK": "2",
    "GRADFLEET_WORLD_SIZE": "3",
    "GRADFLEET_MASTER_ADDR": "127.0.0.1",
    "GRADFLEET_MASTER_PORT": "29511",
}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in (*RECIPE, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    # set here so that the monkeypatch restores what apply_job_env() exports
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "unset")
    monkeypatch.setenv("LOCAL_RANK", "unset")
    monkeypatch.delenv("GRADFLEET_SERVER_HOST", raising=False)
    return monkeypatch


def test_recipe_env_overrides_the_agents_one_process_job(env) -> None:
    assert elastic.apply_job_env() is None  # not under the recipe: nothing changes
    for k, v in {**RECIPE, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "40000"}.items():
        env.setenv(k, v)  # torchrun's own single-worker job
    env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    place = elastic.apply_job_env()
    assert place == elastic.JobPlace(rank=2, world_size=3, rejoining=False)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == (
        "2",
        "3",
        "29511",
    )
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 hosts the store
    env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert elastic.apply_job_env().rejoining


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("GRADFLEET_RANK", "3", "GRADFLEET_RANK=3 must be < GRADFLEET_WORLD_SIZE=3"),
        ("GRADFLEET_RANK", "x", "GRADFLEET_RANK must be an integer >= 0, got 'x'"),
        ("GRADFLEET_WORLD_SIZE", "0", "GRADFLEET_WORLD_SIZE must be an integer >= 1, got 0"),
        ("GRADFLEET_MASTER_ADDR", None, "GRADFLEET_MASTER_ADDR is not"),
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
    elastic.arrive(store, "finished", 0)
    elastic.arrive(store, "finished", 2)
    t0 = time.monotonic()
    assert elastic.wait_arrived(store, "finished", 3, timeout=0.3) == [1]  # rank 1: silent
    assert time.monotonic() - t0 >= 0.3
    elastic.mark_lost(store, 1, step=17, cause="killed by signal 9")
    assert elastic.wait_arrived(store, "finished", 3, timeout=30) == []  # returns at once
    assert elastic.lost_workers(store, 3) == {
        1: {"rank": 1, "step": 17, "cause": "killed by signal 9"}
    }
    elastic.publish(store, "rejoined/1", [40, 1234])
    assert elastic.lost_workers(store, 3) == {}  # it came back
