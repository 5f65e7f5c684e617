"""curve/speed arithmetic and the curve plot."""

from __future__ import annotations

import pytest

from rollkv_dist.gates import curve, speed

MiB = 1024 * 1024


def test_limit_tps_adds_tail_time():
    # resident 500 t/s = 2 ms/token; 510 MiB of tail at 51 GB/s adds ~10.5 ms
    t = curve.limit_tps(500.0, 510.0)
    assert t == pytest.approx(1 / (0.002 + 510 * MiB / 51e9))
    assert curve.limit_tps(500.0, 0.0) == pytest.approx(500.0)


def test_tail_read_counts_only_used_cells_at_the_exact_cell_size():
    # qwen2-1.5b shape, f16: 28 layers x (K + V) x 256 x 2 B = 28672 B per cell. The window line's MiB are
    # rounded up to 2 MiB granules per tensor (448 MiB of host tail for 12544 cells = 343 MiB of KV).
    per_cell = 28672 / MiB
    w = {"kv_size": 16640, "cells_resident": 4096, "device_mib": 112.0, "host_tail_mib": 448.0}
    assert curve.tail_read_mib(w, 16384, 64, per_cell) == pytest.approx((16384 + 32 - 4096) * per_cell)
    assert curve.tail_read_mib(w, 16384, 64, per_cell) < 0.8 * w["host_tail_mib"]
    assert curve.tail_read_mib(w, 0, 64, per_cell) == 0.0  # depth 0: decode never reaches the tail


def test_tail_bandwidth():
    # window 2 ms slower per token while reading 102 MiB of tail -> ~53.5 GB/s
    bw = speed.tail_bandwidth_gbps(102.0, 1 / 0.012, 1 / 0.010)
    assert bw == pytest.approx(102 * MiB / 0.002 / 1e9)
    assert speed.tail_bandwidth_gbps(0.0, 100, 200) is None
    assert speed.tail_bandwidth_gbps(10.0, 300, 200) is None  # faster than resident: no estimate


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    res = {"depth": 16384, "n_gen": 64, "n_prompt": 512, "resident": {"decode_tps": 400.0, "prefill_tps": 15000.0},
           "nkvo": {"decode_tps": 14.0, "prefill_tps": 5200.0},
           "points": [{"host_tail_mib": x, "decode_tps": 400 - x, "prefill_tps": 15000 - 10 * x,
                       "limit_decode_tps": curve.limit_tps(400, x)} for x in (0.0, 50.0, 100.0, 200.0)]}
    out = curve.plot(res, tmp_path / "c.png")
    data = (tmp_path / "c.png").read_bytes()
    assert out and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000


def test_speed_table():
    rows = [{"depth": 16384, "resident": {"decode_tps": 402.0, "prefill_tps": 15717.0},
             "window": {"decode_tps": 300.0, "prefill_tps": 9000.0, "tail_fraction": 0.75},
             "nkvo": {"decode_tps": 14.0, "prefill_tps": 5205.0}, "decode_ratio_window_over_nkvo": 21.43,
             "tail_read_mib_per_token": 300.0, "effective_tail_gbps": 49.9}]
    t = speed.table(rows)
    assert "| 16384 | 402.0 | 300.0 | 14.0 | 21.43 | 75 | 300.0 | 49.9 |" in t
