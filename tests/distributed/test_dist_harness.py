"""The spawn harness itself: results, failure reports, deadline, killing a rank."""

from __future__ import annotations

import re
import time

import pytest

from gradfleet.distributed.testing import MultiProcessError, RankKilled, run_ranks

from . import ranks

pytestmark = pytest.mark.timeout(60)


def test_results_come_back_per_rank():
    assert run_ranks(ranks.all_reduce_rank, 3) == [6.0, 6.0, 6.0]


def test_failure_reports_every_rank():
    start = time.monotonic()
    with pytest.raises(MultiProcessError) as info:
        run_ranks(ranks.fail_on_rank1, 2, pg_timeout=5, grace=2)
    assert time.monotonic() - start < 20
    reports = info.value.reports
    assert "rank 1 exploded" in reports[1]
    assert 0 in reports  # the peer's story (its failed barrier) is reported too
    # each failure says when, on one clock: rank 1 raised before its peer's barrier broke
    stamp = r"failed at (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})"
    at = {r: re.search(stamp, reports[r]).group(1) for r in (0, 1)}
    assert at[1] <= at[0], at
    summary = str(info.value).splitlines()[0]
    assert re.search(r"rank 0 raised at [\d:. -]+; rank 1 raised at [\d:. -]+\)$", summary), summary


def test_a_peer_that_returned_is_named_beside_the_failure():
    """A rank that ends early (say, one collective short of its peers) shows in the summary:
    its peer's "connection closed" is then no mystery."""
    with pytest.raises(MultiProcessError) as info:
        run_ranks(ranks.fail_rank1_alone, 2, init_process_group=False, grace=2)
    assert list(info.value.reports) == [1]
    summary = str(info.value).splitlines()[0]
    assert re.search(r"\(rank 0 returned at [\d:. -]+; rank 1 raised at [\d:. -]+\)$", summary)


def test_deadline_kills_and_dumps_stacks():
    start = time.monotonic()
    with pytest.raises(MultiProcessError, match="deadline exceeded") as info:
        run_ranks(ranks.sleep_forever, 2, timeout=4)
    # 4 s after both ranks started (their start, the forkserver's imports included, took up to
    # several seconds on a loaded CI host: the deadline does not count it)
    assert time.monotonic() - start < 30
    for r in (0, 1):
        assert "sleep_forever" in info.value.reports[r]  # faulthandler stack of the hung rank


def test_kill_a_rank_mid_run():
    out = run_ranks(ranks.killed_mid_run, 2, kill_on={1: "ready"})
    assert out == ["survived", RankKilled(1)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(ranks.all_reduce_rank, 0)
    with pytest.raises(ValueError, match="rendezvous"):
        run_ranks(ranks.all_reduce_rank, 2, rendezvous="tcp")
