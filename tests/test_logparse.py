"""logparse against recorded llama.cpp log samples (formats from the pinned tree and the
engine interface contract)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollkv_dist.errors import LogParseError
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
    log = lp.parse_log("hello\nllama_context: n_ctx_seq             = 4096\n"
                       "slot   load_model: id  0 | task -1 | new slot, n_ctx = 2048\n"
                       "llama_context:  CUDA_Host  output buffer size =     0.58 MiB\n"
                       "sched_reserve:      CUDA0 compute buffer size is 397.2700 MiB, matches expectation\n"
                       "llama_context: n_ctx is not divisible by n_seq_max - rounding down to 4096\n"
                       "load_tensors: offloading 28 repeating layers to GPU\n")
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


def test_perf_print_with_nothing_timed():
    # llama-bench's contexts print llama_perf_context_print with 0.00 ms and "inf tokens per second"
    # (seen on the H200 in reports/2026-12-01-h200): a known form, not a parse error
    log = lp.parse_log("llama_perf_context_print: prompt eval time =       0.00 ms / 18432 tokens "
                       "(    0.00 ms per token,      inf tokens per second)\n", source="bench.err")
    assert log.prompt_eval == {"ms": 0.0, "n": 18432, "ms_per_token": 0.0, "tokens_per_second": float("inf")}
    log = lp.parse_log("prompt eval time =     123.45 ms /   512 tokens (    0.24 ms per token,  4,147.50 tokens "
                       "per second)\n", source="server.log")
    assert log.prompt_eval["tokens_per_second"] == pytest.approx(4147.5)
    with pytest.raises(lp.LogParseError, match="bench.err:1"):
        lp.parse_log("prompt eval time = 0.00 ms / 18432 tokens (0.00 ms per token, infinite tokens per second)\n",
                     source="bench.err")


def test_real_cpu_llama_server_log_at_lv4():
    # recorded from a CPU build of the pinned tree (`llama-server -lv 4`, tiny random model):
    # timestamps and level prefixes on every line; no window line without the engine patches
    log = load("cpu_server_tiny_lv4.log")
    assert log.n_ctx == 2048 and log.n_batch == 2048 and log.n_ubatch == 512
    assert log.model_buffers == {"CPU_Mapped": 9.93}
    assert log.kv_buffers == {"CPU": 0.5} and log.kv_caches == [(0.5, 2048, 2)]
    assert log.compute_buffers == {"CPU": 3.01}
    assert log.window is None and not log.graph_reserve_failed and log.context_failed is None


# --- strictness: a line about a known field in an unknown form is an error naming the line -----------


@pytest.mark.parametrize("line,value", [
    ("sched_reserve:      CUDA0 compute buffer size = 1,234.50 MiB", 1234.5),
    ("sched_reserve:      CUDA0 compute buffer size = 2.50 GiB", 2560.0),
    ("sched_reserve:      CUDA0 compute buffer size =   512.00 KiB", 0.5),
])
def test_sizes_with_separators_or_binary_units_are_read(line, value):
    assert lp.parse_log(line).compute_mib("CUDA0") == pytest.approx(value)


@pytest.mark.parametrize("line,what", [
    ("sched_reserve:      CUDA0 compute buffer size = 1234.50 MB", "unknown size unit 'MB'"),
    ("load_tensors:        CUDA0 model buffer size = 14,17.00 MiB", "unreadable number '14,17.00'"),
    ("llama_kv_cache:      CUDA0 KV buffer size = lots", "KV buffer size"),
    ("llama_kv_cache: position window = 600000 / 524288 cells resident (device 65616.00 MiB, host tail 0.00 MiB)",
     "resident cells 600000 of 524288"),
    ("llama_kv_cache: position window = 1,000 of 2,000 cells", "position window"),
    ("llama_kv_cache: position window = 100 / 200 cells resident (device 1.00 MiB, host tail 1.00 MiB) on",
     "position window"),
    ("llama_context: kv compute reserve: pass 1 measured CUDA0 compute buffer = 4984.08 MB (6.5 ms)", "unit 'MB'"),
    ("llama_context: kv compute reserve: pass 3 ran", "kv compute reserve"),
    ("llama_context: kv compute reserve: pass 2 sizes the window with reserve = 5240.00 MiB (measured 4984.00 + "
     "safety 256)", "without a pass 1 line"),
    ("llama_context: n_ctx                 = 524288 cells", "n_ctx"),
    ("load_tensors: offloaded 50/49 layers to GPU", "more layers offloaded"),
    ("slot print_timing: id  0 | task 0 | prompt eval time = 41.27 s / 25 tokens", "prompt eval time"),
    ("build_graph_shift: kv shift: q8_0 K of 32768 cells shifted in 4 chunks", "kv shift"),
])
def test_unreadable_lines_raise_naming_the_line(line, what):
    text = "llama_context: n_ubatch              = 512\n" + line + "\n"
    with pytest.raises(LogParseError) as ei:
        lp.parse_log(text, source="server.log")
    msg = str(ei.value)
    assert what in msg and msg.startswith("server.log:2: ") and line.strip()[:40] in msg
    assert ei.value.exit_code == 10


def test_window_lines_on_several_gpus_are_per_device_records():
    text = "\n".join([
        "llama_kv_cache: position window = 300000 / 524288 cells resident (device 30000.00 MiB, host tail "
        "19152.00 MiB) on CUDA0",
        "llama_kv_cache: position window = 250000 / 524288 cells resident (device 25000.00 MiB, host tail "
        "24152.00 MiB) on CUDA1",
        "llama_kv_cache:      CUDA0 KV buffer size = 49152.00 MiB",
        "llama_kv_cache:      CUDA1 KV buffer size = 49152.00 MiB",
        "llama_kv_cache: size = 98304.00 MiB (524288 cells,  48 layers,  1/1 seqs), K (f16): 49152.00 MiB, "
        "V (f16): 49152.00 MiB",
    ])
    log = lp.parse_log(text)
    assert [(w.device, w.cells_resident) for w in log.windows] == [("CUDA0", 300000), ("CUDA1", 250000)]
    assert log.windows_on("CUDA1")[0].host_tail_mib == 24152.0
    w = log.window  # one cache over two devices: host memory on both only beyond the larger C
    assert (w.cells_resident, w.kv_size, w.device) == (300000, 524288, "CUDA0+CUDA1")
    assert w.host_tail_mib == 19152.0 + 24152.0 and 0 < w.tail_fraction < 1
    assert log.kv_buffers == {"CUDA0": 49152.0, "CUDA1": 49152.0}  # per device, not summed across
    assert log.require_mib("kv", "CUDA1") == 49152.0 and log.kv_mib_largest_cache == 98304.0


def test_pass1_reserve_of_two_gpus_keeps_both():
    # the line as the series before 0097 wrote it (no scratch term): older reports' logs still parse
    text = "\n".join([
        "llama_context: kv compute reserve: pass 1 measured CUDA0 compute buffer = 4984.08 MiB (6.5 ms)",
        "llama_context: kv compute reserve: pass 2 sizes the window with reserve = 5240.08 MiB (measured 4984.08 + "
        "safety 256)",
        "llama_context: kv compute reserve: pass 1 measured CUDA1 compute buffer = 623.01 MiB (6.5 ms)",
        "llama_context: kv compute reserve: pass 2 sizes the window with reserve = 879.01 MiB (measured 623.01 + "
        "safety 256)",
        "llama_context: kv compute reserve: pass 2 done (812.0 ms)",
    ])
    r = lp.parse_log(text).reserve
    assert r.by_device == {
        "CUDA0": {"measured_mib": 4984.08, "ms": 6.5, "reserve_mib": 5240.08, "measured2_mib": 4984.08,
                  "scratch_mib": 0.0, "safety_mib": 256.0},
        "CUDA1": {"measured_mib": 623.01, "ms": 6.5, "reserve_mib": 879.01, "measured2_mib": 623.01,
                  "scratch_mib": 0.0, "safety_mib": 256.0}}
    assert (r.pass1_device, r.pass1_measured_mib, r.pass2_reserve_mib) == ("CUDA0", 4984.08, 5240.08)
    assert r.two_pass and r.pass2_ms == 812.0


def test_budget_lines_and_lines_at_default_verbosity():
    # the window, budget and reserve lines may come without -lv 4, with any level prefix
    text = "\n".join([
        "0.01.000.000 W llama_kv_residency_alloc: CUDA0: free 97000 MiB, vram target 88000 MiB, model 14179 MiB, "
        "other KV 0 MiB, compute reserve 5240 MiB, margin 256 MiB -> window budget 68325 MiB",
        "0.01.000.001 W llama_kv_residency_alloc: position window = 363520 / 524288 cells resident (device 68160.00 "
        "MiB, host tail 30144.00 MiB)",
        "0.01.000.002 W llama_context: kv compute reserve: pass 2 done (812.0 ms)",
    ])
    log = lp.parse_log(text)
    assert log.budgets == [{"device": "CUDA0", "free": 97000.0, "vram_target": 88000.0, "model": 14179.0,
                            "other_kv": 0.0, "compute_reserve": 5240.0, "margin": 256.0, "budget": 68325.0}]
    assert log.window.cells_resident == 363520 and log.reserve.pass2_ms == 812.0
    with pytest.raises(LogParseError, match="no `load_tensors: CUDA0 model buffer size"):
        log.require_mib("model")  # sizes missing (no -lv 4): an error, never 0
    negative = ("llama_kv_residency_alloc: CUDA1: free 900 MiB, vram target 0 MiB, model 700 MiB, other KV 0 MiB, "
                "compute reserve 300 MiB, margin 256 MiB -> window budget -356 MiB on CUDA1")
    with pytest.raises(LogParseError, match="window budget line"):
        lp.parse_log(negative)  # trailing text after the budget: not the engine's line
    assert lp.parse_log(negative.removesuffix(" on CUDA1")).budgets[0]["budget"] == -356.0


def test_bench_rows_and_timings_must_be_complete():
    with pytest.raises(LogParseError, match="row 0 .*avg_ts"):
        lp.parse_bench_json('[{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ns": 1, "stddev_ts": 0}]')
    with pytest.raises(LogParseError, match="not JSON"):
        lp.parse_bench_json('[{"n_prompt": 512, "n_gen"')
    with pytest.raises(LogParseError, match="predicted_per_second"):
        lp.parse_completion({"content": "x", "timings": {"prompt_n": 1, "prompt_ms": 1.0, "prompt_per_second": 1.0,
                                                         "predicted_n": 1, "predicted_ms": 1.0}})


def test_bench_rows_carry_the_tail_staging():
    row = {"n_prompt": 0, "n_gen": 64, "n_depth": 16384, "avg_ns": 1, "avg_ts": 140.0, "stddev_ts": 0.0}
    rows = lp.parse_bench_json(json.dumps([{**row, "kv_tail_staging": "auto"}, {**row, "kv_tail_staging": "off"},
                                           row]))
    assert [r.kv_tail_staging for r in rows] == ["auto", "off", None]  # None: a build without -kts
    for bad in ("staged", 1, ""):
        with pytest.raises(LogParseError, match="row 0 .*kv_tail_staging"):
            lp.parse_bench_json(json.dumps([{**row, "kv_tail_staging": bad}]))


def test_chunked_and_failed_k_shifts():
    """0098's line per chunked shift of a quantized K, and 0001's failure of a shift's graph."""
    log = lp.parse_log("llama_kv_cache: n_ctx = 1\n"
                       "build_graph_shift: kv shift: q8_0 K of 1,048,576 cells shifted in chunks of 65536 cells, their "
                       "f32 copies within the CUDA0 compute buffer (2,398 MiB)\n")
    assert log.kv_shifts == [{"type": "q8_0", "cells": 1048576, "chunk": 65536, "device": "CUDA0",
                              "buffer_mib": 2398.0}] and not log.kv_shift_failed
    log = lp.parse_log("update: failed to allocate compute graph for K-shift (q8_0 K, 32768 cells): the shift stays "
                       "pending and decoding is refused until it succeeds or the memory is cleared\n")
    assert log.kv_shifts == [] and log.kv_shift_failed
    assert lp.parse_log("update: failed to compute K-shift: the shift stays pending\n").kv_shift_failed
    assert not lp.parse_log("slot update_slots: id  0 | task 3 | slot context shift, n_keep = 0\n").kv_shift_failed


def test_the_logits_dumps_shift_request_is_read_apart_from_the_engines_shift():
    """llama-logits-dump --kv-shift (0011) logs what it removed; that line is not 0098's chunked shift line."""
    log = lp.parse_log("logits_dump: logits-dump: kv shift: positions [4, 516) dropped, the rest moved back by 512\n")
    assert log.dump_shift == (4, 516, 512) and log.kv_shifts == []
    with pytest.raises(LogParseError, match="kv shift"):
        lp.parse_log("logits-dump: kv shift: positions 4..516 dropped\n")
