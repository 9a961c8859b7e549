"""Each emulated host's link, every 10 ms: how a strategy fills its links over time.

`benchmarks/cluster/cluster.py` reports each link's average use; this shows how the use is made up.
While a cluster run is going, as root:

    python benchmarks/cluster/link_timeline.py watch --seconds 170 --out /tmp/links.txt
    python benchmarks/cluster/link_timeline.py summarize /tmp/links.txt --rate 200mbit --last 46

``watch`` finds the running cluster's bridge namespace and samples, from inside it, every
host's bridge-side interface (its ``tx`` is the host's download, its ``rx`` the host's upload),
one line per sample, flushed as it goes (the cluster's teardown ends the sampler).
``summarize`` takes the last ``--last`` seconds of traffic (a run's training phase comes
last) and prints per host and direction the mean use of the rate, the share of 100 ms bins
under half the rate, and the time with the link idle (under 5% in a 10 ms sample); then, for
the times a host's upload runs under half its rate, how often some host's download was full
meanwhile (the traffic was not spread evenly over the links) and how often its own was.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.cluster.netcluster import PREFIX, process_alive, rate_bits  # noqa: E402


def _stop_on_sigterm() -> None:
    """SIGTERM ends the sampling as its time would: every row taken is in the file."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)


def sample(out: Path, seconds: float, interval: float = 0.01) -> None:
    """Sample this namespace's interfaces (not ``lo``, not the bridge) into ``out``."""
    _stop_on_sigterm()
    names = sorted(i for i in os.listdir("/sys/class/net") if i != "lo" and not i.startswith("br"))
    files = {
        i: [open(f"/sys/class/net/{i}/statistics/{c}_bytes") for c in ("tx", "rx")]  # noqa: SIM115
        for i in names
    }
    with open(out, "w") as f:
        f.write(" ".join(names) + "\n")
        end, n = time.time() + seconds, 0
        while time.time() < end:
            t = time.time()
            row = [f"{t:.4f}"]
            for i in names:
                for counter in files[i]:
                    counter.seek(0)
                    row.append(counter.read().strip())
            f.write(" ".join(row) + "\n")
            n += 1
            if n % 50 == 0:  # the sampler is killed with the cluster: keep what it has
                f.flush()
            time.sleep(max(0.0, interval - (time.time() - t)))


def _live(namespace: str) -> bool:
    """Whether the process that made ``namespace`` (``gfc<pid>-...``) still runs."""
    digits = namespace[len(PREFIX) :].split("-")[0]
    return digits.isdigit() and int(digits) > 0 and process_alive(int(digits))


def watch(out: Path, seconds: float) -> None:
    """Wait for a cluster's bridge namespace, then sample inside it."""
    for _ in range(600):
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        bridges = [n.split()[0] for n in names.splitlines() if n.startswith(PREFIX)]
        # a live run's bridge (a dead run's leftovers are removed by the next run, maybe
        # while we would sample them): the name holds the creating process's pid
        bridges = [b for b in bridges if b.endswith("-br") and _live(b)]
        if bridges:
            break
        time.sleep(0.5)
    else:
        raise SystemExit("no emulated cluster appeared in 300 s")
    me = [sys.executable, __file__, "sample", str(out), "--seconds", str(seconds)]
    subprocess.run(["ip", "netns", "exec", bridges[0], *me], check=False)


def read(path: Path) -> tuple[list[str], np.ndarray]:
    """Interface names and the rows (time, then tx and rx bytes per interface); a torn last
    line (the sampler killed mid-write) is skipped."""
    lines = path.read_text().splitlines()
    names = lines[0].split()
    rows = [[float(x) for x in line.split()] for line in lines[1:]]
    return names, np.array([r for r in rows if len(r) == 1 + 2 * len(names)])


class _Window:
    """The last ``last`` seconds of traffic in a sampler's file, as shares of ``rate``."""

    def __init__(self, path: Path, rate: str, last: float) -> None:
        self.names, rows = read(path)
        self.t, self.counters = rows[:, 0], rows[:, 1:] / (rate_bits(rate) / 8)
        self.step = np.diff(self.t)
        self.fine = np.diff(self.counters, axis=0) / self.step[:, None]  # per sample
        busy = np.nonzero(self.fine.sum(axis=1) > 0.5)[0]
        if len(busy) == 0:
            raise ValueError(f"{path}: no traffic")
        self.stop, self.last = self.t[1:][busy[-1]], last
        self.inside = (self.t[1:] > self.stop - last) & (self.t[1:] <= self.stop)

    def bins(self, width: float) -> np.ndarray:
        """Each column's use in bins of ``width`` seconds over the window."""
        edges = np.arange(self.stop - self.last, self.stop + 1e-9, width)
        at = np.searchsorted(self.t, edges).clip(max=len(self.t) - 1)
        return np.diff(self.counters[at], axis=0) / np.diff(self.t[at])[:, None]


def summarize(path: Path, rate: str, last: float) -> dict[str, dict[str, float]]:
    """Per interface and direction: ``use`` (mean share of the rate), ``under_half`` (share
    of 100 ms bins below half the rate) and ``idle_s`` (seconds of 10 ms samples below 5%),
    over the last ``last`` seconds before the traffic ended."""
    w = _Window(path, rate, last)
    coarse = w.bins(0.1)
    out: dict[str, dict[str, float]] = {}
    for k, name in enumerate(w.names):
        for c, direction in ((0, "down"), (1, "up")):  # bridge side: tx = the host's download
            col = 2 * k + c
            out[f"{name} {direction}"] = {
                "use": float(coarse[:, col].mean()),
                "under_half": float(np.mean(coarse[:, col] < 0.5)),
                "idle_s": float(np.sum(w.step[w.inside] * (w.fine[w.inside, col] < 0.05))),
            }
    return out


def slack_uploads(path: Path, rate: str, last: float) -> dict[str, dict[str, float]]:
    """Per interface, over the same window in 50 ms bins: ``low`` (share of bins with the
    host's upload under half the rate), and of those bins the share where some other host's
    download was over 85% (``other_down_full``: that host's download was the bottleneck) and
    where its own was (``own_down_full``: the host was receiving with little to send)."""
    w = _Window(path, rate, last)
    bins = w.bins(0.05)
    down, up = bins[:, 0::2], bins[:, 1::2]
    out = {}
    for k, name in enumerate(w.names):
        low = up[:, k] < 0.5
        others = np.delete(down, k, axis=1)[low]
        out[name] = {
            "low": float(low.mean()),
            "other_down_full": float(np.mean(others.max(axis=1) > 0.85)) if low.any() else 0.0,
            "own_down_full": float(np.mean(down[low, k] > 0.85)) if low.any() else 0.0,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="sample the running cluster's links (root)")
    w.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("sample", help="sample this namespace's links (what watch runs)")
    s.add_argument("out", type=Path)
    for q in (w, s):
        q.add_argument("--seconds", type=float, default=170.0)
    m = sub.add_parser("summarize", help="per host and direction: use, bins under half, idle")
    m.add_argument("path", type=Path)
    m.add_argument("--rate", default="200mbit")
    m.add_argument("--last", type=float, default=45.0, help="seconds of traffic, from its end")
    args = p.parse_args(argv)
    if args.cmd == "sample":
        sample(args.out, args.seconds)
    elif args.cmd == "watch":
        watch(args.out, args.seconds)
    else:
        for key, v in summarize(args.path, args.rate, args.last).items():
            print(f"{key:>8}: use {v['use']:4.0%}, 100 ms bins under half {v['under_half']:4.0%}, "
                  f"idle {v['idle_s']:5.1f} s")  # fmt: skip
        for key, v in slack_uploads(args.path, args.rate, args.last).items():
            print(f"{key:>8}: upload under half in {v['low']:4.0%} of 50 ms bins; of those, "
                  f"another host's download over 85% in {v['other_down_full']:4.0%}, "
                  f"its own in {v['own_down_full']:4.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
