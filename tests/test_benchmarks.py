"""The speed benchmark runs end to end (tiny model, one rep) and writes what the README says:
a JSON result with every measured column, a printed table and a PNG.  Speed itself is
measured by running the benchmark, never asserted here."""

from __future__ import annotations

import json

from benchmarks import optimizer_speed


def test_optimizer_speed_benchmark_writes_json_table_and_plot(tmp_path, capsys, monkeypatch):
    # main() picks a fresh inductor cache unless one is set; keep that choice to this test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    optimizer_speed.main(
        [
            "--out",
            str(tmp_path),
            "--warmup",
            "1",
            "--reps",
            "2",
            "--only",
            "AdamOptimizer",
            "NormalizedSGD",
            "--width",
            "16",
            "--layers",
            "1",
            "--vocab",
            "64",
        ]
    )
    result = json.loads((tmp_path / "optimizer_speed.json").read_text())
    assert (tmp_path / "optimizer_speed.png").stat().st_size > 0
    assert "AdamOptimizer" in capsys.readouterr().out
    rows = {(r["optimizer"], r["path"]): r for r in result["rows"]}
    assert set(rows) == {
        (name, path)
        for name in ("AdamOptimizer", "NormalizedSGD")
        for path in ("loop", "foreach", "fused")
    }
    for row in rows.values():
        for key in (
            "median_s",
            "gbps",
            "time_vs_torch_fused_adam",
            "bw_vs_torch_fused_adam",
            "peak_extra_mib",
        ):
            assert row[key] >= 0, key
        assert (row.get("compile_s") is not None) == (row["path"] == "fused")
    assert rows["AdamOptimizer", "fused"]["torch_equivalent"].startswith("Adam")
    assert result["inductor_startup_s"] > 0
    assert "norm then update (NormalizedSGD's work)" in result["ceilings"]
    # 3 passes for slot-free optimizers, 3 + 2 per slot otherwise (Adam: m and v)
    adam, nsgd = rows["AdamOptimizer", "loop"]["bytes"], rows["NormalizedSGD", "loop"]["bytes"]
    assert 3 * adam == 7 * nsgd
