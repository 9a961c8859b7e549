"""A user's script constructs ``SyncReplicasOptimizer`` / ``AsyncCentre`` without ``host=`` and
runs under one torchrun per host on two hosts (network namespaces, as in
``tests/cli/test_multihost.py``): the server listens on the address the other host reaches
(the first host's cluster address, not loopback) and both ranks train through it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.cli.launching import finish, stop
from tests.cli.test_multihost import _agents_per_host, hosts  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(300), pytest.mark.multihost]

SCRIPT = Path(__file__).with_name("multihost_user_script.py")


@pytest.mark.parametrize("wrapper", ["sync", "async-easgd"])
def test_servers_listen_where_the_other_host_reaches_them(hosts, tmp_path, wrapper):  # noqa: F811
    procs = _agents_per_host(hosts, 1, [str(SCRIPT), wrapper], tmp_path)
    try:
        results = finish(procs, time.monotonic() + 200)
    finally:
        stop(procs)
    for code, console in results:
        assert code == 0, console
    lines = [json.loads(line) for _, c in results for line in c.splitlines() if '"rank"' in line]
    by_rank = {r["rank"]: r for r in lines}
    assert sorted(by_rank) == [0, 1], lines
    server_host = by_rank[0]["address"].rsplit(":", 1)[0]
    assert server_host == hosts[0].address, lines  # rank 0 runs on the rendezvous host
    assert by_rank[1]["address"] == by_rank[0]["address"]
    assert all(r["x"] != [0.0] * 4 for r in lines), lines  # both trained through the server
