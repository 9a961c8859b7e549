"""A server lost while its reply's tensors are on the wire is found lost within seconds.

gloo does not wake a receive whose sender died with the message in flight: the connection is
closed, yet the receive waits for the group's whole timeout (``transport.pairs``).  Two
emulated hosts, a 40 MB reply on a 100 Mbit/s link (over 3 s on the wire): the server's host is
lost a second into it, and the client must raise ``ServerUnreachable`` long before its 60 s
timeout (its check of the server's store finds the connection closed)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from benchmarks.cluster.netcluster import stop

from .netns import ROOT

pytestmark = [pytest.mark.timeout(120), pytest.mark.multihost]
SCRIPT = Path(__file__).with_name("reply_cut.py")


def test_a_server_lost_mid_reply_is_found_lost_within_seconds(make_cluster, tmp_path) -> None:
    cluster = make_cluster(2, "100mbit")
    address, port = cluster.hosts[0].address, 29611
    env = {"PYTHONPATH": str(ROOT / "src")}
    server = cluster.popen(0, [sys.executable, str(SCRIPT), "server", address, str(port), "40"],
                           cwd=ROOT, env=env, log=tmp_path / "server.log")  # fmt: skip
    log = tmp_path / "client.log"
    try:
        deadline = time.monotonic() + 60
        while "serving" not in (tmp_path / "server.log").read_text():
            assert time.monotonic() < deadline and server.poll() is None, "server never served"
            time.sleep(0.1)
        client = cluster.popen(1, [sys.executable, str(SCRIPT), "client", address, str(port),
                                   "60"], cwd=ROOT, env=env, log=log)  # fmt: skip
        while "connected" not in log.read_text():
            assert time.monotonic() < deadline and client.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(1.0)  # the reply is on the wire: 40 MB take over 3 s at 100 Mbit/s
        cluster.kill_host(0)
        client.wait(timeout=70)
    finally:
        stop([server])
    (line,) = [x for x in log.read_text().splitlines() if x.startswith("{")]
    outcome = json.loads(line)
    assert outcome["raised"] == "ServerUnreachable", outcome
    assert "the server at" in outcome["message"], outcome
    # the kill came 1 s in; without the check the receive waited for the 60 s timeout
    assert outcome["after_s"] < 1.0 + 2 * 0.5 + 5, outcome
