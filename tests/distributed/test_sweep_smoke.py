"""Smoke test of the data-plane sweep (benchmarks/distributed/distributed_sweep.py): tiny model,
two paths, the rates and CPU figures are positive and the ratio is computed.  Speed itself is
never asserted here."""

from __future__ import annotations

import pytest
from benchmarks.distributed import distributed_sweep

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # the sweep end to end


def test_sweep_runs_server_path_and_its_gloo_baseline():
    paths = ["reduce_broadcast", "sync_server"]
    [row] = distributed_sweep.sweep([900], 0.0, log=lambda _: None, paths=paths, min_steps=3)
    assert row["params"] == 900 and row["steps"] == 3
    assert row["reduce_broadcast"] > 0 and row["sync_server"] > 0
    # every rank's process CPU over its window, per update: at least one thread always runs
    assert set(row["cpu_ms"]) == set(paths) and all(v > 0 for v in row["cpu_ms"].values())
    assert set(row["ratios"]) == {"sync_server/reduce_broadcast"}
    assert "straggler_delay_s" not in row


def test_sweep_runs_the_ceilings_of_one_server_and_async_easgd():
    paths = ["sync_server", "sync_ceiling", "async_easgd", "easgd_ceiling"]
    [row] = distributed_sweep.sweep([900], 0.0, log=lambda _: None, paths=paths, min_steps=3)
    assert all(row[p] > 0 for p in paths)
    assert set(row["ratios"]) == {"sync_server/ceiling", "easgd/ceiling"}


def test_a_worker_that_saw_no_update_after_warm_up_passes_the_figure_on(monkeypatch):
    """TF hands tokens to whoever asks first, so rank 0 can miss every counted update: the
    next rank's rate is reported, not 0; if no rank saw one, the sweep says so."""
    outs = iter([[None, (5.0, 0.5), (6.0, 1.5), None], [None, None, None, None]])
    monkeypatch.setattr(distributed_sweep, "run_ranks", lambda *a, **k: next(outs))
    [row] = distributed_sweep.sweep([900], 0.0, log=lambda _: None, paths=["sync_sharded"])
    assert row["sync_sharded"] == 5.0
    # CPU per update: the cores the ranks with a window kept busy (2.0) over the rate (5/s)
    assert row["cpu_ms"]["sync_sharded"] == pytest.approx(400.0)
    with pytest.raises(RuntimeError, match="sync_sharded at 9e"):
        distributed_sweep.sweep([900], 0.0, log=lambda _: None, paths=["sync_sharded"])
