"""``benchmarks/cluster/link_ceiling.py``: each pattern moves exactly the bytes of the strategy it
stands for (each host's interface counters against the pattern's arithmetic), the pushes-only
pattern one direction of each link, and the time the pushes were in is recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.cluster import link_ceiling
from benchmarks.cluster.netcluster import unavailable_reason

PARAMS = 4e5  # 1.6 MB a step: seconds per pattern at 200 Mbit/s


@pytest.mark.timeout(300)
@pytest.mark.multihost
def test_each_pattern_moves_its_strategys_bytes(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no emulated cluster here: {reason}")
    link_ceiling.main(["--params", str(PARAMS), "--steps", "2", "--out", str(tmp_path),
                       "--link", "200mbit",
                       "--name", "t", "--deadline", "120"])  # fmt: skip
    results = json.loads((tmp_path / "t.json").read_text())["results"]
    p = PARAMS * 4  # bytes of one worker's gradient (float32)
    # per host and step, (up, down): the ring's 2(n-1)/n P on every worker; P each way on
    # every worker and every dedicated server; over the workers, 3/4 P of pushes plus 3/4 P
    # of sums each way (a worker's own shard stays on its host)
    want = {
        "allreduce": {h: 1.5 * p for h in range(4)},
        "dedicated": {h: 1.0 * p for h in range(8)},
        "over-workers": {h: 1.5 * p for h in range(4)},
    }
    for pattern, hosts in want.items():
        got = results[pattern]
        assert len(got["steps_s"]) == 2 and all(s > 0 for s in got["steps_s"])
        for h, nbytes in hosts.items():
            for direction, measured in zip(("up", "down"), got["bytes_per_step"][str(h)]):
                # TCP/IP and gloo headers, the barriers: a few percent on top, never less
                assert nbytes <= measured <= 1.1 * nbytes, (pattern, h, direction, measured)
    # the pushes alone: P up from every worker and into every server host, and back only
    # what TCP acknowledges and the barriers carry (well under a tenth)
    alone = results["dedicated-pushes"]
    for h in range(8):
        up, down = alone["bytes_per_step"][str(h)]
        sent, acks = (up, down) if h < 4 else (down, up)
        assert p <= sent <= 1.1 * p and acks < 0.1 * p, (h, up, down)
    # when the last server had all its pushes: recorded for every measured step of the
    # push patterns (the ring has none)
    for pattern in ("dedicated", "over-workers", "dedicated-pushes"):
        got = results[pattern]
        assert len(got["pushes_in_s"]) == 2 and all(t > 0 for t in got["pushes_in_s"])
    # no shard group is in sooner than its bytes can cross
    # a server host's link: group j needs (j + 1) groups of pushes, each P/16 from every worker
    # but the server itself (4 dedicated, 3 over the workers), less tbf's 64 KiB burst and 5 ms
    # for the ranks leaving the barrier at different moments
    rate = 200e6 / 8
    for pattern, senders in (("dedicated", 4), ("over-workers", 3), ("dedicated-pushes", 4)):
        got = results[pattern]
        assert len(got["groups_in_s"]) == 2
        for groups in got["groups_in_s"]:
            assert len(groups) == 4, (pattern, groups)
            for j, t in enumerate(groups):
                least = ((j + 1) * senders * p / 16 - 65536) / rate - 0.005
                assert t >= least, (pattern, j, groups, least)
        assert len(got["groups_in_median_s"]) == 4
    # TCP segments per host: every host sent at least one per 1514 bytes on its interface
    # (an MTU-sized frame) and retransmitted at most what it sent
    for pattern, got in results.items():
        steps = len(got["steps_s"]) + 1  # the warm-up step's bytes are counted too
        for h, (sent, again) in got["tcp_segments"].items():
            up = got["bytes_per_step"][h][0] * steps
            assert sent * 1514 >= up and 0 <= again <= sent, (pattern, h, sent, again, up)
    # the pushes alone: a step lasts until the last server host has them all
    assert all(s >= t for s, t in zip(alone["steps_s"], alone["pushes_in_s"], strict=True))
    assert results["allreduce"]["pushes_in_s"] == []
