"""Tail physics shared by curve and speed (tail.py), the curve plot and the curve gate's staging checks."""

from __future__ import annotations

import pytest

from rollkv_dist.gates import curve, logparse, tail

from test_gates import report_results

MiB = 1024 * 1024


def test_limit_tps_adds_tail_time():
    # resident 500 t/s = 2 ms/token; 510 MiB of tail at 51 GB/s adds ~10.5 ms
    t = tail.limit_tps(500.0, 510.0, 51.0)
    assert t == pytest.approx(1 / (0.002 + 510 * MiB / 51e9))
    assert tail.limit_tps(500.0, 0.0, 51.0) == pytest.approx(500.0)


def test_tail_read_counts_only_used_cells_at_the_exact_cell_size():
    # qwen2-1.5b shape, f16: 28 layers x (K + V) x 256 x 2 B = 28672 B per cell. The window line's MiB are
    # rounded up to 2 MiB granules per tensor (448 MiB of host tail for 12544 cells = 343 MiB of KV).
    per_cell = 28672 / MiB
    w = logparse.Window(fully_resident=False, kv_size=16640, cells_resident=4096, device_mib=112.0,
                        host_tail_mib=448.0)
    assert tail.tail_read_mib(w, 16384, 64, per_cell) == pytest.approx((16384 + 32 - 4096) * per_cell)
    assert tail.tail_read_mib(w, 16384, 64, per_cell) < 0.8 * w.host_tail_mib
    assert tail.tail_read_mib(w, 0, 64, per_cell) == 0.0  # depth 0: decode never reaches the tail


def test_tail_bandwidth():
    # window 2 ms slower per token while reading 102 MiB of tail -> ~53.5 GB/s
    bw = tail.tail_bandwidth_gbps(102.0, 1 / 0.012, 1 / 0.010)
    assert bw == pytest.approx(102 * MiB / 0.002 / 1e9)
    assert tail.tail_bandwidth_gbps(0.0, 100, 200) is None
    assert tail.tail_bandwidth_gbps(10.0, 300, 200) is None  # faster than resident: no estimate


def test_link_rate_comes_from_zero_copy_only_then_the_labelled_fallback():
    link = tail.link_rate([("d16384", 51.6), ("d65536", 50.0), ("x", None)])
    assert link.measured and link.gbps == pytest.approx(50.8) and "-kts off" in link.source
    assert "d16384: 51.6" in link.source and link.samples == [51.6, 50.0]
    # without a zero-copy decode: the nominal rate of the GPU's PCIe link as NVML reports it (an idle
    # link shows a lower current generation: the maximum counts), labelled; nothing to go by: UNKNOWN.
    # An auto decode is no source: it stages f16 decode where the cache prefetches, and its copies
    # overlap the compute (on the H200 its "effective" rate came out at 71.5 GB/s over a 50.5 GB/s link)
    from test_gates import fake_gpu

    link = tail.link_rate([("d16384", None)], fake_gpu())
    assert not link.measured and link.gbps == 63.0 and link.source.startswith("ASSUMED 63 GB/s")
    assert "gen5 x16" in link.source and "-kts off" in link.source
    link = tail.link_rate([], None)
    assert link.gbps is None and link.source.startswith("UNKNOWN") and tail.limit_tps(400.0, 10.0, None) is None


def test_overlap_bound_is_the_larger_of_compute_and_link_time():
    # 224.9 MiB of tail per token at 50.5 GB/s = 4.67 ms against 1/433.9 t/s = 2.30 ms of compute
    assert tail.overlap_tps(433.9, 224.9, 50.5) == pytest.approx(50.5e9 / (224.9 * MiB))
    assert tail.limit_tps(433.9, 224.9, 50.5) == pytest.approx(1 / (1 / 433.9 + 224.9 * MiB / 50.5e9))
    # a small tail: the compute is the bound, and it is resident's t/s
    assert tail.overlap_tps(433.9, 10.0, 50.5) == pytest.approx(433.9)
    assert tail.overlap_tps(433.9, 10.0, None) is None


def test_kts_args_put_auto_first():
    # llama-bench fills the depth in the first test's context and restores it in the later ones
    assert tail.kts_args(["off", "auto"]) == ["-kts", "auto,off"]
    assert tail.kts_args(["auto"]) == ["-kts", "auto"]
    assert tail.parse_stagings("off,auto") == ["off", "auto"]
    assert tail.parse_stagings("off") == ["off"]  # the before curve alone
    from rollkv_dist.errors import UsageError

    for bad in ("on,auto", "", "auto,auto"):
        with pytest.raises(UsageError):
            tail.parse_stagings(bad)


def test_by_staging_pairs_each_row_with_its_own_context_window():
    # -kts auto,off: contexts pp-auto, tg-auto, pp-off, tg-off; staging adds its copy to the compute
    # reserve, so the off contexts keep a granule more of cells on the device
    lines = [f"llama_kv_cache: position window = {c} / {n} cells resident (device 1.00 MiB, host tail 2.00 MiB)"
             for c, n in ((8192, 16896), (8192, 16640), (12288, 16896), (12288, 16640))]
    rows = [logparse.BenchRow(512, 0, 16384, 9000.0, 0, 0, kv_tail_staging="auto"),
            logparse.BenchRow(0, 64, 16384, 140.0, 0, 0, kv_tail_staging="auto"),
            logparse.BenchRow(512, 0, 16384, 1500.0, 0, 0, kv_tail_staging="off"),
            logparse.BenchRow(0, 64, 16384, 200.0, 0, 0, kv_tail_staging="off")]
    per_cell = 28672 / MiB
    m = tail.by_staging(rows, logparse.parse_log("\n".join(lines)), 16384, 512, 64, per_cell, 400.0)
    assert m["auto"].window.cells_resident == 8192 and m["off"].window.cells_resident == 12288
    assert m["auto"].prefill_window.kv_size == 16896 and m["off"].decode_tps == 200.0
    assert m["off"].tail_fraction == round(4352 / 16640, 4)
    # the prefill's tail: of the 16896 cells it uses (its own context here, so the same as the window's)
    assert m["off"].prefill_tail_fraction == round((16896 - 12288) / 16896, 4)
    read = (16384 + 32 - 12288) * per_cell
    assert m["off"].tail_read_mib_per_token == round(read, 2)
    assert m["off"].effective_tail_gbps == pytest.approx(tail.tail_bandwidth_gbps(read, 200.0, 400.0), abs=0.01)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    pts = [{"vram_target": 3000 - int(x), "host_tail_mib": x, "prefill_host_tail_mib": x + 10, "decode_tps": 400 - x,
            "prefill_tps": 15000 - 10 * x, "limit_decode_tps": tail.limit_tps(400, x, 51.0),
            "off": {"host_tail_mib": x, "prefill_host_tail_mib": x, "decode_tps": 400 - x,
                    "prefill_tps": 15000 - 50 * x}} for x in (0.0, 50.0, 100.0, 200.0)]
    res = {"depth": 16384, "n_gen": 64, "n_prompt": 512, "n_ubatch": None,
           "resident": {"decode_tps": 400.0, "prefill_tps": 15000.0}, "nkvo": {"decode_tps": 14.0, "prefill_tps": 5200.0},
           "link": {"gbps": 51.0, "measured": True}, "thresholds": {"prefill_vs_resident": 0.7}, "points": pts}
    out = curve.plot(res, tmp_path / "c.png")
    data = (tmp_path / "c.png").read_bytes()
    assert out and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000


def curve_run(tmp_path, **opts):
    from test_gates import _prompt_model, ctx_for, run_one

    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), **{"reps": 1, **opts})
    return ctx, run_one("curve", ctx)


def test_curve_reads_the_median_of_the_repetitions(tmp_path, monkeypatch):
    """A fast resident prefill repetition (x4) would pull the mean up and push windowed points under
    the 70 % goal; the gate reads the median of each row's repetitions."""
    from rollkv_dist.gates import logparse, report

    monkeypatch.setenv("FAKE_BENCH_OUTLIER", "4")
    ctx, res = curve_run(tmp_path, reps=3, curve_staging="auto", curve_nkvo=False, curve_fractions="0.75,0.6,0.5,0.4")
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    rows = logparse.parse_bench_json((ctx.work / "resident.out").read_text())
    [pp] = [r for r in rows if r.kind == "pp"]
    resident = report_results(res)["resident"]
    assert resident["prefill_tps"] == sorted(pp.samples_ts)[1] and pp.avg_ts > 1.3 * resident["prefill_tps"]
    checked = [p for p in report_results(res)["points"] if (p.get("prefill_host_tail_mib") or 0) > 0
               and p["prefill_tail_fraction"] <= 0.65]
    assert checked and any(p["prefill_tps"] / pp.avg_ts < 0.7 for p in checked)  # a mean would have failed them
    for p in report_results(res)["points"]:
        for key in ("decode", "prefill"):
            assert len(p[f"{key}_samples_ts"]) == 3 and p[f"{key}_tps"] == sorted(p[f"{key}_samples_ts"])[1]
    md = report.markdown(report.gate_report(res, build=ctx.build, baseline=None, probe=None, build_info=None,
                                            baseline_info=None))
    assert tail.TPS_STATISTIC in md and report_results(res)["tps_statistic"] == tail.TPS_STATISTIC


def test_median_ts_of_a_bench_row():
    row = logparse.BenchRow(512, 0, 16384, 14000.0, 2900.0, 0, samples_ts=[17687.0, 12070.0, 12250.0])
    assert row.median_ts == 12250.0
    assert logparse.BenchRow(512, 0, 0, 14000.0, 0, 0, samples_ts=[1.0, 3.0]).median_ts == 2.0
    assert logparse.BenchRow(512, 0, 0, 14000.0, 0, 0).median_ts == 14000.0  # no samples: avg_ts


def test_curve_fails_the_prefill_goal_when_staging_is_ineffective(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_STAGING_INEFFECTIVE", "1")
    ctx, res = curve_run(tmp_path)
    failed = [c for c in res.checks if not c.ok]
    assert [c.name for c in failed] == [
        "prefill (auto) >= 70% of resident at every windowed point with a prefill tail <= 65%"]
    pts = [p for p in report_results(res)["points"] if (p.get("prefill_host_tail_mib") or 0) > 0]
    # auto measured what off measured: the before and after prefill agree at every windowed point
    for p in pts:
        if p["off"]["prefill_window"] == p["prefill_window"]:
            assert p["prefill_tps"] == pytest.approx(p["off"]["prefill_tps"], rel=0.01)
    low = [p for p in pts if p["prefill_tail_fraction"] <= 0.65 and p["prefill_over_resident"] < 0.7]
    assert low and all(f"vt{p['vram_target']}:" in failed[0].detail for p in low)


def test_curve_decode_below_the_link_line_fails(tmp_path, monkeypatch):
    # the engine before the prefetch, staging f16 decode anyway: each token pays the copy after the
    # compute, and the copy costs more than the zero-copy read it replaces
    monkeypatch.setenv("FAKE_NO_PREFETCH", "1")
    monkeypatch.setenv("FAKE_AUTO_STAGES_F16_DECODE", "1")
    ctx, res = curve_run(tmp_path)
    assert [c.name for c in res.checks if not c.ok] == [
        "decode (auto) >= 90% of the link-rate line at every windowed point"]
    # the line's link rate is still the zero-copy (off) one
    assert "-kts off" in report_results(res)["link"]["source"]
    assert report_results(res)["link"]["gbps"] == pytest.approx(51.0, rel=0.01)


def test_curve_headline_options_auto_only_large_ubatch(tmp_path):
    pytest.importorskip("matplotlib")
    ctx, res = curve_run(tmp_path, curve_staging="auto", curve_ubatch=4096, curve_nkvo=False,
                         curve_fractions="0.75,0.5,0.3,0.2")
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    benches = [c for c in res.commands if "llama-bench" in c and "--help" not in c]
    assert all("-ub 4096 -b 4096" in c for c in benches)
    points, probe = benches[:6], benches[6:]
    assert all("-p 4096 -n 64" in c for c in points)
    assert not any("-nkvo" in c or "-kts auto,off" in c or "-kts off" in c for c in points)
    assert len(points) == 2 + 4  # resident, the -vt 1 probe, one run per fraction
    # then the link probe: off's own -vt 1 probe and one decode-only zero-copy run
    assert len(probe) == 2 and all("-p 0 -n 64" in c and "-kts off" in c and "auto" not in c for c in probe)
    assert "-vt 1" in probe[0] and "-vt 1 " not in probe[1]
    r = report_results(res)
    assert r["n_prompt"] == r["n_ubatch"] == 4096 and r["nkvo"] is None and r["stagings"] == ["auto"]
    assert all(p["off"] is None for p in r["points"])
    # auto stages f16 decode and overlaps it, so its points measure no link rate: the probe's off
    # decode does, and no nominal rate is assumed
    assert r["link"]["measured"] and "link probe" in r["link"]["source"]
    assert r["link"]["gbps"] == pytest.approx(51.0, rel=0.02)
    assert not any("ASSUMED" in n for n in res.notes)
    # 0.75 of the prefill context's KV holds every cell of the decode context: the probe takes the point
    # with the smallest decode tail of at least a quarter of its cells
    by_f = {p["fraction"]: p for p in r["points"]}
    assert by_f[0.75]["tail_read_mib_per_token"] == 0 < by_f[0.5]["tail_read_mib_per_token"]
    used_mib = r["resident"]["kv_mib_per_cell"] * (16384 + 64)
    want = max(f for f, p in by_f.items() if p["tail_read_mib_per_token"] / used_mib >= curve.PROBE_TAIL_MIN)
    assert r["link_probe"]["fraction"] == want
    assert r["link_probe"]["tail_read_mib_per_token"] / used_mib >= curve.PROBE_TAIL_MIN
    assert all(p["prefill_window"]["kv_size"] == 16384 + 4096 for p in r["points"])


def test_by_staging_reads_a_cache_on_two_gpus_as_one_window():
    # one context per test, each cache on two devices: a line per device (" on CUDAn"), combined per cache
    lines = [f"llama_kv_cache: position window = {c} / {n} cells resident (device 1.00 MiB, host tail 2.00 MiB) "
             f"on CUDA{dev}" for c, n in ((8192, 16896), (8192, 16640), (12288, 16896), (12288, 16640))
             for dev, c in ((0, c), (1, c - 1024))]
    rows = [logparse.BenchRow(512, 0, 16384, 9000.0, 0, 0, kv_tail_staging="auto"),
            logparse.BenchRow(0, 64, 16384, 140.0, 0, 0, kv_tail_staging="auto"),
            logparse.BenchRow(512, 0, 16384, 1500.0, 0, 0, kv_tail_staging="off"),
            logparse.BenchRow(0, 64, 16384, 200.0, 0, 0, kv_tail_staging="off")]
    m = tail.by_staging(rows, logparse.parse_log("\n".join(lines)), 16384, 512, 64, 28672 / MiB, 400.0)
    assert m["auto"].window.cells_resident == 8192 and m["off"].window.cells_resident == 12288
    assert m["auto"].window.device == "CUDA0+CUDA1" and m["auto"].host_tail_mib == 4.0
    assert m["off"].prefill_window.kv_size == 16896 and m["off"].window.kv_size == 16640


def test_by_staging_refuses_rows_without_their_staging():
    from rollkv_dist.errors import LogParseError
    rows = [logparse.BenchRow(512, 0, 16384, 9000.0, 0, 0, kv_tail_staging="auto"),
            logparse.BenchRow(512, 0, 16384, 1500.0, 0, 0)]  # a llama-bench that took -kts but does not say
    with pytest.raises(LogParseError, match="pp512 @ d16384 .*no kv_tail_staging"):
        tail.by_staging(rows, logparse.parse_log("", source="w.err"), 16384, 512, 64, 28672 / MiB, 400.0)


def test_the_fixed_part_is_only_ever_the_engines_own(tmp_path):
    """Before: without the probe's 'no device memory left' line the gates took the resident run's
    model and compute buffers + 512 (the engine's safety and margin, copied). Now the fixed part comes
    from the engine's lines or the gate stops with an error naming them."""
    from rollkv_dist.errors import LogParseError
    from rollkv_dist.gates import logparse, sizing

    resident_only = logparse.parse_log("load_tensors:        CUDA0 model buffer size =  1564.00 MiB\n"
                                       "sched_reserve:      CUDA0 compute buffer size =   300.00 MiB\n", source="r.err")
    assert sizing.fixed_parts(resident_only) == {}
    with pytest.raises(LogParseError, match="r.err: the engine logged no fixed part for CUDA0"):
        sizing.require_fixed(resident_only, ["CUDA0"])
    # a -vt 1 probe on two GPUs: CUDA0's budget line and error, CUDA1 from its model buffer, its pass 2
    # reserve and the one margin (the engine stops at the first device it cannot size)
    probe = logparse.parse_log("\n".join([
        "load_tensors:        CUDA0 model buffer size =   782.00 MiB",
        "load_tensors:        CUDA1 model buffer size =   790.50 MiB",
        "llama_context: kv compute reserve: pass 1 measured CUDA0 compute buffer = 300.00 MiB (12.5 ms)",
        "llama_context: kv compute reserve: pass 2 sizes the window with reserve = 556.00 MiB (measured 300.00 + "
        "safety 256)",
        "llama_context: kv compute reserve: pass 1 measured CUDA1 compute buffer = 310.00 MiB (12.5 ms)",
        "llama_context: kv compute reserve: pass 2 sizes the window with reserve = 566.00 MiB (measured 310.00 + "
        "safety 256)",
        "llama_kv_residency_alloc: CUDA0: free 138218 MiB, vram target 1 MiB, model 782 MiB, other KV 0 MiB, compute "
        "reserve 556 MiB, margin 256 MiB -> window budget -1593 MiB",
        "llama_init_from_model: failed to initialize the context: window mode: no device memory left for the KV "
        "window on CUDA0 (free 138218 MiB, vram target 1 MiB, model 782 MiB, compute reserve 556 MiB, margin 256 MiB): "
        "raise --vram-target, free device memory or offload fewer layers"]), source="p.err")
    f = sizing.require_fixed(probe, ["CUDA0", "CUDA1"])
    assert (f["CUDA0"].mib, f["CUDA0"].source) == (782 + 556 + 256, "budget line")
    assert (f["CUDA1"].model, f["CUDA1"].compute_reserve, f["CUDA1"].margin) == (790.5, 566.0, 256)
    assert sizing.targets(f, [sizing.DeviceKV("CUDA0", 300.0, 28), sizing.DeviceKV("CUDA1", 100.0, 28)], 200.0) == [
        int(782 + 556 + 256 + 150 + 56), int(790.5 + 566 + 256 + 50 + 56)]
    assert sizing.target_arg([1650, 1718]) == "1650,1718"


def test_used_tail_fraction_counts_the_cells_a_test_uses():
    big = logparse.Window(False, kv_size=524288, cells_resident=8192, device_mib=1.0, host_tail_mib=2.0)
    assert big.tail_fraction == pytest.approx(1 - 8192 / 524288)  # of the whole context: 98 %
    assert tail.used_tail_fraction(big, 16384 + 512) == pytest.approx((16896 - 8192) / 16896)  # what prefill reads
    assert tail.used_tail_fraction(big, 4096) == 0.0  # all in the window
    own = logparse.Window(False, kv_size=16896, cells_resident=8192, device_mib=1.0, host_tail_mib=2.0)
    assert tail.used_tail_fraction(own, 16896) == pytest.approx(own.tail_fraction)  # the test's own context


def test_curve_at_a_users_context(tmp_path):
    """--curve-ctx N: every llama-bench run gets -c N (the seed's 524288), the points are fractions of
    the KV of the cells the tests use (not of the N-cell KV, which would leave every used cell in the
    window), and the prefill tail is that of the used cells."""
    pytest.importorskip("matplotlib")
    ctx, res = curve_run(tmp_path, curve_ctx=524288, curve_staging="auto", curve_nkvo=False,
                         curve_fractions="0.75,0.5,0.3,0.2")
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    benches = [c for c in res.commands if "llama-bench" in c and "--help" not in c]
    assert benches and all(" -c 524288" in c for c in benches)
    r = report_results(res)
    assert r["n_ctx"] == 524288
    for p in r["points"]:
        w = p["prefill_window"]
        assert w["kv_size"] == 524288 and w["cells_resident"] < 16384 + 512
        assert p["prefill_tail_fraction"] == pytest.approx((16896 - w["cells_resident"]) / 16896, abs=1e-4)
    # C = fraction x the used cells, rounded up to whole VMM granules (4096 cells in the fake): every point
    # has a tail among the used cells, the last (0.2) about 80 %; fractions of the whole KV would give none
    fr = [p["prefill_tail_fraction"] for p in sorted(r["points"], key=lambda p: -p["vram_target"])]
    assert fr == sorted(fr) and len(set(fr)) == 4 and fr[0] > 0 and fr[-1] == pytest.approx(0.76, abs=0.01)


def test_curve_before_alone_is_sized_for_offs_own_reserve(tmp_path):
    """--curve-staging off: a before curve at the tails auto's run has. At -c 524288 auto's compute
    reserve holds two layers' staged copies, so at auto's targets off keeps every used cell on the
    device; off alone probes its own reserve, its targets leave it the same tails, its points give the
    link rate, and auto's staging goals are not checked on it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    opts = {"curve_ctx": 524288, "curve_nkvo": False, "curve_fractions": "0.75,0.5,0.3,0.2"}
    _, after = curve_run(tmp_path / "a", curve_staging="auto", **opts)
    _, both = curve_run(tmp_path / "a", curve_staging="off,auto", **opts)
    _, before = curve_run(tmp_path / "b", curve_staging="off", **opts)
    assert before.verdict == "pass", [c for c in before.checks if not c.ok]
    windowed = [c for c in before.commands if "-krm window" in c]
    assert len(windowed) == 5 and all("-kts off" in c and "auto" not in c for c in windowed)  # probe + 4 points
    assert report_results(before)["fixed_mib"] < report_results(after)["fixed_mib"]
    pts_a, pts_b, pts_ab = (sorted(report_results(r)["points"], key=lambda p: -p["vram_target"]) for r in (after, before, both))
    fr_a = [p["prefill_tail_fraction"] for p in pts_a]
    assert [p["prefill_tail_fraction"] for p in pts_b] == pytest.approx(fr_a, abs=0.01) and min(fr_a) > 0
    # side by side at auto's targets, off's windows hold every used cell: no before at those tails
    assert all(p["off"]["prefill_tail_fraction"] == 0 for p in pts_ab)
    assert all(p["off"] is None and p["decode_tps"] for p in pts_b)
    link = report_results(before)["link"]
    assert link["measured"] and "-kts off" in link["source"] and link["gbps"] == pytest.approx(51.0, rel=0.02)
    assert not any("(auto)" in c.name for c in before.checks) and any("(auto)" in c.name for c in after.checks)
    assert any(n.startswith("before curve") for n in before.notes)
    md = "\n".join(curve.markdown(report_results(before)))
    assert "| decode before | decode before |" in md and "the before curve alone" in md


def test_curve_auto_alone_probes_the_link_with_offs_own_reserve(tmp_path):
    """--curve-staging auto at -c 524288 (the seed's configuration): at auto's targets an off context
    keeps every used cell on the device (no staged copies in its reserve), so a probe at auto's target
    would read no tail; the probe sizes its target from off's own -vt 1 probe and measures the link."""
    pytest.importorskip("matplotlib")
    ctx, res = curve_run(tmp_path, curve_ctx=524288, curve_staging="auto", curve_nkvo=False,
                         curve_fractions="0.75,0.5,0.3,0.2")
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    r = report_results(res)
    # the point with the smallest decode tail of at least a quarter of its cells (0.75's is 3 %: its time
    # over resident would be lost in the noise)
    used_mib = r["resident"]["kv_mib_per_cell"] * (16384 + 64)
    tails = {p["fraction"]: p["tail_read_mib_per_token"] / used_mib for p in r["points"]}
    assert 0 < tails[0.75] < curve.PROBE_TAIL_MIN <= tails[0.5]
    probe, auto_pt = r["link_probe"], next(p for p in r["points"] if p["fraction"] == 0.5)
    assert probe["fraction"] == 0.5
    assert probe["fixed_mib"] < r["fixed_mib"] and probe["vram_target"] < auto_pt["vram_target"]
    # off's window at its own target is auto's at 0.5 (whole granules): the same tail, read zero-copy
    assert probe["window"]["cells_resident"] == auto_pt["window"]["cells_resident"]
    assert probe["tail_read_mib_per_token"] > 0
    assert probe["tail_read_mib_per_token"] == pytest.approx(auto_pt["tail_read_mib_per_token"], rel=0.01)
    assert r["link"]["measured"] and r["link"]["gbps"] == pytest.approx(51.0, rel=0.02)
    assert any(c.name == "link probe (decode only, -kts off) runs" and c.ok for c in res.checks)
    assert all(" -c 524288" in c for c in res.commands if "llama-bench" in c and "--help" not in c)


@pytest.mark.parametrize("case", ["fails", "no-tail"])
def test_a_curve_link_probe_without_a_rate_leaves_the_nominal_rate_labelled(tmp_path, monkeypatch, case):
    """A probe run that fails fails its check; one whose window holds every cell it reads passes it
    and says it measured nothing. Either way the nominal rate stands in, labelled ASSUMED."""
    pytest.importorskip("matplotlib")
    real = curve.run_bench

    def run_bench(ctx_, res_, label, model, args, *a, **kw):
        if label.startswith("link-probe-vt") and label != "link-probe-vt1-probe":
            i = args.index("-vt")
            args = ([*args[:args.index("-krm")], "-krm", "resident"] if case == "fails" else
                    [*args[:i + 1], "100000", *args[i + 2:]])
        return real(ctx_, res_, label, model, args, *a, **kw)

    monkeypatch.setattr(curve, "run_bench", run_bench)
    ctx, res = curve_run(tmp_path, curve_staging="auto", curve_nkvo=False, curve_fractions="0.75,0.5,0.3,0.2")
    probe_check = next(c for c in res.checks if c.name == "link probe (decode only, -kts off) runs")
    assert probe_check.ok == (case == "no-tail")
    assert report_results(res)["link"]["source"].startswith("ASSUMED") and not report_results(res)["link"]["measured"]
    assert any(n.startswith("link rate: ASSUMED") for n in res.notes)
    if case == "no-tail":
        assert any("no tail among its cells" in n for n in res.notes)
        assert report_results(res)["link_probe"]["tail_read_mib_per_token"] == 0


def test_curve_ctx_smaller_than_the_tests_is_refused(tmp_path):
    from rollkv_dist.errors import UsageError

    with pytest.raises(UsageError, match="--curve-ctx 8192: the tests use depth \\+ prompt = 16896 cells"):
        curve_run(tmp_path, curve_ctx=8192)
