"""Gate verdict logic end-to-end against fake llama.cpp binaries (tests/data/fake_llama/bin):
real processes, real HTTP, real process-group kills; no GPU."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollkv_dist import gpu as gpu_mod
from rollkv_dist import proc
from rollkv_dist.errors import GateFailure, UsageError
from rollkv_dist.gates import context, logparse, needle, process, report, resident_parity, sizing
from rollkv_dist.gates.rows import jsonable
from rollkv_dist.gates.runner import DEFAULT_GATES, parse_gate_list, run_gates

FAKE = Path(__file__).parent / "data" / "fake_llama"
REQUIRED = report.REQUIRED_KEYS


def fake_gpu() -> gpu_mod.GPUInfo:
    return gpu_mod.GPUInfo(index=0, uuid="GPU-fake-0000", name="NVIDIA H200", memory_total=143 << 30,
                           memory_free=140 << 30, compute_capability=(9, 0), pcie_gen_current=1,
                           pcie_width_current=16, pcie_gen_max=5, pcie_width_max=16)


def ctx_for(tmp_path: Path, **opts) -> context.GateContext:
    gemma = tmp_path / "gemma.gguf"
    gemma.write_bytes(b"GGUF")
    return context.GateContext(build=FAKE, work=tmp_path / "work", gpu=fake_gpu(), gemma=gemma,
                              options=opts, env=dict(os.environ))


def report_results(res: context.GateResult) -> dict:
    """A gate's results as its report holds them: the rows' JSON (gates/rows.py), what readers parse."""
    return jsonable(res.results)


def run_one(name: str, ctx: context.GateContext):
    from rollkv_dist.gates.runner import run_gate

    return run_gate(name, ctx)


def _served_prompts(log: Path) -> list[str]:
    """sha256 of each prompt a fake llama-server received, in order (from its log)."""
    mark = "fake-server: completion prompt sha256 = "
    return [ln.split(mark, 1)[1].strip() for ln in log.read_text().splitlines() if mark in ln]


def test_needle_passes_with_needles_in_the_tail(tmp_path):
    res = run_one("needle", ctx_for(tmp_path, needle_ctx=2048))
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    rows = res.results["rows"]
    assert len(rows) == 3 and [r["depth"] for r in rows] == [0.3, 0.6, 0.9]
    assert all(r["resident"]["found"] and r["window"]["found"] and r["identical"] for r in rows)
    C = res.results["window"]["cells_resident"]
    assert 0 < C < 2048 and res.results["window"]["tail_fraction"] >= 0.5
    assert all(r["window_C"] == C and r["needle_pos"] > C and r["in_tail"] for r in rows)
    # the needle depth is measured inside the tail [C, n_total): deeper needles sit later, and
    # each lands near its target (the fake tokenizer makes place() accurate to a filler unit)
    assert rows[0]["needle_pos"] < rows[1]["needle_pos"] < rows[2]["needle_pos"]
    for r in rows:
        assert r["needle_target"] == int(C + r["depth"] * (2048 - 64 - C))
        assert abs(r["needle_pos"] - r["needle_target"]) <= 40 and r["n_prompt"] <= 2048 - 64
    assert any("--vram-target" in c for c in res.commands)
    # one resident boot for the sizes, probes, one window server, one resident control server
    servers = [c for c in res.commands if "llama-server" in c and "--help" not in c]
    kinds = ["window" if "-krm window" in c else "resident" for c in servers]
    assert kinds[0] == "resident" and kinds[-2:] == ["window", "resident"]
    assert kinds.count("resident") == 2
    checks = [c.name for c in res.checks]
    for d in (0.3, 0.6, 0.9):
        assert sum(n.startswith(f"depth {d}: ") for n in checks) == 4
    # the prompts are kept as files (the JSON has only their sha256)
    for r, f in zip(rows, res.results["prompt_files"], strict=True):
        assert hashlib.sha256(Path(f).read_bytes()).hexdigest() == r["prompt_sha256"]
        assert "prompt" not in r


def test_needle_resident_and_window_answer_the_same_prompts(tmp_path):
    ctx = ctx_for(tmp_path, needle_ctx=2048)
    res = run_one("needle", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    rows = res.results["rows"]
    # what the servers received, read from their own logs
    window = _served_prompts(ctx.work / "window.log")
    resident = _served_prompts(ctx.work / "resident-answers.log")
    assert window == resident == [r["prompt_sha256"] for r in rows]
    assert len(set(window)) == 3  # three different prompts, one per depth
    assert _served_prompts(ctx.work / "resident.log") == []  # the sizes boot answers nothing
    for r in rows:
        assert r["resident"]["prompt_sha256"] == r["window"]["prompt_sha256"] == r["prompt_sha256"]
        assert r["resident"]["prompt_n"] == r["window"]["prompt_n"] == r["n_prompt"]
        assert r["resident"]["answer"] == r["window"]["answer"] == f" {r['key']}. Remember it."


def test_needle_different_window_answer_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_WINDOW_ANSWER_DIFF", "1")
    ctx = ctx_for(tmp_path, needle_ctx=2048)
    ctx.env = dict(os.environ)
    res = run_one("needle", ctx)
    assert res.verdict == "fail"
    failed = [c.name for c in res.checks if not c.ok]
    # the key is still found in both modes: only the identical-answer check catches it
    assert len(failed) == 3 and all("window answer identical to the resident answer" in n for n in failed)
    for r in res.results["rows"]:
        assert r["resident"]["found"] and r["window"]["found"] and r["identical"] is False
        assert "Forget" in r["window"]["answer"] and "Remember" in r["resident"]["answer"]
    md = needle.table(res.results["rows"])
    assert md.count("| NO |") == 3


def test_needle_plant_failure_fails(tmp_path):
    res = run_one("needle", ctx_for(tmp_path, needle_ctx=2048, plant_failure=True))
    assert res.verdict == "fail"
    failed = [c.name for c in res.checks if not c.ok]
    # both modes miss the wrong key, on every depth; their answers still agree
    assert len(failed) == 6 and all("found" in n for n in failed)
    assert sum("resident run" in n for n in failed) == sum("window run" in n for n in failed) == 3
    rows = res.results["rows"]
    assert all(r["expected"] == r["key"] + 1 for r in rows)
    assert not any(r["resident"]["found"] or r["window"]["found"] for r in rows)
    assert all(r["identical"] for r in rows)


def test_needle_table_shows_both_modes():
    row = {"depth": 0.6, "key": 5, "expected": 5, "needle_target": 1500, "needle_pos": 1510, "n_prompt": 1980,
           "prompt_sha256": "x", "window_C": 900, "in_tail": True,
           "resident": {"answer": " 5.\nRemember | it", "found": True},
           "window": {"answer": " 7.", "found": False}, "identical": False}
    lines = needle.table([row]).splitlines()
    cells = [len(re.split(r"(?<!\\)\|", ln)) - 2 for ln in lines]  # an escaped \| is no separator
    assert cells == [10, 10, 10]
    assert lines[2] == "| 0.6 | 1510 | 1980 | 900 | 5 | 5. Remember \\| it | yes | 7. | NO | NO |"
    # a control boot that failed leaves the resident cells empty
    lines = needle.table([{**row, "resident": None, "identical": None}]).splitlines()
    assert lines[2].endswith("| - | - | 7. | NO | - |")


def test_needle_skips_without_gemma(tmp_path):
    ctx = ctx_for(tmp_path)
    ctx.gemma = None
    assert run_one("needle", ctx).verdict == "skip"


def test_server_that_cannot_boot_fails_the_gate(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_FAIL", "1")
    ctx = ctx_for(tmp_path, needle_ctx=2048)
    ctx.env = dict(os.environ)
    res = run_one("needle", ctx)
    assert res.verdict == "fail"
    assert [c.name for c in res.checks if not c.ok] == ["resident server boots"]


def _prompt_model(tmp_path):
    m = tmp_path / "m.gguf"
    m.write_bytes(b"GGUF")
    return m


def test_resident_parity_identical(tmp_path):
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), parity_gen=4)
    res = run_one("resident-parity", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    for kv in ("f16", "q8_0"):
        case = res.results[f"kv_{kv}"]
        assert case["compare"]["max_abs_diff"] == 0.0 and case["compare"]["tokens_equal"]
        assert case["window"]["tail_fraction"] >= 0.5
        assert case["vram_target"] > case["resident"]["model_mib"]


def test_resident_parity_shift_and_state_round_trip_at_the_plain_target(tmp_path):
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), parity_gen=4)
    res = run_one("resident-parity", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    names = {c.name for c in res.checks}
    shifted = [c for c in res.commands if "--kv-shift" in c]
    assert len(shifted) == 4 and all("--kv-shift 512 --state-roundtrip" in c for c in shifted)
    for kv in ("f16", "q8_0"):
        case = res.results[f"kv_{kv}"]
        sh = case["shift+state"]
        # same flags for both modes; the window at the plain pair's target, no second search
        mine = [c for c in shifted if f"-ctk {kv} -ctv {kv}" in c]
        assert ["-krm resident" in c for c in mine] == [True, False]
        assert mine[1].endswith(f"-krm window --vram-target {case['vram_target']}") and sh["vram_target"] == case["vram_target"]
        assert sh["window"]["window"]["cells_resident"] == case["window"]["cells_resident"]
        assert sh["compare"]["max_abs_diff"] == 0.0 and sh["compare"]["tokens_equal"]
        assert sh["compare"]["kv_shift"] == [512, 512] and sh["compare"]["state_roundtrip"] == [True, True]
        # the plain pair ran without them (its dumps say so)
        assert case["compare"]["kv_shift"] == [0, 0] and case["compare"]["state_roundtrip"] == [False, False]
        for check in ("logits finite", "logits identical (max |diff| == 0)", "greedy tokens identical",
                      "both dumps say the shift and the state round trip happened", "resident run succeeds",
                      "window run succeeds"):
            assert f"{kv} shift+state: {check}" in names
        # the variant compared its own dumps
        meta = json.loads((ctx.work / f"window-{kv}-shift.json").read_text())
        assert meta["kv_shift"] == 512 and meta["state_roundtrip"] is True
    assert sum("--vram-target" in c and "--kv-shift" not in c for c in res.commands) == len(
        res.results["kv_f16"]["window_attempts"]) + len(res.results["kv_q8_0"]["window_attempts"])


@pytest.mark.parametrize("env,failed", [
    # the window differs only after the shift, only with q8_0 K (the shift graph's cast path)
    ({"FAKE_DUMP_SHIFT_DIFF": "q8_0"}, ["q8_0 shift+state: logits identical (max |diff| == 0)"]),
    # a dump that takes the flags but shifts nothing and restores nothing
    ({"FAKE_DUMP_IGNORE_SHIFT": "1"}, [f"{kv} shift+state: both dumps say the shift and the state round trip happened"
                                       for kv in ("f16", "q8_0")]),
    # patch 0001: a K-shift that cannot be applied fails the decode (-3)
    ({"FAKE_DUMP_SHIFT_FAIL": "window"}, [f"{kv} shift+state: window run succeeds" for kv in ("f16", "q8_0")]),
])
def test_resident_parity_shift_variant_fails_on_exactly_its_check(tmp_path, monkeypatch, env, failed):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), parity_gen=4)
    res = run_one("resident-parity", ctx)
    assert res.verdict == "fail"
    assert [c.name for c in res.checks if not c.ok] == failed
    if "FAKE_DUMP_SHIFT_DIFF" in env:
        sh = res.results["kv_q8_0"]["shift+state"]["compare"]
        assert sh["first_diff_row"] == 2 and sh["n_diff"] == 1 and sh["max_abs_diff"] > 0
        assert res.results["kv_q8_0"]["compare"]["max_abs_diff"] == 0.0
    if "FAKE_DUMP_SHIFT_FAIL" in env:
        for kv in ("f16", "q8_0"):
            sh = res.results[f"kv_{kv}"]["shift+state"]
            assert sh["window"]["rc"] == 1 and sh["resident"]["rc"] == 0 and "compare" not in sh
            assert "ret = -3" in (ctx.work / f"window-{kv}-shift.log").read_text()


def test_resident_parity_fails_where_pass_2_allocates_more_than_pass_1_measured(tmp_path, monkeypatch):
    """The window is sized for pass 1's measured compute buffer: a larger allocation after pass 2 (an H100 found one
    staged f16 K/V of a layer more, reports/2026-12-07-h100-d) fails exactly that check, with the numbers, for
    both K/V types; without it the check holds (test_resident_parity_identical)."""
    monkeypatch.setenv("FAKE_PASS2_COMPUTE_EXTRA_MIB", "64")
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), parity_gen=4)
    res = run_one("resident-parity", ctx)
    assert res.verdict == "fail"
    bad = [c for c in res.checks if not c.ok]
    assert [c.name for c in bad] == [f"{kv}: the compute buffer allocated after pass 2 is no larger than pass 1 "
                                     "measured" for kv in ("f16", "q8_0")]
    assert all("MiB allocated" in c.detail and "MiB measured" in c.detail for c in bad), [c.detail for c in bad]


def test_resident_parity_detects_a_difference(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DUMP_DIFF", "1")
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), parity_gen=4)
    ctx.env = dict(os.environ)
    res = run_one("resident-parity", ctx)
    assert res.verdict == "fail"
    bad = [c for c in res.checks if not c.ok]
    assert any("logits identical" in c.name for c in bad)
    assert res.results["kv_f16"]["compare"]["first_diff_row"] == 3


def test_resident_parity_auto_where_the_kv_fits(tmp_path, monkeypatch):
    """The packaged default (-krm auto, no --vram-target) keeps a KV that fits FULLY RESIDENT and gives
    the resident logits; a difference there fails exactly that pair's identity checks."""
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), parity_gen=4)
    res = run_one("resident-parity", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    for kv in ("f16", "q8_0"):
        auto = res.results[f"kv_{kv}"]["auto_fits"]
        assert auto["window"]["fully_resident"] and auto["compare"]["max_abs_diff"] == 0.0
        assert any(c.endswith("-krm auto") and f"-ctk {kv}" in c for c in res.commands)
    monkeypatch.setenv("FAKE_DUMP_AUTO_DIFF", "1")
    (tmp_path / "diff").mkdir()
    ctx = ctx_for(tmp_path / "diff", model=str(_prompt_model(tmp_path)), parity_gen=4)
    ctx.env = dict(os.environ)
    res = run_one("resident-parity", ctx)
    assert [c.name for c in res.checks if not c.ok] == [
        f"{kv} auto (fits): logits identical (max |diff| == 0)" for kv in ("f16", "q8_0")]


def test_resident_parity_mode_auto_runs_the_tailed_runs_in_auto(tmp_path):
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), parity_gen=4, parity_mode="auto")
    res = run_one("resident-parity", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    tailed = [c for c in res.commands if "--vram-target" in c and "--vram-target 1" not in c]
    assert tailed and all("-krm auto --vram-target" in c for c in tailed)
    assert res.results["kv_f16"]["window"]["tail_fraction"] >= 0.5


def _sizer(margin, kv_mib=2048.0, cells=4096, granule_cells=1, swa_mib=0.0, model=1000.0):
    """A sizer with an unknown margin and C rounded down to granules; records the targets tried."""
    calls = []
    per_cell = kv_mib / cells

    def run(t):
        calls.append(t)
        c = int((t - model - margin - swa_mib) / per_cell) // granule_cells * granule_cells
        if c <= 0:
            return False, None
        if c >= cells:
            return True, logparse.Window(True, cells, cells, kv_mib, 0.0)
        return True, logparse.Window(False, cells, c, c * per_cell, (cells - c) * per_cell)
    return run, calls


@pytest.mark.parametrize("model,margin,estimate,kv,granule", [
    (1000, 0, 5000, 2048.0, 1), (1000, 900, 1200, 2048.0, 1), (1000, 300, 1100, 2048.0, 1),
    # a tiny KV (Gemma 270M global layers at 8k: 24 MiB) behind a large compute reserve + margin
    (241, 820, 1004, 24.0, 1), (241, 820, 1004, 24.0, 2048), (241, 820, 700, 24.0, 1024),
    (241, 820, 1500, 24.0, 1024),
    # a large KV from far below / above
    (14179, 5500, 20000, 98304.0, 1), (14179, 5500, 200000, 98304.0, 1),
])
def test_search_vram_target_converges(model, margin, estimate, kv, granule):
    run, calls = _sizer(margin, kv_mib=kv, granule_cells=granule, model=model)
    t, w = sizing.search_vram_target(run, estimate, kv, tries=12)
    assert t is not None and 0.5 <= w.tail_fraction <= 0.97, (calls, t)


def test_search_vram_target_gives_up():
    run, calls = _sizer(10**6)  # never boots
    assert sizing.search_vram_target(run, 1000, 2048.0, tries=3) == (None, None)
    assert len(calls) == 3
    # 2 granules per tensor and a tail window [0.6, 0.97]: only 0 or 50 % tail is possible
    run, calls = _sizer(64, cells=4096, granule_cells=2048)
    assert sizing.search_vram_target(run, 3000, 2048.0, lo=0.6, tries=30) == (None, None)
    assert len(calls) < 30  # stops once the bracket is a single MiB


def test_run_logged_kills_the_whole_group_on_timeout(tmp_path):
    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(c.pid, flush=True)\n"
              "time.sleep(60)\n")
    t0 = time.monotonic()
    p = process.run_logged([sys.executable, "-c", script], tmp_path / "sleep", timeout=2)
    assert p.timed_out and p.rc is None and time.monotonic() - t0 < 30
    child = int(p.stdout.split()[0])
    time.sleep(0.2)
    assert not pid_running(child)


def pid_running(pid: int) -> bool:
    """True when pid exists and is not a zombie (a killed orphan waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_report_schema_and_exit_status(tmp_path, monkeypatch):
    ctx_dir = tmp_path / "reports"
    probe = gpu_mod.GPUProbe(gpus=[fake_gpu()], driver_version="580.159", cuda_driver_version="13.0")
    gemma = tmp_path / "g.gguf"
    gemma.write_bytes(b"GGUF")
    reps, rdir = run_gates(["needle"], [fake_gpu()], build=FAKE, work=tmp_path / "w", reports=ctx_dir,
                           probe=probe, gemma=gemma, options={"needle_ctx": 2048, "plant_failure": True},
                           env=dict(os.environ))
    assert rdir == ctx_dir
    js = json.loads((ctx_dir / "needle-gpu0.json").read_text())
    for k in REQUIRED:
        assert k in js, k
    assert js["schema_version"] == report.SCHEMA_VERSION and js["verdict"] == "fail"
    assert js["gpu"]["uuid"] == "GPU-fake-0000" and js["driver"] == {"version": "580.159", "cuda": "13.0"}
    assert any("llama-server" in c for c in js["commands"])
    md = (ctx_dir / "needle-gpu0.md").read_text()
    assert md.startswith("# needle: FAIL") and "| window found | identical |" in md
    run = json.loads((ctx_dir / "run.json").read_text())
    assert run["verdict"] == "fail"
    # the CLI turns a failed gate into GateFailure (exit code 9)
    from rollkv_dist.gates.command import _cmd

    monkeypatch.setattr(gpu_mod, "probe", lambda: probe)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = gates_args("--gates", "needle", "--build", str(FAKE), "--work", str(tmp_path / "w2"),
                      "--reports", str(tmp_path / "r2"), "--gemma", str(gemma), "--plant-failure",
                      "--needle-ctx", "2048", "--needle-depths", "0.5")
    with pytest.raises(GateFailure) as ei:
        _cmd(args)
    assert ei.value.exit_code == 9
    args.plant_failure = False
    assert _cmd(args) == 0


def gates_args(*argv: str):
    """`rollkv gates ARGV` parsed by the real CLI parser."""
    import argparse

    from rollkv_dist.gates.command import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["gates", *argv])


def test_gates_cli_hands_the_staging_options_to_the_gates():
    from rollkv_dist.gates.base import option_values

    args = gates_args("--build", "B", "--kv-types", "q8_0", "--speed-off-max-depth", "65536", "--ubatch-sweep",
                      "none", "--curve-shape", "qwen2.5-14b-1m", "--curve-ubatch", "4096", "--curve-staging", "auto",
                      "--curve-no-nkvo", "--curve-fractions", "0.6,0.4", "--prefill-vs-resident", "75",
                      "--prefill-vs-nkvo", "3", "--decode-vs-link", "90", "--f16-decode-floor", "98",
                      "--curve-decode-tolerance", "5", "--ab-tolerance", "3")
    assert option_values(args) == {
        "kv_types": "q8_0", "speed_off_max_depth": 65536, "ubatch_sweep": "none", "curve_shape": "qwen2.5-14b-1m",
        "curve_ubatch": 4096, "curve_staging": "auto", "curve_nkvo": False, "curve_fractions": "0.6,0.4",
        "prefill_vs_resident_pct": 75.0, "prefill_vs_nkvo": 3.0, "decode_vs_link_pct": 90.0,
        "f16_decode_floor_pct": 98.0, "curve_decode_tolerance_pct": 5.0, "ab_tolerance_pct": 3.0}
    # unset options are left out (a switch too), so every gate applies its own default
    assert option_values(gates_args("--build", "B")) == {}
    with pytest.raises(SystemExit):
        gates_args("--build", "B", "--curve-shape", "nope")


def test_every_option_a_gate_reads_has_a_flag_and_a_misspelt_one_is_an_error(tmp_path):
    """Before: nine option keys had no flag, and a misspelt key fell back to the default silently."""
    from rollkv_dist.gates.runner import run_gate
    from rollkv_dist.gates.base import option_names, registry

    names = set(option_names())
    for extra in ("model", "parity_shape", "parity_words", "parity_gen", "parity_ctx", "speed_shape", "n_predict",
                  "seed", "window_test_timeout"):
        assert extra in names, extra
    args = gates_args("--build", "B", "--parity-gen", "4", "--window-test-timeout", "30", "--model", "m.gguf")
    assert {k: getattr(args, k) for k in ("parity_gen", "window_test_timeout", "model")} == {
        "parity_gen": 4, "window_test_timeout": 30.0, "model": "m.gguf"}
    # a gate reads its options as attributes of its dataclass: defaults, values given, nothing else
    o = registry()["needle"].make_options({"needle_ctx": 2048, "reps": 1})
    assert (o.needle_ctx, o.needle_depths, o.plant_failure) == (2048, "0.3,0.6,0.9", False)
    assert not hasattr(o, "reps") and not hasattr(o, "needle_cxt")
    with pytest.raises(UsageError, match="unknown gate option.*needle_cxt"):
        run_gate("needle", ctx_for(tmp_path, needle_cxt=2048))
    with pytest.raises(UsageError, match="needle_ctx='2048': expected a value of type int"):
        run_gate("needle", ctx_for(tmp_path, needle_ctx="2048"))
    with pytest.raises(UsageError, match="unknown gate option"):
        run_gates(["needle"], [fake_gpu()], build=FAKE, work=tmp_path / "w", reports=tmp_path / "r", probe=None,
                  options={"plant_failur": True})
    assert not (tmp_path / "r").exists()


def test_gate_names_and_missing_binary(tmp_path):
    assert parse_gate_list("needle,curve") == ["needle", "curve"]
    assert parse_gate_list(None)[0] == "engine" and parse_gate_list("all") == list(DEFAULT_GATES)
    with pytest.raises(UsageError):
        parse_gate_list("needle,nope")
    with pytest.raises(UsageError, match="llama-bench not found"):
        context.find_bin(tmp_path, "llama-bench")


def test_needle_prompt_shape():
    p, prefix = needle.build_prompt(3, 2, 68421)
    assert p.startswith(needle.HEADER) and p.endswith("What is the pass key? The pass key is")
    assert "The pass key is 68421. Remember it." in p and p.index("68421") > len(prefix) - 1
    assert needle.answer_has(" 68421. Remember it.", 68421)
    assert not needle.answer_has(" 12345, not 68421", 68421)
    assert not needle.answer_has(" I don't know", 68421)


def test_parity_prompt_is_deterministic_and_long():
    a = resident_parity.make_prompt(18000)
    assert a == resident_parity.make_prompt(18000) and a != resident_parity.make_prompt(18000, seed=1)
    assert 17000 <= len(a.split()) <= 18000


def test_curve_end_to_end_with_fake_bench(tmp_path):
    pytest.importorskip("matplotlib")
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), reps=1)
    res = run_one("curve", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    results = report_results(res)
    pts = [p for p in results["points"] if p["decode_tps"]]
    assert len(pts) >= 4
    tails = [p["host_tail_mib"] for p in pts]
    assert tails == sorted(tails) and tails[-1] > 0  # targets sweep down: the tail grows
    # targets start from what the engine logs it keeps (model + reserve + margin) for a -vt 1 probe that
    # stages like the points, so the sweep begins near fully resident instead of deep in the tail
    nw = logparse.parse_log((ctx.work / "window-vt1-probe.err").read_text()).no_window
    assert results["fixed_mib"] == nw["model"] + nw["compute_reserve"] + nw["margin"]
    assert "-kts auto,off -krm window -vt 1" in res.commands[1]
    assert tails[0] <= 0.25 * tails[-1] and len(set(tails)) >= 3
    # decode and prefill are read from their own llama-bench contexts (depth + 64 and depth + 512 cells),
    # for auto (after) and off (before) alike
    for p in pts:
        for m in (p, p["off"]):
            assert m["window"]["kv_size"] == 16384 + 256 and m["prefill_window"]["kv_size"] == 16384 + 512
            assert m["prefill_host_tail_mib"] == m["prefill_window"]["host_tail_mib"]
    decode = [p["decode_tps"] for p in pts]
    assert decode == sorted(decode, reverse=True)
    # the link rate comes from the zero-copy (off) decodes, which the fake reads at 51 GB/s
    link = results["link"]
    assert link["measured"] and "-kts off" in link["source"] and link["gbps"] == pytest.approx(51.0, rel=0.01)
    for p in pts:
        # f16 decode with auto: zero-copy (on the link-rate line) where less than a quarter of the cells a
        # token reads are in the tail, staged with the prefetch (above the line, below the overlap line) where more
        w = p["window"]
        used = 16384 + 32
        if 4 * (used - w["cells_resident"]) >= used:
            assert p["limit_decode_tps"] < p["decode_tps"] <= p["overlap_decode_tps"]
        else:
            assert p["decode_tps"] == pytest.approx(p["limit_decode_tps"], rel=0.01)
        assert p["prefill_over_resident"] == round(p["prefill_tps"] / results["resident"]["prefill_tps"], 3)
    assert results["nkvo"]["decode_tps"] == 14.0
    png = Path(res.plots[0])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert all("-v" in c and "-o json" in c for c in res.commands)
    assert all(c.endswith("-kts auto,off") for c in res.commands if "-krm window -vt" in c and "-vt 1 " not in c + " ")


class StubBallast:
    """Stands in for the libcuda ballast (no GPU here)."""

    def __init__(self, leave_free_mib, **kw):
        self.leave_free_mib = leave_free_mib
        self.held_mib, self.free_mib, self.total_mib = 50000, leave_free_mib, 143771

    def command(self):
        return ["python", "-m", "rollkv_dist.ballast", "--leave-free", str(self.leave_free_mib)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_boot_repro_end_to_end(tmp_path, monkeypatch):
    from rollkv_dist import ballast

    monkeypatch.setattr(ballast, "Ballast", StubBallast)
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), vram_target=3000, emulate_vram=3500)
    ctx.baseline_build = FAKE.parent / "fake_llama_baseline"
    res = run_one("boot-repro", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    r = res.results
    assert not r["baseline"]["booted"] and r["baseline"]["graph_reserve_failed"]
    assert r["full"]["n_ctx"] == 524288 and r["full"]["window"]["host_tail_mib"] > 0
    assert r["measured_compute_mib"] == 800.0 and r["seed_compute_bytes"] == 3_800_045_568
    assert r["boot_ms"] == {"pass1": 12.5, "pass2": 40.0, "server_health_s": r["full"]["boot_seconds"]}
    assert r["resident_fit"]["window"]["fully_resident"] and r["resident_fit"]["reserve"]["single_pass"]
    dm, df = r["default_ubatch"]["measured"], r["default_ubatch"]["fixed_1536"]
    assert dm["window"]["cells_resident"] > df["window"]["cells_resident"]
    assert any("--kv-compute-reserve 1536" in c for c in res.commands)
    assert any("-b 4096 -ub 4096" in c and "--kv-unified" in c for c in res.commands)


def test_boot_repro_fails_when_the_baseline_boots(tmp_path, monkeypatch):
    from rollkv_dist import ballast

    monkeypatch.setattr(ballast, "Ballast", StubBallast)
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), vram_target=3000)
    ctx.baseline_build = FAKE  # a "baseline" that boots: no repro
    res = run_one("boot-repro", ctx)
    assert res.verdict == "fail"
    assert [c.name for c in res.checks if not c.ok] == ["baseline fails in graph_reserve"]


def test_boot_repro_figures_follow_the_card():
    from rollkv_dist.gates.boot_repro import card_figures

    assert card_figures(143771) == (90000, 88000)  # the H200: today's figures, past reports stay comparable
    assert card_figures(98304) == (90000, 88000)  # the seed's 96 GB card
    emulate, target = card_figures(81559)  # an 80 GB card: scaled, the gap kept, below its memory
    assert (emulate, target) == (int(90000 * 81559 / 98304), int(90000 * 81559 / 98304) - 2000)
    assert emulate < 81559 - 4000
    assert card_figures(143771, emulate=97000) == (97000, 95000)
    assert card_figures(143771, target=3000) == (5000, 3000)


class HeldNothing(StubBallast):
    def __init__(self, leave_free_mib, **kw):
        super().__init__(leave_free_mib)
        self.held_mib, self.free_mib = 0, leave_free_mib - 4000  # the card had less free than asked


def test_boot_repro_ballast_that_held_nothing_fails_and_a_small_card_skips(tmp_path, monkeypatch):
    """Before: on an 80 GB card the 90000 MiB ballast held nothing and its check passed anyway."""
    from rollkv_dist import ballast

    monkeypatch.setattr(ballast, "Ballast", HeldNothing)
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), vram_target=3000)
    res = run_one("boot-repro", ctx)
    assert [c.name for c in res.checks if not c.ok] == ["ballast holds memory and leaves the emulated free memory"]
    (tmp_path / "small").mkdir()
    small = ctx_for(tmp_path / "small", model=str(_prompt_model(tmp_path)))
    small.gpu = gpu_mod.GPUInfo(index=0, uuid="GPU-fake-0000", name="NVIDIA T4", memory_total=15 << 30,
                                memory_free=15 << 30, compute_capability=(7, 5))
    res = run_one("boot-repro", small)
    assert res.verdict == "skip" and res.checks == [] and res.commands == []
    assert "too small" in res.notes[0] and "15360 MiB" in res.notes[0]


def test_group_alive_sees_running_members_only():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        time.sleep(0.2)
        assert proc.group_alive(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not proc.group_alive(p.pid)


class _Tok:
    """A tokenizer whose filler units cost more in context than alone (like BPE merges can)."""

    def tokenize(self, text, add_special=True):
        n = len(text.split()) + text.count(".") * 2 + (len(text) // 100) ** 2 // 100  # superlinear
        return list(range(n + (1 if add_special else 0)))


def test_needle_place_fits_the_budget():
    p = needle.place(_Tok(), 500, 2000, 12345)
    assert 2000 - 2 * 30 <= p["n_prompt"] <= 2000 and p["needle_pos"] >= 400
    assert p["prompt"].endswith(needle.QUESTION)


def test_gates_refuse_a_build_without_the_engine_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NO_ENGINE_FLAGS", "1")
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), needle_ctx=2048)
    ctx.env = dict(os.environ)
    for gate in ("needle", "curve", "speed"):
        res = run_one(gate, ctx)
        bad = [c for c in res.checks if not c.ok]
        assert res.verdict == "fail" and len(bad) == 1, gate
        assert "--kv-residency-mode" in bad[0].name and "not a rolling-KV build" in bad[0].detail
        # the --help run is a registered process group like every other child
        assert res.checks[-1].name.startswith("no process left running") and res.checks[-1].ok


def test_window_refusal_stops_the_search(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_WINDOW_REFUSED", "1")
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), parity_gen=4)
    ctx.env = dict(os.environ)
    res = run_one("resident-parity", ctx)
    assert res.verdict == "fail"
    bad = [c for c in res.checks if not c.ok]
    assert bad[0].name == "gate ran to completion" and "needs a GPU backend" in bad[0].detail
    assert sum("-krm window" in c for c in res.commands) == 1  # no pointless search


def test_no_window_error_gives_the_exact_target():
    text = ("llama_init_from_model: failed to initialize the context: window mode: no device memory left for the "
            "KV window on CUDA0 (free 97000 MiB, vram target 2000 MiB, model 1564 MiB, compute reserve 556 MiB, "
            "margin 64 MiB): raise --vram-target, free device memory or offload fewer layers\n")
    log = logparse.parse_log(text)
    assert log.no_window == {"device": "CUDA0", "free": 97000, "vram_target": 2000, "model": 1564,
                             "compute_reserve": 556, "margin": 64}
    ok, w = sizing.window_outcome(log, False)
    assert not ok and w is None
    # the engine's own numbers are the fixed part of every target (sizing.py): no copied margin
    [fixed] = sizing.fixed_parts(log).values()
    assert (fixed.device, fixed.model, fixed.other_kv, fixed.compute_reserve, fixed.margin) == (
        "CUDA0", 1564, 0.0, 556, 64)
    assert sizing.vram_target(fixed, (1 - 0.735) * 688.0, 56) == int(1564 + 556 + 64 + (1 - 0.735) * 688.0 + 56 * 2)
    refused = logparse.parse_log("E llama_init_from_model: --kv-residency-mode window supports one KV stream: "
                                 "add --kv-unified or use -np 1 (n_seq_max = 4)\n")
    with pytest.raises(sizing.WindowRefused, match="one KV stream"):
        sizing.window_outcome(refused, False)


def test_search_follows_the_engines_hint():
    calls = []

    def run(t):
        calls.append(t)
        c = int((t - 2184) / 0.028)  # model + reserve + margin = 2184 MiB, 0.028 MiB per cell
        if c <= 0:
            return False, None, int(2184 + 0.265 * 688) + 1
        c = min(c, 24576)
        if c == 24576:
            return True, logparse.Window(True, c, c, 688.0, 0.0)
        return True, logparse.Window(False, 24576, c, c * 0.028, (24576 - c) * 0.028)

    t, w = sizing.search_vram_target(run, 1500, 688.0)
    assert calls == [1500, t] and 0.5 <= w.tail_fraction <= 0.97


def _gates_args(tmp_path, **over):
    """`rollkv gates` arguments from the real CLI parser (every option the gates read), with `over`
    set as the parser would."""
    args = gates_args("--gates", "needle,resident-ab", "--build", "/nonexistent/prefix", "--work",
                      str(tmp_path / "w"), "--reports", str(tmp_path / "r"))
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("over,message", [
    ({}, "--build /nonexistent/prefix does not exist"),
    ({"build": "EMPTY"}, "llama-server not found under"),
    ({"build": str(FAKE), "gates": "resident-ab", "upstream_build": "EMPTY"}, "llama-bench not found under"),
    ({"build": str(FAKE), "gates": "boot-repro", "baseline_build": "/nonexistent/b"}, "--baseline-build"),
    ({"build": str(FAKE), "gates": "needle", "gemma": "/nonexistent/g.gguf"}, "--gemma"),
])
def test_gates_with_missing_inputs_are_a_usage_error_up_front(tmp_path, monkeypatch, over, message):
    """Before: `--build /nonexistent` passed needle and resident-ab as SKIP (exit 0)."""
    from rollkv_dist.gates.command import _cmd

    probe = gpu_mod.GPUProbe(gpus=[fake_gpu()], driver_version="580.159", cuda_driver_version="13.0")
    monkeypatch.setattr(gpu_mod, "probe", lambda: probe)
    (tmp_path / "empty").mkdir()
    over = {k: str(tmp_path / "empty") if v == "EMPTY" else v for k, v in over.items()}
    with pytest.raises(UsageError, match=message) as ei:
        _cmd(_gates_args(tmp_path, **over))
    assert ei.value.exit_code == 2
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists(), "a gate ran or wrote something"


def test_boot_repro_checks_its_binaries_before_writing_the_model(tmp_path, monkeypatch):
    from rollkv_dist.gates import boot_repro

    written = []
    monkeypatch.setattr(boot_repro, "ensure_random_model", lambda *a, **k: written.append(a) or "m.gguf")
    (tmp_path / "empty").mkdir()
    ctx = ctx_for(tmp_path)
    ctx.build = tmp_path / "empty"
    with pytest.raises(UsageError, match="llama-server not found"):
        run_one("boot-repro", ctx)
    assert written == []
    ctx.build, ctx.baseline_build = FAKE, tmp_path / "empty"  # the baseline's binary too
    with pytest.raises(UsageError, match="llama-server not found"):
        run_one("boot-repro", ctx)
    assert written == []


@pytest.mark.parametrize("gate", ["needle", "speed", "curve", "resident-parity"])
def test_an_unreadable_log_line_fails_the_gate(tmp_path, monkeypatch, gate):
    """Before: the line was skipped and its size read as 0 by the --vram-target estimate."""
    monkeypatch.setenv("FAKE_EXTRA_LOG", "sched_reserve:      CUDA0 compute buffer size = 1,234.50 MB")
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), needle_ctx=2048, reps=1, speed_depths="16384",
                  parity_gen=4)
    ctx.env = dict(os.environ)
    res = run_one(gate, ctx)
    assert res.verdict == "fail"
    bad = [c for c in res.checks if not c.ok]
    assert [c.name for c in bad] == ["gate ran to completion"]
    assert "LogParseError" in bad[0].detail and "unknown size unit 'MB'" in bad[0].detail
    assert str(ctx.work) in bad[0].detail  # names the log file (and line)


def test_needle_sizes_from_its_own_devices_kv(tmp_path, monkeypatch):
    """KV of another device must not be added to the window search's KV (it was summed)."""
    monkeypatch.setenv("FAKE_EXTRA_LOG", "llama_kv_cache:      CUDA1 KV buffer size =  5000.00 MiB")
    ctx = ctx_for(tmp_path, needle_ctx=2048)
    ctx.env = dict(os.environ)
    res = run_one("needle", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    assert res.results["resident_kv_mib"] == pytest.approx(2048 * 0.01)  # the fake's CUDA0 KV
