"""The server gate (the packaged llama-server's defaults and the paths they take, window vs resident) against
the fake programs: the fake test-llama-archs writes the model with the sizes it was given; the fake llama-server
answers array requests with tokens and log-probabilities that are a function of the prompt, gives its slot
count on /props, counts cached tokens (a prefix seen before, or with --cache-reuse a prompt seen before inside
this one) and saves, erases and restores slots by file. Planted faults: FAKE_WINDOW_ANSWER_DIFF=1 (one
log-probability differs in window mode), FAKE_NO_RESTORE=1 (a prompt asked again is not found in the prompt
cache), FAKE_WINDOW_STATE_DIFF=1 (the window server's slot file differs), FAKE_NO_DRAFT=1 (no draft accepted),
FAKE_DRAFT_WHOLE_TARGET=1 (the main and the draft context each budget the whole --vram-target)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollkv_dist.errors import UsageError
from rollkv_dist.gates import archs, context, server
from rollkv_dist.gates.runner import run_gate

from test_gates import FAKE, fake_gpu


def run_server(tmp_path: Path, env: dict[str, str] | None = None, **opts) -> context.GateResult:
    # KV of 0.1 MiB a cell: 3.2 GiB at -c 32768
    env = {**os.environ, "FAKE_KRM_DEFAULT": "auto", "FAKE_SERVER_MIB_PER_CELL": "0.1", **(env or {})}
    ctx = context.GateContext(build=FAKE, work=tmp_path / "work", gpu=fake_gpu(), options=opts, env=env)
    return run_gate("server", ctx)


def failed(res: context.GateResult) -> set[str]:
    return {c.name for c in res.checks if not c.ok}


def test_every_case_passes_when_window_answers_as_resident(tmp_path):
    res = run_server(tmp_path)
    assert res.verdict == "pass", failed(res)
    model = json.loads(next((tmp_path / "work" / "server-model").glob("*.gguf")).read_text())
    assert model["size"] == {"n_embd": 2048, "n_head": 16, "n_ff": 5632, "n_layer": 16}
    assert res.results["n_slots"] == 4  # read from /props: the packaged default's
    servers = [c for c in res.commands if "llama-server" in c]
    # the slot count and the unified KV are left at their defaults
    assert servers and not any(f in c.split() for c in servers for f in ("-np", "--parallel", "--kv-unified", "-kvu"))
    cases = {c["case"]: c for c in res.results["cases"]}
    assert list(cases) == list(server.CASES)
    for c in cases.values():
        assert archs.MIN_TAIL <= c["tail_fraction"] <= 0.9 and c["cells_used"] > c["cells_resident"], c
    rows = res.results["rows"]
    steps = {(r["case"], r["step"]) for r in rows}
    assert steps == {("defaults", "wave 1"), ("defaults", "wave 2"), ("defaults", "wave 3"), ("defaults", "wave 4"),
                     ("cache-reuse", "wave 2"), ("cache-reuse", "moved"), ("slot-file", "wave 2"),
                     ("slot-file", "after restore"), ("short-ubatch", "wave 1"), ("short-ubatch", "wave 2"),
                     ("draft", "wave 1"), ("draft", "wave 2"), ("context-shift", "wave 2"),
                     ("context-shift", "shift")}
    assert len(rows) == 4 * 4 + 2 * 4 + 4 + 1 + 2 * 4 + 2 * 4 + 2 * 4
    assert all(r["tokens_equal"] and r["max_abs_diff"] == 0.0 and r["n_logprobs"] > 0 for r in rows)
    # each case's flags, and the window sized once for the defaults' memory and once for the short ubatches'
    assert any("--cache-reuse 16" in c and "-krm window" in c for c in servers)
    assert any("--slot-save-path" in c and "-krm window" in c for c in servers)
    assert sum("--vram-target 1 " in c for c in servers) == 4  # defaults, short-ubatch, draft, context-shift
    model_path = str(next((tmp_path / "work" / "server-model").glob("*.gguf")))
    assert all(f"-md {model_path} --spec-type draft-simple" in c for c in servers if "-md" in c)
    assert cases["draft"]["flags"] == "-md MODEL --spec-type draft-simple --spec-draft-n-max 8"
    assert cases["cache-reuse"]["vram_target"] == cases["defaults"]["vram_target"]
    # the context shift: the slots capped at a quarter of -c, the long prompt 2 cells short of it, on the
    # defaults' window
    cs = cases["context-shift"]
    assert cs["flags"] == "--context-shift --kv-unified-per-slot 8192 -ctk q8_0 -ctv f16"
    assert cs["long_prompt_tokens"] == 8190
    assert cs["vram_target"] == cases["defaults"]["vram_target"]
    assert all("-ub 16 -ctk q8_0 -ctv f16" in c for c in servers if f"--vram-target {cases['short-ubatch']['vram_target']}" in c)
    # wave 4 repeats wave 2 and is found in the prompt cache; the moved prompts reuse their cached chunks
    assert all(r["cache_n"] > 0 for r in rows if r["step"] in ("wave 4", "moved", "after restore"))
    sf = cases["slot-file"]
    assert sf["n_saved"] == sf["n_restored"] > 0 and sf["file_sha256"] and sf["slot"] == 3
    table = server.report_rows(res.results)
    assert sum(line.startswith("| defaults |") for line in table) == 1 + 16


def test_a_window_answer_that_differs_fails_every_case(tmp_path):
    res = run_server(tmp_path, {"FAKE_WINDOW_ANSWER_DIFF": "1"})
    assert res.verdict == "fail"
    lp = {n for n in failed(res) if n.endswith("log-probabilities identical")}
    assert {n.split(",")[0] for n in lp} == set(server.CASES)
    assert len(lp) == len(res.results["rows"]) and failed(res) == lp


def test_no_restore_from_the_prompt_cache_fails(tmp_path):
    res = run_server(tmp_path, {"FAKE_NO_RESTORE": "1"}, server_cases="defaults")
    assert failed(res) == {
        f"defaults, {who}: wave 4 restores every slot's prompt from the prompt cache (>= 90 % of its tokens cached)"
        for who in ("resident", "window")}


def test_a_slot_file_that_differs_fails(tmp_path):
    res = run_server(tmp_path, {"FAKE_WINDOW_STATE_DIFF": "1"}, server_cases="slot-file")
    assert failed(res) == {"slot-file: the window server's slot file is the resident server's, byte for byte"}


def test_cache_reuse_that_reuses_nothing_fails(tmp_path, monkeypatch):
    """Without --cache-reuse the fake (as the server) caches only the common prefix of the moved prompts."""
    monkeypatch.setitem(server.CASES, "cache-reuse", server.Case("cache-reuse", (), False))
    res = run_server(tmp_path, server_cases="cache-reuse")
    assert failed(res) == {f"cache-reuse, {who}: every moved prompt reuses its cached chunks beyond the common prefix "
                           f"(cached tokens > prefix + 16)" for who in ("resident", "window")}


def test_speculation_that_accepts_nothing_fails_the_draft_case(tmp_path):
    res = run_server(tmp_path, {"FAKE_NO_DRAFT": "1"}, server_cases="draft")
    assert failed(res) == {f"draft, {who}: every answer was drafted and verified (draft tokens accepted > 0)"
                           for who in ("resident", "window")}
    assert any(n.startswith("draft: the window server's caches") for n in res.notes)


def test_a_draft_context_that_budgets_the_whole_target_fails_the_draft_case(tmp_path):
    ok = run_server(tmp_path / "ok", server_cases="draft")
    assert ok.verdict == "pass", failed(ok)
    check = next(c for c in ok.checks if c.name.startswith("draft: the main and the draft context together"))
    assert "budget lines: 2" in check.detail
    res = run_server(tmp_path / "fault", {"FAKE_DRAFT_WHOLE_TARGET": "1"}, server_cases="draft")
    assert failed(res) == {"draft: the main and the draft context together keep to the --vram-target"}


def test_a_shifted_context_that_differs_fails_the_context_shift_case(tmp_path):
    res = run_server(tmp_path, {"FAKE_WINDOW_SHIFT_DIFF": "1"}, server_cases="context-shift")
    assert failed(res) == {"context-shift, shift, prompt 0: log-probabilities identical"}
    shift = {c.name: c for c in res.checks}
    assert all(shift[f"context-shift, {who}: the long prompt's slot shifted its context (truncated) while the other "
                     f"slots answered beside it"].ok for who in ("resident", "window"))


def test_a_quantized_k_shift_that_fails_fails_the_context_shift_case(tmp_path):
    """0001's K-shift failure on the window server (its graph not allocated: before 0098, a shift of a quantized K
    outgrew the compute buffer) fails the case, though the fake's answers stay equal."""
    res = run_server(tmp_path, {"FAKE_WINDOW_SHIFT_FAIL": "1"}, server_cases="context-shift")
    assert failed(res) == {"context-shift, window: the quantized K shifted in chunks within the compute buffer, and "
                           "no shift failed"}


def test_a_server_that_does_not_shift_fails_the_context_shift_case(tmp_path, monkeypatch):
    """A slot context the long prompt does not reach (no shift): the case says so on both servers."""
    monkeypatch.setitem(server.CASES, "context-shift",
                        server.Case("context-shift", ("--context-shift", "--kv-unified-per-slot", "16384"), False))
    res = run_server(tmp_path, server_cases="context-shift")
    assert failed(res) == {f"context-shift, {who}: {what}" for who in ("resident", "window") for what in (
        "the long prompt's slot shifted its context (truncated) while the other slots answered beside it",
        "the quantized K shifted in chunks within the compute buffer, and no shift failed")}


def test_a_window_server_that_fails_to_boot_fails_its_case(tmp_path):
    res = run_server(tmp_path, {"FAKE_SERVER_FAIL": "1"}, server_cases="defaults")
    assert res.verdict == "fail"
    assert "defaults: the resident server boots and answers" in failed(res) or \
        "a resident server at the packaged defaults boots and reports its slots" in failed(res)


def test_bad_options_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="--server-cases"):
        run_server(tmp_path, server_cases="defaults,nope")
    with pytest.raises(UsageError, match="--server-fill"):
        run_server(tmp_path, server_fill=0.95)
    with pytest.raises(UsageError, match="context-shift case needs >= 3"):
        run_server(tmp_path, server_gen=2)
    run_server(tmp_path / "no-shift", server_gen=2, server_cases="defaults")  # other cases take any length


def test_prompts_fill_the_context_and_wave_2_extends_wave_1():
    o = server.Options(server_ctx=8192, server_fill=0.5)
    p = server.prompts_for(o, 2)
    assert [len(v) for v in p.values()] == [2, 2, 2]
    assert all(b.startswith(a + " ") for a, b in zip(p["wave 1"], p["wave 2"]))
    assert not set(p["wave 3"]) & set(p["wave 1"])
    # about fill * ctx / slots tokens of the test tokenizer per slot after wave 2
    assert all(abs(len(b) / 5 - 2048) < 0.05 * 2048 for b in p["wave 2"])
