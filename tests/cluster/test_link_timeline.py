"""``benchmarks/cluster/link_timeline.py``: the summary's arithmetic against a timeline built by
hand, and, where namespaces can be made, a sampler inside a cluster's bridge that sees a
transfer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchmarks.cluster.link_timeline import _live, read, slack_uploads, summarize
from benchmarks.cluster.netcluster import PREFIX

from .netns import ROOT, transfer


def _write(path: Path, rates: list[tuple[float, float, float, float]], dt: float = 0.01) -> None:
    """A sampler's file for interfaces ``b0, b1``; ``rates``: per 10 ms, (b0 tx, b0 rx, b1
    tx, b1 rx) as shares of 8 Mbit/s (1 MB/s)."""
    lines = ["b0 b1"]
    counters = [0.0] * 4
    for k, row in enumerate([(0, 0, 0, 0), *rates]):
        counters = [c + r * 1e6 * dt for c, r in zip(counters, row, strict=True)]
        lines.append(" ".join([f"{1000 + k * dt:.4f}", *(str(int(c)) for c in counters)]))
    path.write_text("\n".join(lines) + "\n4000.0 12")  # and a torn last line


def test_summary_of_a_timeline_built_by_hand(tmp_path: Path) -> None:
    # 2 s of traffic then 1 s of nothing: b0's download (its tx) full all along; its upload
    # at 40% for the first second, then idle; b1's upload full for 1.5 s, then at 60%.
    rates = [(1.0, 0.4 if k < 100 else 0.0, 0.0, 1.0 if k < 150 else 0.6) for k in range(200)]
    rates += [(0.0, 0.0, 0.0, 0.0)] * 100
    path = tmp_path / "links.txt"
    _write(path, rates)
    names, rows = read(path)
    assert names == ["b0", "b1"] and rows.shape == (301, 5)  # the torn line is skipped
    got = summarize(path, "8mbit", last=2.0)
    b0_down, b0_up, b1_up = got["b0 down"], got["b0 up"], got["b1 up"]
    assert b0_down["use"] == pytest.approx(1.0, abs=0.01)
    assert b0_down["under_half"] == 0 and b0_down["idle_s"] == pytest.approx(0.0, abs=0.011)
    assert b0_up["use"] == pytest.approx(0.2, abs=0.01)  # 40% for half the window
    assert b0_up["under_half"] == 1.0  # 40% and 0% are both under half
    assert b0_up["idle_s"] == pytest.approx(1.0, abs=0.02)
    assert b1_up["use"] == pytest.approx(0.75 * 1.0 + 0.25 * 0.6, abs=0.01)
    assert b1_up["under_half"] == 0 and b1_up["idle_s"] == pytest.approx(0.0, abs=0.011)
    assert got["b1 down"]["idle_s"] == pytest.approx(2.0, abs=0.02)
    # b0's upload is under half all along, while its own download is full and b1's is empty
    slack = slack_uploads(path, "8mbit", last=2.0)
    assert slack["b0"] == {"low": 1.0, "other_down_full": 0.0, "own_down_full": 1.0}
    assert slack["b1"] == {"low": 0.0, "other_down_full": 0.0, "own_down_full": 0.0}
    _write(path, [(0.0, 0.0, 0.0, 0.0)] * 10)
    with pytest.raises(ValueError, match="no traffic"):
        summarize(path, "8mbit", last=1.0)


def test_watch_takes_only_a_live_runs_bridge() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert _live(f"{PREFIX}{os.getpid()}-123-br")
    assert not _live(f"{PREFIX}{gone.pid}-123-br")  # a dead run's leftover
    assert not _live(f"{PREFIX}x-br") and not _live(f"{PREFIX}0-1-br")


def _sampled_after(out: Path, moment: float, sampler: subprocess.Popen) -> None:
    """Wait until the sampler's file holds a row taken after ``moment`` (time.time())."""
    while True:
        assert sampler.poll() is None, "the sampler ended early"
        lines = out.read_text().splitlines() if out.exists() else []
        stamps = [float(line.split()[0]) for line in lines[1:] if line.split()]
        if stamps and stamps[-1] > moment:
            return
        time.sleep(0.05)


@pytest.mark.multihost
@pytest.mark.timeout(120)
def test_the_sampler_in_the_bridge_sees_a_transfer(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(2, "40mbit")
    out = tmp_path / "links.txt"
    script = [sys.executable, str(ROOT / "benchmarks" / "cluster" / "link_timeline.py")]
    sampler = subprocess.Popen(
        ["ip", "netns", "exec", cluster.bridge, *script, "sample", str(out), "--seconds", "90"]
    )
    try:
        # events, not fixed times (a loaded machine starts a process in seconds): the transfer
        # begins once rows are in the file, the sampler ends once a row after it is
        _sampled_after(out, 0.0, sampler)
        nbytes = 2 * 2**20  # 0.4 s at 40 Mbit/s
        transfer(cluster, 1, 0, nbytes)
        _sampled_after(out, time.time(), sampler)
        sampler.terminate()
        assert sampler.wait(20) == 0
    finally:
        sampler.kill()
    names, rows = read(out)
    peers = [h.peer for h in cluster.hosts]
    assert sorted(names) == sorted(peers)
    k = names.index(cluster.hosts[1].peer)
    up = rows[-1, 1 + 2 * k + 1] - rows[0, 1 + 2 * k + 1]  # bridge side rx: host 1's upload
    assert nbytes <= up <= 1.1 * nbytes
    # the transfer's last 0.4 s ran at about the link's rate (not above it: the shaper)
    moved = summarize(out, "40mbit", last=0.4)[f"{cluster.hosts[1].peer} up"]
    assert 0.5 < moved["use"] <= 1.05
