"""The speed benchmark runs end to end (tiny model, one rep) and writes what docs/speed.md says:
a JSON result with every measured column, a printed table and a PNG.  Speed itself is
measured by running the benchmark, never asserted here."""

from __future__ import annotations

import json
import math

import pytest
import torch
from benchmarks.optimizers import optimizer_speed, speed_setup

pytestmark = pytest.mark.slow  # the speed benchmark end to end: about 50 s on 2 cores


@pytest.mark.compile
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


def test_speed_presets_have_the_shapes_they_promise():
    def sizes(shapes):
        return [math.prod(s) for s in shapes]

    big = sizes(speed_setup.preset_shapes("transformer-134m"))
    assert len(big) == 81 and 133e6 < sum(big) < 135e6  # issue 12's GPU parameter set
    small = sizes(speed_setup.preset_shapes("small-tensors"))
    assert sum(n <= 4096 for n in small) * 3 >= len(small)  # a third or more are small
    assert sizes(speed_setup.preset_shapes("default")) == sizes(
        optimizer_speed.parameter_shapes(512, 4, 8192)
    )
    scaled = sum(sizes(speed_setup.preset_shapes("small-tensors", params=20_000_000)))
    assert abs(scaled - 20e6) < 0.05 * 20e6


def test_speed_benchmark_device_errors_name_the_argument(capsys):
    bad = ["tpu", "cuda:99"] if torch.cuda.is_available() else ["tpu", "cuda"]
    for device in bad:
        with pytest.raises(SystemExit):
            optimizer_speed.main(["--device", device, "--only", "AdamOptimizer"])
        assert f"--device '{device}'" in capsys.readouterr().err
