"""logparse against recorded llama.cpp log samples (formats from the pinned tree and the
engine interface contract)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollkv_dist.gates import logparse as lp

LOGS = Path(__file__).parent / "data" / "logs"


def load(name: str) -> lp.LlamaLog:
    return lp.parse_log((LOGS / name).read_text())


def test_two_pass_window_boot():
    log = load("server_window_two_pass.log")
    w = log.window
    assert (w.cells_resident, w.kv_size, w.device_mib, w.host_tail_mib) == (349952, 524288, 65616.0, 32688.0)
    assert not w.fully_resident
    assert w.tail_fraction == pytest.approx((524288 - 349952) / 524288)  # cells, not rounded MiB
    r = log.reserve
    assert r.two_pass and not r.single_pass
    assert (r.pass1_device, r.pass1_measured_mib, r.pass1_ms) == ("CUDA0", 4984.0, 312.5)
    assert (r.pass2_reserve_mib, r.pass2_measured_mib, r.pass2_safety_mib, r.pass2_ms) == (5240.0, 4984.0, 256.0, 812.0)
    assert log.compute_mib("CUDA0") == 4984.0
    assert log.compute_buffers["CUDA_Host"] == 4256.0
    assert log.model_buffers == {"CPU_Mapped": 788.91, "CUDA0": 14179.0}
    assert log.kv_buffers == {"CUDA0": 98304.0}
    assert log.kv_caches == [(98304.0, 524288, 48)]
    assert (log.n_ctx, log.n_batch, log.n_ubatch) == (524288, 4096, 4096)
    assert log.offloaded_layers == (49, 49)
    assert not log.graph_reserve_failed and log.context_failed is None and not log.oom_lines
    assert log.prompt_eval == {"ms": 41.27, "n": 25, "ms_per_token": 1.65, "tokens_per_second": 605.77}
    assert log.eval["tokens_per_second"] == 64.97 and log.eval["n"] == 64


def test_baseline_graph_reserve_failure():
    log = load("server_baseline_graph_reserve_fail.log")
    assert log.graph_reserve_failed
    assert log.context_failed.startswith("failed to initialize the context") or "create context" in log.context_failed
    assert any("cudaMalloc failed" in ln for ln in log.oom_lines)
    assert not log.reserve.two_pass and log.reserve.fixed_mib is None
    assert log.compute_buffers == {}  # never reached the sched_reserve size lines
    assert log.window.host_tail_mib == 28608.0


def test_fully_resident_single_pass():
    log = load("server_window_fully_resident.log")
    w = log.window
    assert w.fully_resident and w.kv_size == 32768 and w.cells_resident == 32768 and w.host_tail_mib == 0.0
    assert w.tail_fraction == 0.0
    assert log.reserve.single_pass and not log.reserve.two_pass


def test_fixed_vs_measured_reserve():
    fixed = load("server_window_fixed_reserve.log")
    meas = load("server_window_measured_default_ubatch.log")
    assert fixed.reserve.fixed_mib == 1536.0 and not fixed.reserve.two_pass
    assert meas.reserve.pass2_reserve_mib == 879.0
    assert meas.window.cells_resident > fixed.window.cells_resident


def test_iswa_two_caches_with_ansi_and_prefix():
    log = load("gemma_iswa_prefixed.log")
    assert len(log.windows) == 2
    main = log.window  # the one with the tail, not the SWA cache
    assert (main.cells_resident, main.kv_size, main.host_tail_mib) == (16384, 65536, 144.0)
    assert log.windows[1].fully_resident and log.windows[1].kv_size == 1024
    assert log.kv_buffers == {"CUDA0": 207.0}  # summed over both caches
    assert log.n_ctx == 65536 and log.n_ubatch == 512
    assert log.compute_mib() == 397.27


def test_no_match_on_unrelated_text():
    log = lp.parse_log("hello\nllama_context: n_ctx_seq             = 4096\nposition window = garbage\n")
    assert log.window is None and log.n_ctx is None and log.compute_buffers == {}


def test_bench_json_array():
    rows = lp.parse_bench_json((LOGS / "bench_window_d16384.json").read_text())
    assert [r.test for r in rows] == ["pp512 @ d16384", "tg64 @ d16384"]
    assert rows[0].avg_ts == pytest.approx(15717.2) and rows[1].avg_ts == pytest.approx(380.5)
    assert rows[1].kind == "tg" and rows[0].kind == "pp"
    assert rows[0].kv_residency_mode == "window" and rows[0].vram_target == 20000
    assert rows[0].no_kv_offload is False and rows[0].type_k == "f16"


def test_bench_jsonl_and_verbose_window():
    rows = lp.parse_bench_json((LOGS / "bench_resident_nkvo.jsonl").read_text())
    assert len(rows) == 4 and [r.no_kv_offload for r in rows] == [False, False, True, True]
    assert rows[3].test == "tg64 @ d16384" and rows[3].avg_ts == pytest.approx(14.0)
    log = load("bench_window_verbose_stderr.log")
    assert log.window.cells_resident == 4096 and log.window.host_tail_mib == 350.0


def test_completion_timings():
    content, t = lp.parse_completion(json.loads((LOGS / "completion_response.json").read_text()))
    assert content.startswith(" 68421")
    assert t.prompt_n == 8123 and t.predicted_n == 12 and t.predicted_per_second == pytest.approx(124.57)
    assert lp.parse_completion({"content": "x"}) == ("x", None)


def test_real_cpu_llama_server_log_at_lv4():
    # recorded from a CPU build of the pinned tree (`llama-server -lv 4`, tiny random model):
    # timestamps and level prefixes on every line; no window line without the engine patches
    log = load("cpu_server_tiny_lv4.log")
    assert log.n_ctx == 2048 and log.n_batch == 2048 and log.n_ubatch == 512
    assert log.model_buffers == {"CPU_Mapped": 9.93}
    assert log.kv_buffers == {"CPU": 0.5} and log.kv_caches == [(0.5, 2048, 2)]
    assert log.compute_buffers == {"CPU": 3.01}
    assert log.window is None and not log.graph_reserve_failed and log.context_failed is None
