"""An emulated cluster on one Linux machine: H hosts as network namespaces on a bridge.

Layout (everything inside namespaces this module creates; the root namespace is untouched)::

    <prefix>-br   a namespace holding the bridge ``br0`` and the bridge-side veth ends b0..bH-1
    <prefix>-h<i> host i: its veth end ``eth0`` with 10.<a>.<b>.<i+1>/24, and ``lo``

Each link is shaped in both directions with ``tc`` ``tbf`` (``netem`` is missing on some kernels):
the host end limits the host's upload, the bridge end its download.  The queue (``latency``) is
kept at tens of milliseconds, as on a real switch port, so small control messages are not hidden
behind seconds of queued bulk data.  The address range is private and exists only inside the
namespaces.

Namespaces are named ``gfc<pid>-...`` after the creating process, so :func:`remove_leftovers`
can delete those of dead creators (a run that was SIGKILLed) without touching a running one.
:class:`Cluster` is a context manager; leaving it (also on an error or KeyboardInterrupt) kills
every process still inside its namespaces and deletes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "gfc"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
IFACE = "eth0"  # every host's interface has this name inside its own namespace
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=20)


def rate_bits(rate: str) -> float:
    """``tc`` rate text (``400mbit``, ``1gbit``, ``100kbit``, ``5000bit``) in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(k|m|g)?bit", rate.strip().lower())
    if not m:
        raise ValueError(f"link rate must look like '400mbit', '1gbit' or '100kbit', got {rate!r}")
    return float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can): no iproute2, no root."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a namespace's name holds its creator's pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str) -> None:
    listed = _run("ip", "netns", "pids", netns, check=False).stdout.split()
    for pid in listed:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of creators that no longer run (and kill what runs inside)."""
    names = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line]
    gone = []
    for name in names:
        m = _NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and not process_alive(int(m.group(1))):
            _kill_inside(name)
            _run("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, interface, address and bridge-side link end."""

    index: int
    netns: str
    address: str
    peer: str  # the veth end in the bridge namespace (shapes this host's download)
    iface: str = IFACE


class Cluster:
    """``hosts`` namespaces on a bridge, each link shaped to ``link`` (``slow`` overrides a
    host's rate by index).  Use as a context manager."""

    def __init__(
        self,
        hosts: int,
        link: str = "400mbit",
        slow: Mapping[int, str] | None = None,
        *,
        latency_ms: int = 20,
        burst: str = "64kb",
    ) -> None:
        if not (isinstance(hosts, int) and 1 <= hosts <= 250):
            raise ValueError(f"Cluster: hosts must be an int in [1, 250], got {hosts!r}")
        slow = dict(slow or {})
        bad = [h for h in slow if not (isinstance(h, int) and 0 <= h < hosts)]
        if bad:
            raise ValueError(f"Cluster: slow hosts must be indices in [0, {hosts}), got {bad}")
        self.rates = {h: slow.get(h, link) for h in range(hosts)}
        for r in self.rates.values():
            rate_bits(r)
        self.latency_ms, self.burst = latency_ms, burst
        pid = os.getpid()
        self.prefix = f"{PREFIX}{pid}-{int(time.time() * 1000) % 100000}"
        self.bridge = f"{self.prefix}-br"
        net = f"10.{232 + pid % 20}.{pid % 250}"  # private, and only inside our namespaces
        self.hosts = [
            Host(i, f"{self.prefix}-h{i}", f"{net}.{i + 1}", f"b{i}") for i in range(hosts)
        ]
        self._made: list[str] = []

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> Cluster:
        try:
            self.create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def create(self) -> None:
        remove_leftovers()
        self._netns_add(self.bridge)
        _run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for h in self.hosts:
            self._netns_add(h.netns)
            _run("ip", "link", "add", h.iface, "netns", h.netns, "type", "veth",
                 "peer", "name", h.peer, "netns", self.bridge)  # fmt: skip
            _run("ip", "-n", self.bridge, "link", "set", h.peer, "master", "br0")
            _run("ip", "-n", self.bridge, "link", "set", h.peer, "up")
            _run("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.iface)
            _run("ip", "-n", h.netns, "link", "set", h.iface, "up")
            _run("ip", "-n", h.netns, "link", "set", "lo", "up")
            self.shape(h.index, self.rates[h.index], add=True)

    def _netns_add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def remove(self) -> None:
        """Kill every process inside the namespaces, then delete them (the veths go along)."""
        for name in reversed(self._made):
            _kill_inside(name)
        for name in reversed(self._made):
            _run("ip", "netns", "del", name, check=False)
        self._made = []

    def kill_host(self, host: int) -> None:
        """Lose host ``host``: SIGKILL every process inside its namespace (a machine gone)."""
        _kill_inside(self.hosts[host].netns)

    # ------------------------------------------------------------------ links
    def shape(self, host: int, rate: str, *, add: bool = False) -> None:
        """Set host ``host``'s link to ``rate`` both ways (tbf on both veth ends)."""
        rate_bits(rate)
        h = self.hosts[host]
        verb = "add" if add else "change"
        tbf = ["root", "tbf", "rate", rate, "burst", self.burst, "latency", f"{self.latency_ms}ms"]
        _run("tc", "-n", h.netns, "qdisc", verb, "dev", h.iface, *tbf)
        _run("tc", "-n", self.bridge, "qdisc", verb, "dev", h.peer, *tbf)
        self.rates[host] = rate

    def tcp_counters(self) -> dict[int, tuple[int, int]]:
        """TCP segments each host has sent and retransmitted so far, from its namespace's
        ``/proc/net/snmp``: ``{host: (out_segs, retrans_segs)}`` (a host's loopback traffic,
        such as host 0's ranks talking to its own store, is counted too)."""
        out = {}
        for h in self.hosts:
            text = _run("ip", "netns", "exec", h.netns, "cat", "/proc/net/snmp").stdout
            rows = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
            names, values = rows  # a header line, then its values
            tcp = dict(zip(names, values, strict=True))
            out[h.index] = (int(tcp["OutSegs"]), int(tcp["RetransSegs"]))
        return out

    def counters(self) -> dict[int, tuple[int, int]]:
        """Bytes each host's interface has sent and received so far: ``{host: (tx, rx)}``."""
        out = {}
        for h in self.hosts:
            text = _run("ip", "-n", h.netns, "-s", "-j", "link", "show", "dev", h.iface).stdout
            stats = json.loads(text)[0]["stats64"]
            out[h.index] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out

    # ------------------------------------------------------------------ processes
    def popen(
        self, host: int, cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen:  # fmt: skip
        """Start ``cmd`` inside host ``host`` in a session of its own (killpg ends its tree);
        gloo is told the host's interface.  Output goes to ``log`` (or a pipe)."""
        h = self.hosts[host]
        full_env = {**os.environ, "GLOO_SOCKET_IFNAME": h.iface, **(env or {})}
        out = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115
        try:
            return subprocess.Popen(
                ["ip", "netns", "exec", h.netns, *cmd], cwd=cwd, env=full_env, stdout=out,
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
        finally:
            if log is not None:
                out.close()

    def torchrun(
        self, script: Sequence[str], *, cwd: Path, port: int, env_per_host: Mapping[int, dict]
        | None = None, logs: Path | None = None, rdzv_id: str = "gfc", hosts: int | None = None,
        static: bool = False,
    ) -> list[subprocess.Popen]:  # fmt: skip
        """One ``torchrun`` per host (the first ``hosts`` of them, default all), one worker
        each, rendezvous on host 0, as users launch a multi-node job.  ``GF_CLUSTER_HOST``
        tells each worker its host index.  c10d rendezvous numbers the ranks in no set order;
        ``static`` makes rank == host index (a job whose last hosts must be the last ranks:
        dedicated servers)."""
        used = self.hosts[: len(self.hosts) if hosts is None else hosts]
        first = used[0]
        agent = [*TORCHRUN, f"--nnodes={len(used)}", "--nproc-per-node=1",
                 "--monitor-interval=0.2", "--max-restarts=0"]  # fmt: skip
        if static:
            agent += ["--rdzv-backend=static", f"--master-addr={first.address}",
                      f"--master-port={port}"]  # fmt: skip
        else:
            agent += ["--rdzv-backend=c10d", f"--rdzv-endpoint={first.address}:{port}",
                      f"--rdzv-id={rdzv_id}"]  # fmt: skip
        procs = []
        for h in used:
            where = [f"--node-rank={h.index}"] if static else [
                f"--rdzv-conf=is_host={int(h is first)}"]  # fmt: skip
            cmd = [*agent, *where, f"--local-addr={h.address}"]
            env = {"GF_CLUSTER_HOST": str(h.index), "GF_CLUSTER_ADDR": h.address}
            env.update((env_per_host or {}).get(h.index, {}))
            log = None if logs is None else logs / f"host{h.index}.log"
            procs.append(self.popen(h.index, [*cmd, *script], cwd=cwd, env=env, log=log))
        return procs


def stop(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM each process's session, then SIGKILL what is left; reap them."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while any(p.poll() is None for p in alive) and time.monotonic() < end:
        time.sleep(0.1)
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def wait_all(procs: Sequence[subprocess.Popen], deadline: float) -> list[int] | None:
    """Return codes once every process ended, or None if ``deadline`` (monotonic) passed
    first (the processes are then still running: call :func:`stop`)."""
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs):
            return [p.returncode for p in procs]
        time.sleep(0.1)
    return None
