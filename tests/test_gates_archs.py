"""The archs gate (every model of the pin's architecture fixture) against the fake programs: the
fake test-llama-archs writes one JSON "model" per architecture that says its memory (patch 0090's
names), and the fake llama-logits-dump treats each accordingly (a window, auto falling back to
resident, an upstream failure, a memory that cannot shift)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollkv_dist.errors import UsageError
from rollkv_dist.gates import archs, context, logparse
from rollkv_dist.gates.runner import run_gate

from test_gates import FAKE, fake_gpu

OK_ARCHS = "llama-dense,qwen35-dense,mamba-dense,gpt2-dense"


def run_archs(tmp_path: Path, env: dict[str, str], **opts) -> context.GateResult:
    env = {**os.environ, "FAKE_KRM_DEFAULT": "auto", **env}
    ctx = context.GateContext(build=FAKE, work=tmp_path / "work", gpu=fake_gpu(),
                             options={"archs_jobs": 2, **opts}, env=env)
    return run_gate("archs", ctx)


def rows_by_arch(res: context.GateResult) -> dict[str, dict]:
    return {r["arch"]: r for r in res.results["rows"]}


def test_archs_pass_where_every_attention_memory_takes_a_window(tmp_path):
    res = run_archs(tmp_path, {"FAKE_ARCHS": OK_ARCHS})
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    rows = rows_by_arch(res)
    assert sorted(rows) == sorted(OK_ARCHS.split(","))
    for name in ("llama-dense", "qwen35-dense"):  # a window with a tail, exact, shift+state exact
        r = rows[name]
        assert r["resident_ok"] and r["auto_ok"] and r["max_abs_diff"] == 0.0 and r["tokens_equal"]
        assert r["tail_fraction"] >= archs.MIN_TAIL and r["window_tail_mib"] > 0
        assert r["shift_max_abs_diff"] == 0.0 and r["shift_tokens_equal"]
    # the staging graph (LLAMA_KV_STAGE_EVERY_CELL=1) ran for every model that resident runs, identical
    assert all(r["staged_max_abs_diff"] == 0.0 for r in rows.values() if r["resident_ok"])
    assert any(c.startswith("LLAMA_KV_STAGE_EVERY_CELL=1 ") for c in res.commands)
    # a memory that cannot shift has its state round trip checked alone
    assert rows["llama-dense"]["shifted"] and not rows["qwen35-dense"]["shifted"]
    assert "cannot shift" in rows["qwen35-dense"]["note"]
    names = {c.name for c in res.checks}
    assert "qwen35-dense state: both dumps did the round trip" in names
    assert "llama-dense shift+state: both dumps did the shift and the round trip" in names
    assert rows["qwen35-dense"]["memory"].startswith("hybrid")
    m = rows["mamba-dense"]  # nothing to window: resident under auto and under -krm window, with the line
    assert m["auto_ok"] and m["max_abs_diff"] is None and "nothing to window" in m["note"]
    assert any(c.name == "mamba-dense: -krm window runs resident, with a line" and c.ok for c in res.checks)
    g = rows["gpt2-dense"]  # upstream's failure: a note, no check of ours
    assert not g["resident_ok"] and "upstream: resident fails too" in g["note"]
    assert not any(c.name.startswith("gpt2-dense") for c in res.checks)
    s = res.results["summary"]
    assert s["window_exact"] == 2 and s["upstream_failures"] == ["gpt2-dense"]
    assert s["auto_fails_where_resident_runs"] == [] and s["no_window"] == ["mamba-dense"]
    # the rows are also the gate's archs.json, and the report's table has one line per model
    assert json.loads((tmp_path / "work" / "archs.json").read_text()) == res.results["rows"]
    table = archs.report_rows(res.results)
    assert sum(line.startswith("| ") for line in table) == 1 + len(rows)  # the header, one line a model


def test_an_attention_memory_without_a_window_fails_the_gate(tmp_path):
    res = run_archs(tmp_path, {"FAKE_ARCHS": "qwen4exp-dense,nowindow-dense"})
    assert res.verdict == "fail"
    failed = [c.name for c in res.checks if not c.ok]
    assert failed == ["nowindow-dense: its memory takes a window"]
    r = rows_by_arch(res)["nowindow-dense"]
    assert r["auto_ok"] and r["memory"] == "a memory type without window support" and r["max_abs_diff"] is None
    # the indexer hybrid (patch 0090) takes its window like the other hybrids
    q = rows_by_arch(res)["qwen4exp-dense"]
    assert q["memory"].startswith("hybrid (an attention KV cache with an indexer") and q["max_abs_diff"] == 0.0


def test_a_log_line_the_parser_does_not_know_fails_the_gate(tmp_path):
    # the H200 run of 2026-12-04 with a parser older than the engine passed with every window check skipped: the
    # parse errors went into notes
    line = "llama_context: kv compute reserve: CUDA0 a line of a newer engine = 1.00 MiB"
    res = run_archs(tmp_path, {"FAKE_ARCHS": "llama-dense", "FAKE_EXTRA_LOG": line})
    assert res.verdict == "fail"
    failed = [c for c in res.checks if not c.ok]
    assert failed and all(c.name.startswith("llama-dense: the ") and c.name.endswith(" run's log parses")
                          for c in failed), [c.name for c in failed]
    assert "a line of a newer engine" in failed[0].detail


def test_a_window_that_differs_from_resident_fails(tmp_path):
    res = run_archs(tmp_path, {"FAKE_ARCHS": "llama-dense", "FAKE_DUMP_DIFF": "1"})
    assert res.verdict == "fail"
    failed = {c.name for c in res.checks if not c.ok}
    assert "llama-dense: window logits identical to resident (max |diff| == 0)" in failed
    assert rows_by_arch(res)["llama-dense"]["max_abs_diff"] > 0


def test_auto_failing_where_resident_runs_fails(tmp_path):
    # the engine before patch 0090: auto refused a memory without a window (the context failed)
    res = run_archs(tmp_path, {"FAKE_ARCHS": "llama-dense,nowindow-dense", "FAKE_KRM_DEFAULT": "window"})
    assert res.verdict == "fail"
    assert "nowindow-dense: the packaged default loads and decodes" in {c.name for c in res.checks if not c.ok}
    assert res.results["summary"]["auto_fails_where_resident_runs"] == ["nowindow-dense"]


def test_the_filter_and_its_misses(tmp_path):
    res = run_archs(tmp_path, {}, archs_filter="^mamba")
    assert [r["arch"] for r in res.results["rows"]] == ["mamba-dense"]
    res = run_archs(tmp_path / "b", {}, archs_filter="^nothing$")
    assert res.verdict == "fail" and not res.results.get("rows")


def test_the_residency_line_parses():
    log = logparse.parse_log("kv_residency_resolve: kv residency: auto -> resident: this model's memory is "
                             "recurrent state only (no attention KV cache), so there is nothing to window")
    assert log.residency == logparse.Residency("auto", "resident", log.residency.detail,
                                               "recurrent state only (no attention KV cache)")
    assert archs._kind(log.residency.memory) == "none" and archs._kind("an attention KV cache") == "attention"


def test_only_sliding_window_layers_is_no_tail():
    """The fixture's 2-layer LFM2: its one attention layer is a sliding-window one, the full cache is empty."""
    swa_only = logparse.parse_log("llama_kv_cache: size =    0.75 MiB (   768 cells,   1 layers,  1/1 seqs), K (f16): "
                                  "0.38 MiB, V (f16): 0.38 MiB\nllama_kv_cache: size =    0.00 MiB (  8192 cells,   0 "
                                  "layers,  1/1 seqs), K (f16): 0.00 MiB, V (f16): 0.00 MiB")
    assert archs.only_sliding_window(swa_only, 8192)
    both = logparse.parse_log("llama_kv_cache: size =   16.00 MiB (  8192 cells,   2 layers,  1/1 seqs), K (f16): "
                              "8.00 MiB, V (f16): 8.00 MiB")
    assert not archs.only_sliding_window(both, 8192) and not archs.only_sliding_window(logparse.LlamaLog(), 8192)


def test_a_staging_graph_that_differs_fails(tmp_path):
    res = run_archs(tmp_path, {"FAKE_ARCHS": "mamba-dense,llama-dense", "FAKE_DUMP_STAGE_DIFF": "1"})
    failed = {c.name for c in res.checks if not c.ok}
    assert failed == {f"{a}: the staging graph (LLAMA_KV_STAGE_EVERY_CELL=1) gives the resident logits"
                      for a in ("mamba-dense", "llama-dense")}


def test_a_cache_that_grows_with_the_context_is_given_more_context(tmp_path):
    """DeepSeek-V4's CSA cache holds a quarter of the positions: at the fixture's size its tensors fill one granule
    until -c 131072, where the gate finds its tail (16x --archs-ctx, while a cache with layers grows)."""
    res = run_archs(tmp_path, {"FAKE_ARCHS": "deepseek4-moe"})
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    r = rows_by_arch(res)["deepseek4-moe"]
    assert r["n_ctx"] == 16 * 8192 and r["max_abs_diff"] == 0.0 and r["tail_fraction"] >= archs.MIN_TAIL
    assert "-c 131072: no tail" in r["note"] and "sliding-window" not in r["note"]


def test_a_growing_cache_without_a_tail_fails(tmp_path):
    res = run_archs(tmp_path, {"FAKE_ARCHS": "deepseek4-moe"}, archs_ctx=2048)  # 16x is still one granule
    failed = [c.name for c in res.checks if not c.ok]
    assert failed == ["deepseek4-moe: a window with >= 40% of the cells in the host tail"]
    # the note says what each target of the search gave, at every context tried
    note = rows_by_arch(res)["deepseek4-moe"]["note"]
    for n_ctx in (2048, 8192, 32768):
        assert f"-c {n_ctx}: tried --vram-target " in note, note
    assert "fully resident (" in note, note


def test_a_search_attempt_in_words():
    win = {"fully_resident": False, "kv_size": 32768, "cells_resident": 16384, "host_tail_mib": 2.0}
    assert archs.describe_outcome({"ok": False, "window": None}) == "failed to boot"
    assert archs.describe_outcome({"ok": True, "window": None}) == "no window line"
    assert archs.describe_outcome({"ok": True, "window": {**win, "fully_resident": True}}) == "fully resident (32768 cells)"
    assert archs.describe_outcome({"ok": True, "window": win}) == "16384 of 32768 cells on the device (2.0 MiB tail)"


def test_growth_is_read_from_the_caches_with_layers():
    def log(*caches):
        return logparse.parse_log("\n".join(
            f"llama_kv_cache: size = {mib:7.2f} MiB ({cells:6d} cells, {layers:3d} layers,  1/1 seqs), K (f16): "
            f"{mib / 2:.2f} MiB, V (f16): {mib / 2:.2f} MiB" for mib, cells, layers in caches))
    swa = log((0.75, 768, 1), (0.0, 8192, 0)), log((0.75, 768, 1), (0.0, 32768, 0))
    assert not archs.grows_with_context(*swa)  # LFM2: the SWA cache keeps its size, the full cache has no layer
    csa = log((0.4, 768, 4), (2.0, 2048, 1)), log((0.4, 768, 4), (8.0, 8192, 1))
    assert archs.grows_with_context(*csa)


def test_the_fa_off_pair_windows_k_alone_and_must_match(tmp_path):
    """Patch 0093: -fa off keeps the transposed V on the device and K takes the window; the pair runs for the models
    --archs-fa-off matches (the plain and hybrid ones here), and Grok, whose flash attention upstream forces off,
    takes its window that way under -fa on too."""
    res = run_archs(tmp_path, {"FAKE_ARCHS": "llama-dense,qwen35-dense,grok-moe"})
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    rows = rows_by_arch(res)
    for name in ("llama-dense", "qwen35-dense"):
        r = rows[name]
        assert r["fa_off_max_abs_diff"] == 0.0 and r["fa_off_tokens_equal"] and r["fa_off_tail_fraction"] >= 0.4, r
        assert any(c.name == f"{name} -fa off: V stays in device memory and K alone takes the window" and c.ok
                   for c in res.checks)
    assert any("-fa off " in c and "-krm window" in c for c in res.commands)
    g = rows["grok-moe"]
    assert g["max_abs_diff"] == 0.0 and g["tail_fraction"] >= 0.4 and g["fa_off_max_abs_diff"] is None
    assert "V stays in device memory, K alone takes the window" in g["note"]
    assert res.results["summary"]["fa_off_exact"] == ["llama-dense", "qwen35-dense"]
    assert any("-fa off diff" in line for line in archs.report_rows(res.results))
    # none asked: no -fa off run at all
    none = run_archs(tmp_path / "none", {"FAKE_ARCHS": "llama-dense"}, archs_fa_off="")
    assert none.verdict == "pass" and not any("-fa off" in c for c in none.commands)


def test_an_fa_off_window_that_differs_or_windows_v_fails(tmp_path):
    res = run_archs(tmp_path, {"FAKE_ARCHS": "llama-dense", "FAKE_DUMP_DIFF": "fa-off"})
    assert [c.name for c in res.checks if not c.ok] == [
        "llama-dense -fa off: window logits identical to resident (max |diff| == 0)"]
    res = run_archs(tmp_path / "v", {"FAKE_ARCHS": "llama-dense", "FAKE_FA_OFF_IGNORED": "1"})
    assert [c.name for c in res.checks if not c.ok] == [
        "llama-dense -fa off: V stays in device memory and K alone takes the window"]


def test_a_bad_regular_expression_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="--archs-fa-off"):
        run_archs(tmp_path, {}, archs_fa_off="(")


def test_default_only_runs_resident_and_the_default_alone(tmp_path):
    res = run_archs(tmp_path, {"FAKE_ARCHS": OK_ARCHS + ",nowindow-dense"}, archs_default_only=True)
    rows = rows_by_arch(res)
    assert all(r["max_abs_diff"] is None and r["staged_max_abs_diff"] is None for r in rows.values())
    assert not any("-krm window" in c or "LLAMA_KV_STAGE_EVERY_CELL" in c for c in res.commands)
    assert rows["llama-dense"]["auto_ok"] and rows["mamba-dense"]["auto_ok"] and not rows["gpt2-dense"]["resident_ok"]
    # an attention memory whose default takes no window still fails: auto's decision is checked
    assert [c.name for c in res.checks if not c.ok] == ["nowindow-dense: its memory takes a window"]
