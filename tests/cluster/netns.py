"""The emulated cluster as a pytest fixture: ``make_cluster(hosts, link, slow)`` builds
``benchmarks.cluster.netcluster.Cluster`` (hosts = network namespaces on a bridge, tc-shaped
links) and removes it when the test ends, or skips the test with the reason namespaces cannot be
made."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from benchmarks.cluster.netcluster import Cluster, stop, unavailable_reason, wait_all

ROOT = Path(__file__).resolve().parents[2]
SINK = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5999)); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); n = 0
while (b := c.recv(1 << 16)):
    n += len(b)
print(n)
"""
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5999), timeout=20)
buf = b"x" * (1 << 16); start = time.perf_counter()
for _ in range(int(sys.argv[2]) // len(buf)):
    c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print(time.perf_counter() - start)
"""


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no emulated cluster here: {reason}")
    made: list[Cluster] = []

    def make(hosts: int, link: str = "400mbit", slow: dict[int, str] | None = None) -> Cluster:
        cluster = Cluster(hosts, link, slow)
        made.append(cluster)
        return cluster.__enter__()

    try:
        yield make
    finally:
        for cluster in made:
            cluster.remove()


def transfer(cluster: Cluster, src: int, dst: int, nbytes: int, deadline: float = 30) -> float:
    """Send ``nbytes`` over TCP from host ``src`` to host ``dst``; seconds the sender took
    until the receiver closed (every byte arrived)."""
    address = cluster.hosts[dst].address
    sink = cluster.popen(dst, [sys.executable, "-c", SINK, address], cwd=ROOT)
    time.sleep(0.5)  # the sink listens
    source = cluster.popen(src, [sys.executable, "-c", SOURCE, address, str(nbytes)], cwd=ROOT)
    codes = wait_all([sink, source], time.monotonic() + deadline)
    if codes is None:
        stop([sink, source])
        raise AssertionError(f"transfer of {nbytes} bytes did not end in {deadline} s")
    received, seconds = sink.stdout.read(), source.stdout.read()
    assert codes == [0, 0] and int(received) == nbytes, (codes, received, seconds)
    return float(seconds)
