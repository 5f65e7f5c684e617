"""The log lines logparse reads, rendered from the format strings in patches/*.patch.

tests/data/fake_llama/bin/_formats.py finds each format on the `+` lines of the series (the fakes
print through it too). A patch that rewords one of these lines either loses its fragment (LookupError
here) or changes the line so that the parser no longer reads the values back: both fail this test,
so the parser and the engine cannot drift apart unnoticed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollkv_dist.errors import LogParseError
from rollkv_dist.gates import logparse as lp
from rollkv_dist.gates import sizing

sys.path.insert(0, str(Path(__file__).parent / "data" / "fake_llama" / "bin"))
import _formats as F  # noqa: E402


@pytest.mark.parametrize("name", sorted(F.FRAGMENTS))
def test_every_format_is_found_once_in_the_series(name):
    fmt = F.c_format(name)
    assert F.FRAGMENTS[name] in fmt


@pytest.mark.parametrize("suffix", [("", ""), (" on ", "CUDA1")])
def test_window_lines(suffix):
    line = F.render("window", "llama_kv_residency_alloc", 123904, 524288, 23232.0, 75072.0, *suffix)
    full = F.render("window_full", "operator()", 32768, 896.0, *suffix)
    log = lp.parse_log(line + "\n" + full + "\n")
    w, f = log.windows
    assert (w.cells_resident, w.kv_size, w.device_mib, w.host_tail_mib, w.fully_resident) == (
        123904, 524288, 23232.0, 75072.0, False)
    assert (f.kv_size, f.cells_resident, f.device_mib, f.fully_resident) == (32768, 32768, 896.0, True)
    assert w.device == f.device == (suffix[1] or None)


def test_a_single_pass_made_again_keeps_only_the_second_making():
    """0097: a single pass whose estimate fell short makes the context's caches again; the first making's budget and
    window lines no longer describe the context, and the parser keeps the second's alone (and earlier contexts')."""
    def making(budget: int, cells: int) -> list[str]:
        return [F.render("budget", "llama_kv_residency_alloc", "CUDA0", 9000, 0, 3000, 0, 4000, 256, budget),
                F.render("window", "llama_kv_cache", cells, 4096, 1.0 * cells, 4096.0 - cells, "", "")]
    earlier = making(100, 100)
    lines = (earlier + ["llama_context: constructing llama_context"] + making(1744, 1744)
             + [F.render("single_pass", "llama_context", 4000.0),
                F.render("scratch", "kv_compute_need", "CUDA0", 2000.0, 1968.0, 32.0),
                F.render("single_pass_short", "llama_context", "CUDA0", 4556.0, 2300.0, 2000.0, 256, 4000.0)]
             + making(1188, 1188))
    log = lp.parse_log("\n".join(lines))
    assert [w.cells_resident for w in log.windows] == [100, 1188]
    assert [b["budget"] for b in log.budgets] == [100.0, 1188.0]
    assert log.reserve.single_pass and log.reserve.single_pass_short == {"CUDA0": 4556.0}


def test_budget_and_no_window_lines():
    budget = F.render("budget", "llama_kv_residency_alloc", "CUDA1", 80000, 88000, 14179, 12, 5240, 256, -68325)
    err = F.render("no_window", "CUDA1", 80000, 1, 14179, 5240, 256)
    log = lp.parse_log(budget + "\nllama_init_from_model: failed to initialize the context: " + err + "\n")
    assert log.budgets == [{"device": "CUDA1", "free": 80000.0, "vram_target": 88000.0, "model": 14179.0,
                            "other_kv": 12.0, "compute_reserve": 5240.0, "margin": 256.0, "budget": -68325.0}]
    assert log.no_window == {"device": "CUDA1", "free": 80000, "vram_target": 1, "model": 14179,
                             "compute_reserve": 5240, "margin": 256}


def test_reserve_and_staging_lines():
    lines = [F.render("staging", "llama_context", "auto"),
             F.render("pass1", "llama_context", "CUDA0", 4984.08, 6.5),
             F.render("pass2_sizes", "llama_context", 5240.08, 4984.08, 0.0, 256),
             F.render("pass1", "llama_context", "CUDA1", 623.0, 6.4),
             F.render("pass2_sizes", "llama_context", 911.0, 623.0, 32.0, 256),
             F.render("scratch", "kv_compute_need", "CUDA1", 32.0, 0.0, 32.0),
             F.render("pass2_done", "llama_context", 812.0)]
    r = lp.parse_log("\n".join(lines)).reserve
    assert r.by_device["CUDA1"] == {"measured_mib": 623.0, "ms": 6.4, "reserve_mib": 911.0, "measured2_mib": 623.0,
                                    "scratch_mib": 32.0, "safety_mib": 256.0}
    assert r.scratch == {"CUDA1": {"scratch_mib": 32.0, "pool_mib": 0.0, "kept_mib": 32.0}}
    assert (r.pass1_device, r.pass2_reserve_mib, r.pass2_ms) == ("CUDA0", 5240.08, 812.0)
    single = lp.parse_log(F.render("single_pass", "llama_context", 1896.25)).reserve
    assert single.single_pass and single.single_pass_bound_mib == 1896.25
    assert lp.parse_log(F.render("fixed_reserve", "llama_context", 1536.0)).reserve.fixed_mib == 1536.0


@pytest.mark.parametrize("name,args", [
    ("refuse_gpu", ("llama_init_from_model",)),
    ("vram_target_count", ("llama_init_from_model", 3, 2, "CUDA0, CUDA1")),
])
def test_refusals_stop_the_search(name, args):
    log = lp.parse_log(F.render(name, *args) + "\n")
    assert log.window_refused and log.window_refused in F.render(name, *args)


def test_vram_target_count_error_names_both_counts():
    log = lp.parse_log(F.render("vram_target_count", "llama_init_from_model", 3, 2, "CUDA0, CUDA1"))
    assert "has 3 values but the model uses 2 GPU device(s) (CUDA0, CUDA1)" in log.window_refused


def test_window_test_lines():
    out = lp.parse_window_test("\n".join([
        F.render("wt_pass", "CUDA0: granularity", "", ""),  # PASS <check>[: <detail>] (0012)
        F.render("wt_fail", "CUDA1: memset across the boundary", "bytes not set"),
        F.render("wt_skip", "CUDA0: copy out of a window buffer into another device", "one GPU"),
        F.render("wt_summary", 2, 1, " (GGML_CUDA_P2P set)")]))
    assert [(c.status, c.name, c.detail) for c in out.checks] == [
        ("PASS", "CUDA0: granularity", ""), ("FAIL", "CUDA1: memset across the boundary", "bytes not set"),
        ("SKIP", "CUDA0: copy out of a window buffer into another device", "one GPU")]
    assert out.summary == lp.WindowTestSummary(2, 1, True)


def test_a_changed_format_fails_the_parser():
    """What this file guards against: a patch that prints the window line in another form."""
    changed = F.py_format("window").replace("cells resident", "cells on the device") % (
        "f", 1, 2, 1.0, 1.0, "", "")
    with pytest.raises(LogParseError, match="position window"):
        lp.parse_log(changed)


def test_residency_lines():
    """Patch 0090's lines: where auto went and the memory it saw; a requirement's line names none."""
    mem = "hybrid (an attention KV cache beside recurrent state)"
    win = lp.parse_log(F.render("residency_window", "kv_residency_resolve", mem)).residency
    assert (win.origin, win.to, win.memory) == ("auto", "window", mem)
    res = lp.parse_log(F.render("residency_resident", "kv_residency_resolve", "window",
                                "recurrent state only (no attention KV cache)", "so there is nothing to window")).residency
    assert (res.origin, res.to, res.memory) == ("window", "resident", "recurrent state only (no attention KV cache)")
    req = lp.parse_log(F.render("residency_requirement", "llama_init_from_model", "there is no GPU device")).residency
    assert (req.origin, req.to, req.memory, req.detail) == ("auto", "resident", None, "there is no GPU device")
    with pytest.raises(LogParseError, match="kv residency"):
        lp.parse_log("llama_context: kv residency: auto -> somewhere")


def test_the_stand_in_hook_makes_the_cpu_the_window_device():
    """Patch 0092: with LLAMA_KV_TEST_HOST_DEVICE_MIB the engine warns, and the gates size the CPU's KV as a window."""
    from rollkv_dist.gates import sizing

    text = ("llama_kv_test_host_device: LLAMA_KV_TEST_HOST_DEVICE_MIB=4000: the CPU stands in for a GPU with 4000 MiB "
            "for KV windows (a test hook: the window is a plain host buffer)\n"
            "llama_kv_cache:        CPU KV buffer size =    16.00 MiB\n"
            "llama_kv_cache: size =   16.00 MiB (  8192 cells,   2 layers,  1/1 seqs), K (f16):    8.00 MiB, V (f16):    8.00 MiB")
    log = lp.parse_log(text)
    assert log.stand_in and [(d.device, d.kv_mib, d.n_tensors) for d in sizing.devices_of(log)] == [("CPU", 16.0, 4)]
    plain = lp.parse_log(text.split("\n", 1)[1])  # without the hook the CPU's KV is no window's
    assert not plain.stand_in
    with pytest.raises(LogParseError):
        sizing.devices_of(plain)


def test_the_transposed_v_line():
    """Patch 0093: with -fa off the engine keeps V whole on each device and says how much, per device."""
    text = "\n".join(F.render("v_on_device", "llama_kv_residency_alloc", d, mib) for d, mib in (("CUDA0", 512),
                                                                                               ("CUDA1", 256)))
    assert lp.parse_log(text).v_on_device_mib == {"CUDA0": 512, "CUDA1": 256}
    assert lp.parse_log(F.render("budget", "llama_kv_residency_alloc", "CUDA0", 1, 2, 3, 4, 5, 6, 7)).v_on_device_mib == {}
    with pytest.raises(LogParseError, match="V is stored transposed"):
        lp.parse_log("llama_kv_residency_alloc: CUDA0: flash attention is off, so V is stored transposed: all of it")


def test_prompt_cache_lines():
    """Patch 0095 with 0101's wording: beside a host tail llama-server lowers its prompt cache limit to the host memory
    left once what the tail may still pin is counted (or says that it fits); the parser reads the limit before and
    after, the available MiB and the tail's unpinned MiB; a reworded line is an error."""
    log = lp.parse_log("srv  load_model: " + F.render("prompt_cache_lowered", "8192 MiB", 3000, "", 4096, 72, 1024))
    assert log.prompt_cache == {"was": 8192, "limit": 3000, "available": 4096, "to_pin": 72, "lowered": True}
    log = lp.parse_log("srv  load_model: " + F.render("prompt_cache_lowered", "no limit", 0, " (disabled)", 512, 0, 1024))
    assert log.prompt_cache == {"was": None, "limit": 0, "available": 512, "to_pin": 0, "lowered": True}
    log = lp.parse_log("srv  load_model: " + F.render("prompt_cache_fits", 2048, 100000, 5000))
    assert log.prompt_cache == {"was": 2048, "limit": 2048, "available": 100000, "to_pin": 5000, "lowered": False}
    assert lp.parse_log("srv  load_model: prompt cache is enabled, size limit: 8192 MiB").prompt_cache is None
    with pytest.raises(LogParseError, match="prompt cache limit"):
        lp.parse_log("srv  load_model: rolling KV: prompt cache limit lowered a bit")
    with pytest.raises(LogParseError, match="prompt cache limit"):  # 0095's wording before 0101 is read no more
        lp.parse_log("srv  load_model: rolling KV: prompt cache limit 8192 MiB fits beside the pinned KV host tail "
                     "(9000 MiB available)")


def test_v_whole_refused_line():
    """Patch 0093: a V kept whole (flash attention off) that needs more than the window budget is refused with the
    MiB it needs, the budget and the shortfall; the parser reads them back, and a reworded line is an error."""
    err = F.render("v_whole_refused", 288, "CUDA0", 126, 3420, 537, 2500, 256, 163)
    log = lp.parse_log("llama_init_from_model: failed to initialize the context: " + err + "\n")
    assert log.v_whole_refused == {"device": "CUDA0", "need": 288, "budget": 126, "raise_by": 163}
    assert "-fa on" in err and "lower -c" in err
    with pytest.raises(LogParseError, match="stays whole in device memory"):
        lp.parse_log("window mode: V stays whole in device memory and needs lots of MiB")


def test_draft_lines():
    """Patch 0096: with a draft and a --vram-target the main context takes the target less the draft's part, logged
    before the main context (the gates add it to the fixed part), and a target below the draft's need is refused
    with that need; a reworded line is an error."""
    room = F.render("draft_room", "common_init_result", 1029, "CUDA0", 200, 409, 100, 320, 2266,
                    " (the target given less the draft's part)")
    budget = F.render("budget", "llama_kv_residency_alloc", "CUDA0", 138800, 2266, 200, 0, 356, 64, 1646)
    log = lp.parse_log(room + "\n" + budget + "\n")
    assert log.draft_room == {"CUDA0": 1029}
    assert sizing.fixed_parts(log)["CUDA0"].mib == 200 + 356 + 64 + 1029
    err = F.render("draft_refused", "common_init_result", 1, "CPU", 1029, 200, 409, 100, 320)
    assert lp.parse_log(err).draft_refused == {"CPU": 1029} and "raise --vram-target" in err
    with pytest.raises(LogParseError, match="draft line"):
        lp.parse_log("common_init_result: rolling KV: leaving some MiB for the draft (weights 5)")


def test_host_tail_lines():
    """Patch 0101: the tail reserved and pinned at boot, each growth, and the decode it could not grow for."""
    lines = [F.render("host_tail", "llama_kv_residency_alloc", 77952.0, 0.0,
                      " (pinned as cells come into use; LLAMA_KV_HOST_ON_DEMAND=0 pins it at boot)"),
             F.render("host_tail", "llama_kv_residency_alloc", 512.0, 512.0, " (at boot)"),
             F.render("host_tail_grow", "grow", 1024, "CUDA0", 638208, 1048576, 1024, 77952, 310.0),
             F.render("host_tail_grow", "grow", 2048, "CUDA0", 700416, 1048576, 3072, 77952, 600.0),
             "apply: " + F.render("host_tail_failed", "CUDA0", 1024, 763904, 1048576, 512, 3072,
                                  ", LLAMA_KV_HOST_PIN_CAP_MIB 3584", "")]
    log = lp.parse_log("\n".join(lines) + "\n")
    assert log.host_tails == [{"reserved_mib": 77952.0, "pinned_mib": 0.0, "on_demand": True},
                              {"reserved_mib": 512.0, "pinned_mib": 512.0, "on_demand": False}]
    assert [(g["mib"], g["device"], g["cells"], g["kv_size"], g["pinned_mib"], g["reserved_mib"], g["ms"])
            for g in log.host_tail_grows] == [(1024, "CUDA0", 638208, 1048576, 1024, 77952, 310),
                                              (2048, "CUDA0", 700416, 1048576, 3072, 77952, 600)]
    assert log.host_tail_failed == {"device": "CUDA0", "need_mib": 1024, "cells": 763904, "kv_size": 1048576,
                                    "room_mib": 512}
    with pytest.raises(LogParseError, match="kv host tail"):
        lp.parse_log("grow: kv host tail: pinned a lot more")
