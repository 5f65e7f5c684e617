"""resident-ab: the series build in resident mode against an unpatched upstream build (fake binaries)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollkv_dist.gates import context, resident_ab
from rollkv_dist.gates.runner import run_gate

from test_gates import report_results, FAKE, _prompt_model, fake_gpu

UPSTREAM = FAKE.parent / "fake_llama_upstream"


def ab_ctx(tmp_path: Path, upstream: Path | None = UPSTREAM, **opts) -> context.GateContext:
    opts = {"model": str(_prompt_model(tmp_path)), "ab_depths": "0,16384", "reps": 3, **opts}
    return context.GateContext(build=FAKE, work=tmp_path / "work", gpu=fake_gpu(), upstream_build=upstream,
                              options=opts, env=dict(os.environ))


def test_same_speed_passes_and_rounds_alternate(tmp_path):
    res = run_gate("resident-ab", ab_ctx(tmp_path, ab_rounds=2))
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    assert {(r["test"], r["depth"]) for r in report_results(res)["rows"]} == {("pp", 0), ("tg", 0), ("pp", 16384),
                                                                      ("tg", 16384)}
    for r in report_results(res)["rows"]:  # 2 rounds x 3 repetitions pooled per build
        assert r["series"]["n"] == r["upstream"]["n"] == 6 and abs(r["diff_pct"]) < 0.01
    benches = [c for c in res.commands if "llama-bench" in c]
    assert len(benches) == 4
    assert "fake_llama/bin" in benches[0] and "fake_llama_upstream" in benches[1]  # round 0: series first
    assert "fake_llama_upstream" in benches[2] and "fake_llama/bin" in benches[3]  # round 1: upstream first
    assert all("-krm" not in c and "-vt" not in c and "-d 0,16384" in c for c in benches)


def test_slower_series_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_BENCH_SLOWDOWN", "1.05")  # the upstream fake ignores it
    res = run_gate("resident-ab", ab_ctx(tmp_path, ab_rounds=1))
    assert res.verdict == "fail"
    failed = sorted(c.name for c in res.checks if not c.ok)
    assert failed == sorted(f"{k} @ d{d}: series within noise of upstream" for d in (0, 16384) for k in ("pp", "tg"))
    assert all(r["diff_pct"] == pytest.approx(-100 * 0.05 / 1.05, abs=0.05) for r in report_results(res)["rows"])


def test_upstream_with_engine_flags_is_refused(tmp_path):
    res = run_gate("resident-ab", ab_ctx(tmp_path, upstream=FAKE))
    assert res.verdict == "fail"
    assert [c.name for c in res.checks if not c.ok] == ["upstream llama-bench has no rolling-KV flags "
                                                        "(an unpatched build)"]
    assert not [c for c in res.commands if "-o json" in c]  # refused before any bench ran


def test_upstream_build_info_with_patches_is_refused(tmp_path):
    up = tmp_path / "up"
    (up / "bin").mkdir(parents=True)
    (up / "bin" / "llama-bench").symlink_to(UPSTREAM / "bin" / "llama-bench")
    (up / "share" / "rollkv").mkdir(parents=True)
    (up / "share" / "rollkv" / "build-info.json").write_text('{"series": ["0001-rolling-kv-params.patch"]}')
    res = run_gate("resident-ab", ab_ctx(tmp_path, upstream=up))
    assert res.verdict == "fail" and [c.name for c in res.checks if not c.ok] == ["upstream build applied no patch"]


def test_skips_without_an_upstream_build(tmp_path):
    res = run_gate("resident-ab", ab_ctx(tmp_path, upstream=None))
    assert res.verdict == "skip" and "--upstream-build" in res.notes[0]


def test_compare_noise_band():
    a, b = [100.0, 101.0, 99.0], [100.5, 101.5, 99.5]
    c = resident_ab.compare("tg", 0, a, b, tol_pct=2.0)
    assert c.diff_tps == pytest.approx(-0.5) and c.within_noise
    assert c.noise_band_tps == pytest.approx(2.01)  # 2 % of upstream beats 2 sigma here
    # noisy samples: the 2-sigma band decides, and a real 5 % gap with tight samples fails
    noisy = resident_ab.compare("tg", 0, [90.0, 110.0, 95.0, 105.0], [100.0] * 4, tol_pct=0.0)
    assert noisy.within_noise and noisy.noise_band_tps == pytest.approx(2 * (250 / 3 / 4) ** 0.5)
    assert not resident_ab.compare("tg", 0, [95.0, 95.1, 94.9], [100.0, 100.1, 99.9], tol_pct=2.0).within_noise


def test_markdown_table():
    t = resident_ab.table([resident_ab.compare("tg", 16384, [408.0, 409.0], [410.0, 409.0], 2.0)])
    assert "| tg | 16384 | 408.5 (2, 0.7) | 409.5 (2, 0.7) | -0.24 % |" in t and t.endswith("| yes |")
