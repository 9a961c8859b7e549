"""Figures of the cluster benchmark: per-run summary from the ranks' logs and the link counters,
and the JSON / Markdown / PNG outputs."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from benchmarks.cluster.netcluster import rate_bits

LOSS_WINDOW = 4  # steps averaged before comparing host 0's loss with the target


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    # every namespace inherits the machine's congestion control; it shapes how flows share a link
    try:
        tcp = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        tcp = "unknown"
    return (
        f"{os.cpu_count()}-core {cpu} VM, Linux {platform.release()}, torch {torch.__version__}, "
        f"gloo, TCP congestion control {tcp}, links shaped with tc tbf in network namespaces"
    )


def _rate(steps: list, start: float, first: int) -> tuple[float, float]:
    """(updates per second, end time) over the training phase of one rank."""
    t_end, _, last = steps[-1]
    return (last - first) / max(t_end - start, 1e-9), t_end


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def time_to_target(steps: list, start: float, target: float) -> float | None:
    losses = [s[1] for s in steps]
    for i in range(LOSS_WINDOW, len(steps) + 1):
        if sum(losses[i - LOSS_WINDOW : i]) / LOSS_WINDOW <= target:
            return steps[i - 1][0] - start
    return None


def _window(samples: list, start: float, end: float) -> list:
    """The samples taken between ``start`` and ``end`` (all of them if none was)."""
    return [s for s in samples if start <= s[0] <= end] or samples


def cpu_times() -> tuple[int, int, int]:
    """The machine's CPU time so far, in clock ticks summed over its cores: ``(busy, steal,
    total)``.  Busy is what this machine's processes and kernel used (user, nice, system, irq,
    softirq); steal what the hypervisor gave to other VMs; total includes idle and iowait."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, steal, sum(fields)


def cpu_use(samples: list, start: float, end: float) -> dict[str, float]:
    """Share of the machine's CPU time that was busy (and stolen) between the samples nearest
    ``start`` and ``end``: near 1, the emulated hosts wait for cores, not for their links."""
    inside = _window(samples, start, end)
    (b0, s0, t0), (b1, s1, t1) = inside[0][2], inside[-1][2]
    total = max(t1 - t0, 1)
    return {"busy": (b1 - b0) / total, "steal": (s1 - s0) / total}


def link_use(samples: list, start: float, end: float, rates: dict) -> dict[int, dict]:
    """Each host's tx/rx bytes per second between the samples nearest ``start`` and ``end``."""
    inside = _window(samples, start, end)
    (t0, c0), (t1, c1) = inside[0][:2], inside[-1][:2]
    span = max(t1 - t0, 1e-9)
    out = {}
    for h in rates:  # the hosts of this job (an idle server host of another job is left out)
        (tx1, rx1), (tx0, rx0) = c1[h], c0[h]
        tx, rx = (tx1 - tx0) / span, (rx1 - rx0) / span
        cap = rate_bits(rates[h]) / 8
        out[int(h)] = {"tx_Bps": tx, "rx_Bps": rx, "rate_Bps": cap, "use": max(tx, rx) / cap,
                       "bytes": max(tx1 - tx0, rx1 - rx0)}  # fmt: skip
    return out


def replicas(ranks: list[dict]) -> list[int] | None:
    """The gradients each update applied (index: update number), from the rank that saw the
    most updates; None where no rank recorded them (rows without SyncReplicas, or results
    written before they were recorded)."""
    histories = [r["replicas_history"] for r in ranks if r.get("replicas_history")]
    return max(histories, key=len) if histories else None


def mean_replicas(
    row: Any, history: list[int] | None, first: int, last: int, workers: int
) -> float | None:
    """Gradients per update over the training phase (updates ``first .. last - 1``): from the
    recorded history, else the row's fixed ``R`` (default: all ``workers``); None for
    ``R="auto"`` without a history."""
    if history and len(history) > first:
        trained = history[first:last]
        return sum(trained) / len(trained)
    R = row.options.get("R", workers)
    return None if R == "auto" else float(R)


def summarise(row: Any, ranks: list[dict], samples: list, rates: dict, args: Any) -> dict:
    """Updates/s, samples/s, time to target, transfer- and compute-only times, link use, and
    where recorded each update's R and each host's slowdown per step."""
    by_host = {r["host"]: r for r in ranks}
    home = by_host[0]  # host 0 always has a fast link; its loss is the one followed
    first, last = home["first_update"], home["last_update"]
    # each host's own (rate, end): local-step rows differ by host (EASGD's centre host
    # exchanges in process, the others over their links)
    per_host = {r["host"]: _rate(r["steps"], r["train_start"], first) for r in ranks}
    history = replicas(ranks)
    if row.kind == "local":  # every rank's local steps are updates: the mean rate
        total = sum(rate for rate, _ in per_host.values())
        updates_s, samples_s = total / len(per_host), total * args.batch
    else:
        # the job made its updates once the first worker saw the last one: a worker slowed at
        # the end (a moving straggler, a transient slowdown) finishes its own step later
        updates_s = max(rate for rate, _ in per_host.values())
        per_update = mean_replicas(row, history, first, last, len(ranks))
        samples_s = None if per_update is None else updates_s * per_update * args.batch
    end = max(t for _, t in per_host.values())
    links = link_use(samples, home["train_start"], end, rates)
    busiest = max(links, key=lambda h: links[h]["use"])
    window = [s for s in samples if home["train_start"] <= s[0] <= end]
    span = (window[-1][0] - window[0][0]) if len(window) > 1 else 0.0
    transfer = home["transfer"]
    return {
        "updates_s": updates_s,
        "per_host_updates_s": {host: rate for host, (rate, _) in per_host.items()},
        "samples_s": samples_s,
        "step_s": 1 / updates_s if updates_s else None,
        "time_to_target_s": time_to_target(home["steps"], home["train_start"], args.target_loss),
        "final_loss": _mean([s[1] for s in home["steps"][-LOSS_WINDOW:]]),
        "transfer_only_s": transfer["seconds"] / max(transfer["updates"], 1),
        "compute_calibrated_s": {r["host"]: r["compute_s"] for r in ranks},
        "links": links,
        "busiest_host": busiest,
        "busiest_use": links[busiest]["use"],
        "cpu": cpu_use(samples, home["train_start"], end),
        "busiest_bytes_per_update": links[busiest]["bytes"] / max(updates_s * span, 1e-9),
        "train_s": end - home["train_start"],
        **_changing(ranks, history, first),
        **_heard(ranks, first),
    }


def _heard(ranks: list[dict], first: int) -> dict:
    """Where each update's members were recorded (backups without a server): each rank's
    share of the training updates, divided by its fair share R / N."""
    recorded = [r["members"] for r in ranks if r.get("members")]
    if not recorded:
        return {}
    trained = max(recorded, key=len)[first:]
    if not trained:
        return {}
    fair = len(trained[0]) / len(ranks)
    return {
        "shares": {
            r["rank"]: sum(r["rank"] in m for m in trained) / len(trained) / fair for r in ranks
        },
        "deference": {r["rank"]: r.get("deference") for r in ranks},
    }


def _changing(ranks: list[dict], history: list[int] | None, first: int) -> dict:
    """The per-update R (``replicas_history``, from update 0; training from ``first_update``)
    and each host's slowdown factor per local step, where there are any."""
    out: dict[str, Any] = {}
    if history is not None:
        out.update(replicas_history=history, first_update=first)
    factors = {r["host"]: r.get("factors", []) for r in ranks}
    if any(f != 1 for fs in factors.values() for f in fs):
        out["slowdown"] = factors
    return out


def replicas_text(result: dict) -> str:
    """The R of a result's training updates: ``"3"``, or ``"3.25 (2-4)"`` where it changed;
    ``"-"`` where none was recorded and the row has no fixed R."""
    history = result.get("replicas_history")
    if history:
        trained = history[result.get("first_update", 0) :] or history
        low, high = min(trained), max(trained)
        return f"{low}" if low == high else f"{sum(trained) / len(trained):.2f} ({low}-{high})"
    R = result["row"].get("options", {}).get("R")
    return "-" if R is None or R == "auto" else f"{R}"


def line(result: dict) -> str:
    head = f"{result['scenario']:>12}  {result['row']['key']:<11}"
    if "error" in result:
        tails = "\n".join(f"--- host {h}\n{t}" for h, t in result["logs"].items())
        return f"{head} FAILED: {result['error']}\n{tails}"
    ttt = result["time_to_target_s"]
    return (
        f"{head} {result['updates_s']:7.3f} upd/s {_samples(result):>7} samples/s  "
        f"transfer {result['transfer_only_s']:6.2f} s  busiest link {result['busiest_use']:4.0%}"
        f"  cpu {result['cpu']['busy']:4.0%}"
        f"  target {'-' if ttt is None else f'{ttt:.1f} s'}  loss {result['final_loss']:.3f}"
        f"  R {replicas_text(result)}"
    )


def _samples(result: dict) -> str:
    samples_s = result["samples_s"]  # None: R chosen per update and not recorded
    return "-" if samples_s is None else f"{samples_s:.1f}"


def _ref(results: list[dict], scenario: str, key: str) -> dict | None:
    for r in results:
        if r["scenario"] == scenario and r["row"]["key"] == key and "error" not in r:
            return r
    return None


def ratios_to_ddp(results: list[dict]) -> dict[tuple[str, str], float]:
    """Each row's updates/s over DDP's in the same scenario, keyed by (scenario, row key).

    Rows that failed, and rows of a scenario whose DDP row is missing or failed, have none:
    a ratio is only taken against the anchor measured in the same run and scenario."""
    ratios = {}
    for r in results:
        ddp = _ref(results, r["scenario"], "ddp")
        if "error" not in r and ddp is not None:
            ratios[r["scenario"], r["row"]["key"]] = r["updates_s"] / ddp["updates_s"]
    return ratios


def _cpu(result: dict) -> str:
    cpu = result.get("cpu")  # results written before the column have none
    if cpu is None:
        return "-"
    return f"{cpu['busy']:.0%}" + (f" (+{cpu['steal']:.0%} stolen)" if cpu["steal"] >= 0.01 else "")


def _device_time(cfg: dict) -> str:
    seconds = float(cfg.get("device_time", 0.0))
    if not seconds:
        return ""
    return (
        f" Every forward/backward adds {seconds:g} s of emulated accelerator time (sleeps: "
        "the CPU is free meanwhile)."
    )


def _load(report: dict) -> str:
    """The load average before the run (reports written before it was recorded: none)."""
    if "load_before" not in report:
        return ""
    return f" Load average before the run: {report['load_before']:.2f} on {report['cores']} cores."


def _scenarios(report: dict) -> list[str]:
    """A line per scenario whose compute slows down (the others need no words)."""
    return [f"Scenario {name}: {text}." for name, text in report.get("scenarios", {}).items()
            if name in ("slow-compute", "moving-straggler", "transient")]  # fmt: skip


def markdown(report: dict) -> str:
    cfg = report["config"]
    out = [
        f"Machine: {report['machine']}.{_load(report)}",
        f"Command: `{report['command']}` ({report['wall_s'] / 60:.1f} min).",
        f"Model: MLP of {cfg['params']:.3g} parameters, batch {cfg['batch']} per worker, Adam; "
        f"{cfg['hosts']} hosts, links {cfg['link']}; target loss {cfg['target_loss']}."
        + _device_time(cfg),
        *_scenarios(report),
        "",
        "| scenario | strategy | updates/s | x DDP | samples/s | step s | transfer-only s "
        "| compute-only s | busiest link use | CPU busy | to target loss s | R per update |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = ratios_to_ddp(report["results"])
    for r in report["results"]:
        label = r["row"]["label"]
        if "error" in r:
            out.append(f"| {r['scenario']} | {label} | failed: {r['error']} |||||||||| ")
            continue
        comp = _ref(report["results"], r["scenario"], "compute")
        ratio = ratios.get((r["scenario"], r["row"]["key"]))
        rel = "-" if ratio is None else f"{ratio:.2f}"
        comp_s = f"{comp['step_s']:.2f}" if comp else "-"
        ttt = r["time_to_target_s"]
        out.append(
            f"| {r['scenario']} | {label} | {r['updates_s']:.3f} | {rel} | {_samples(r)} "
            f"| {r['step_s']:.2f} | {r['transfer_only_s']:.2f} | {comp_s} "
            f"| {r['busiest_use']:.0%} (host {r['busiest_host']}) "
            f"| {_cpu(r)} "
            f"| {'not reached' if ttt is None else f'{ttt:.1f}'} "
            f"| {replicas_text(r)} |"
        )
    return "\n".join(out) + "\n"


def figure(report: dict) -> Any:
    """Three panels, one bar per row and scenario: updates/s (log scale, so rows a hundredfold
    apart share an axis), the same over DDP's in that scenario (linear, a line at 1.0: on the
    log scale a 0.7x row looks level with DDP) and the busiest link's use of its rate.  Where
    rows recorded the R of each update, a second line of panels, one per scenario: R against
    the update number, a line per row (:func:`replicas_panel`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if "error" not in r]
    ratios = ratios_to_ddp(ok)
    scenarios = list(dict.fromkeys(r["scenario"] for r in ok))
    keys = list(dict.fromkeys(r["row"]["key"] for r in ok))
    changing = [s for s in scenarios if any(r.get("replicas_history") for r in ok
                                             if r["scenario"] == s)]  # fmt: skip
    if changing:  # the top line's 3 panels over the bottom line's len(changing)
        k = len(changing)
        fig = plt.figure(figsize=(18, 10))
        grid = fig.add_gridspec(2, 3 * k)
        axes = [fig.add_subplot(grid[0, i * k : (i + 1) * k]) for i in range(3)]
        for i, s in enumerate(changing):
            replicas_panel(fig.add_subplot(grid[1, i * 3 : (i + 1) * 3]), ok, s)
    else:
        fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    # The compute-only row has no communication at all, often 10x DDP or more: the ratio axis
    # ends above the strategies' rows, so that 0.7x and 1.0x stay apart, and clips it.
    top = 1.25 * max([v for (_, k), v in ratios.items() if k != "compute"], default=1.0)
    width = 0.8 / max(len(scenarios), 1)
    for j, s in enumerate(scenarios):
        found = {r["row"]["key"]: r for r in ok if r["scenario"] == s}
        xs = [i + j * width for i in range(len(keys))]
        axes[0].bar(xs, [found[k]["updates_s"] if k in found else 0 for k in keys], width,
                    label=s)  # fmt: skip
        heights = [ratios.get((s, k), 0) for k in keys]
        axes[1].bar(xs, heights, width, label=s)
        for x, h in zip(xs, heights):
            if h and h <= top:  # the value above the bar
                axes[1].text(x, h, f" {h:.2f}", ha="center", va="bottom", fontsize=7,
                             rotation=90)  # fmt: skip
            elif h:  # a clipped bar (the compute row): its value inside, below the axis' top
                axes[1].text(x, 0.98 * top, f"{h:.2f} ", ha="center", va="top", fontsize=7,
                             rotation=90, color="white")  # fmt: skip
        axes[2].bar(xs, [100 * found[k]["busiest_use"] if k in found else 0 for k in keys],
                    width, label=s)  # fmt: skip
    titles = ("updates per second", "updates/s x DDP's (same scenario)",
              "busiest link, % of shaped rate")  # fmt: skip
    for ax, title in zip(axes, titles):
        ax.set_xticks([i + width * (len(scenarios) - 1) / 2 for i in range(len(keys))])
        ax.set_xticklabels(keys, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes[1].set_ylim(0, top)
    if not ratios:
        axes[1].text(0.5, 0.5, "no DDP row in this run", ha="center", transform=axes[1].transAxes)
    cfg = report["config"]
    fig.suptitle(f"{cfg['hosts']} hosts, {cfg['link']} links, MLP {cfg['params']:.3g} params")
    fig.tight_layout()
    return fig


def replicas_panel(ax: Any, results: list[dict], scenario: str) -> None:
    """R against the update number for each of ``scenario``'s rows that recorded it (steps:
    an update's R holds until the next), a dashed line where the training phase starts (the
    updates before it ran on zero gradients, for the transfer-only time)."""
    firsts, top = set(), 1
    for r in results:
        history = r.get("replicas_history")
        if r["scenario"] != scenario or not history:
            continue
        # update u's R spans [u, u + 1): the last update's step gets its width too
        ax.step(range(len(history) + 1), [*history, history[-1]], where="post",
                label=r["row"]["key"])  # fmt: skip
        firsts.add(r.get("first_update", 0))
        top = max(top, *history)
    for first in sorted(firsts):
        ax.axvline(first, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("update number (dashed: training phase from here)")
    ax.set_ylabel("R (gradients aggregated)")
    ax.set_ylim(0.5, top + 0.5)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"R per update, {scenario}")
    ax.legend(fontsize=8)


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict, out: Path, name: str) -> None:
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    (out / f"{name}.md").write_text(table)
    if any("error" not in r for r in report["results"]):
        plot(report, out / f"{name}.png")
    print(table)


def replot(report_path: Path) -> Path:
    """Redraws a run's PNG from its JSON, beside it (``cluster.py --replot``): the figure's
    layout can change without running the benchmark again."""
    png = report_path.with_suffix(".png")
    plot(json.loads(report_path.read_text()), png)
    return png
