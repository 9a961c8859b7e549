"""The emulated cluster itself: namespaces on a bridge are made and removed (also after an
error, and a dead run's leftovers), bad arguments are refused before anything is made, and a
link's shaped rate holds for a bounded transfer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from benchmarks.cluster.netcluster import (
    PREFIX,
    Cluster,
    rate_bits,
    remove_leftovers,
    unavailable_reason,
)

from .netns import transfer

pytestmark = [pytest.mark.timeout(120), pytest.mark.multihost]
WHY = unavailable_reason()
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"no emulated cluster here: {WHY}")


def _namespaces() -> set[str]:
    text = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in text.splitlines() if line.strip()}


def test_links_carry_about_their_shaped_rate(make_cluster) -> None:
    cluster = make_cluster(3, "40mbit", {2: "10mbit"})
    assert {h.netns for h in cluster.hosts} | {cluster.bridge} <= _namespaces()
    before = cluster.counters()
    nbytes = 4 * 2**20  # 0.8 s at 40 Mbit/s
    seconds = transfer(cluster, 1, 0, nbytes)
    after = cluster.counters()
    # TCP/IP headers add ~3% on the wire; tbf's 64 kB burst lets at most that much through
    # at once; the lower bound leaves room for two shared cores (not for a missing shaper).
    rate = nbytes * 8 / seconds
    assert 0.5 * rate_bits("40mbit") <= rate <= 1.05 * rate_bits("40mbit"), rate
    assert after[1][0] - before[1][0] >= nbytes  # host 1's interface sent it
    assert after[0][1] - before[0][1] >= nbytes  # host 0's received it
    slow = 1 * 2**20 * 8 / transfer(cluster, 2, 0, 2**20)  # 0.8 s at 10 Mbit/s
    assert 0.5 * rate_bits("10mbit") <= slow <= 1.05 * rate_bits("10mbit"), slow
    cluster.remove()
    assert not {h.netns for h in cluster.hosts} & _namespaces()


@needs_netns
def test_removed_after_an_error_inside() -> None:
    with pytest.raises(RuntimeError, match="inside"):
        with Cluster(2, "100mbit") as cluster:
            names = {h.netns for h in cluster.hosts}
            assert names <= _namespaces()
            raise RuntimeError("inside")
    assert not names & _namespaces()


def test_bad_arguments_are_refused_before_anything_is_made() -> None:
    # this process's namespaces only: other test processes make and remove theirs meanwhile
    mine = f"{PREFIX}{os.getpid()}-"
    with pytest.raises(ValueError, match="link rate must look like"):
        Cluster(2, "fast")
    with pytest.raises(ValueError, match=r"slow hosts must be indices in \[0, 2\)"):
        Cluster(2, "100mbit", {5: "10mbit"})
    with pytest.raises(ValueError, match="hosts must be an int"):
        Cluster(0)
    assert not {n for n in _namespaces() if n.startswith(mine)}


@needs_netns
def test_leftovers_of_a_dead_run_are_removed() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"{PREFIX}{dead.pid}-1-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in remove_leftovers()
        assert name not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
