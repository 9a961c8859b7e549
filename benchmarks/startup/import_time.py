"""Start-up cost of ``import gradfleet`` and of the CLI commands that do not train.

Run from the repository root::

    python -m benchmarks.startup.import_time --runs 7 --out benchmarks/results

Method: every command is a fresh interpreter (``sys.executable``), timed wall-clock from
start to exit; the commands run in rounds (torch, gradfleet, --help, list, bad input, torch,
...) so a slow spell of a shared machine hits all of them alike; one warm-up round (disk
cache) is not counted.  Reported: the median of ``--runs`` rounds, and each command's median
minus ``python -c "import torch"``'s median (wall clock, and CPU time user+sys, which a
busy shared machine distorts far less), against the start-up targets: ``import
gradfleet`` adds at most 0.3 s, ``--help``, ``list`` and a bad-input error at most 1.0 s.
Writes ``import_time.json`` under ``--out`` and prints a table; exit code 1 if a target is
missed.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CLI = "from gradfleet.cli.main import main; import sys; sys.argv[0] = 'gradfleet'; main()"
# (name, python -c code, extra argv, allowed exit codes, target seconds above import torch)
COMMANDS = [
    ("import torch", "import torch", [], (0,), None),
    ("import gradfleet", "import gradfleet", [], (0,), 0.3),
    ("gradfleet --help", CLI, ["--help"], (0,), 1.0),
    ("gradfleet list", CLI, ["list"], (0,), 1.0),
    ("gradfleet train -o nosuchopt", CLI, ["train", "-o", "nosuchopt"], (2,), 1.0),
]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time_once(code: str, argv: list[str], ok: tuple[int, ...]) -> tuple[float, float]:
    """(wall seconds, CPU seconds user+sys) of one fresh interpreter running ``code``."""
    cpu, start = _cpu_s(), time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
    )
    elapsed, cpu = time.perf_counter() - start, _cpu_s() - cpu
    if res.returncode not in ok:
        raise RuntimeError(f"{code} {argv}: exit {res.returncode}\n{res.stderr[-2000:]}")
    return elapsed, cpu


def measure(runs: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name, *_ in COMMANDS}
    cpus: dict[str, list[float]] = {name: [] for name, *_ in COMMANDS}
    for round_ in range(runs + 1):
        for name, code, argv, ok, _ in COMMANDS:
            t, c = _time_once(code, argv, ok)
            if round_:  # round 0 warms the disk cache
                times[name].append(t)
                cpus[name].append(c)
    base = statistics.median(times["import torch"])
    cpu_base = statistics.median(cpus["import torch"])
    rows = []
    for name, *_, target in COMMANDS:
        med, cpu = statistics.median(times[name]), statistics.median(cpus[name])
        rows.append(
            {
                "command": name,
                "median_s": round(med, 3),
                "above_import_torch_s": None if target is None else round(med - base, 3),
                # CPU time (user + sys) hardly moves when other jobs share the cores.
                "cpu_median_s": round(cpu, 3),
                "cpu_above_import_torch_s": None if target is None else round(cpu - cpu_base, 3),
                "target_s": target,
                "met": None if target is None else med - base <= target,
                "runs_s": [round(t, 3) for t in times[name]],
            }
        )
    import torch

    return {
        "machine": _cpu_name(),
        "cores": _cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "runs": runs,
        "rows": rows,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _plus(x: float | None) -> str:
    return "" if x is None else f"{x:+.2f}"


def table(result: dict) -> str:
    lines = [
        f"{result['machine']}, {result['cores']} cores, torch {result['torch']}, "
        f"median of {result['runs']} runs",
        "",
        "| command | wall (s) | above `import torch` | CPU (s) | CPU above | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        above = _plus(r["above_import_torch_s"])
        cpu_above = _plus(r["cpu_above_import_torch_s"])
        target = "" if r["target_s"] is None else f"<= +{r['target_s']:.1f}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(
            f"| `{r['command']}` | {r['median_s']:.2f} | {above} | {r['cpu_median_s']:.2f} "
            f"| {cpu_above} | {target} | {met} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    result = measure(args.runs)
    print(table(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "import_time.json").write_text(json.dumps(result, indent=2) + "\n")
    if not all(r["met"] in (None, True) for r in result["rows"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
