"""All-GPU runs (every GPU in one process, layer split) against the fake programs, which give each
GPU of CUDA_VISIBLE_DEVICES its share of the layers, its own window and its own 51 GB/s link."""

from __future__ import annotations

import json
import os
import re

import pytest

from rollkv_dist import gpu as gpu_mod
from rollkv_dist.gates import boot_beyond, report
from rollkv_dist.gates.runner import run_gates

from test_gates import FAKE, _prompt_model, ctx_for, fake_gpu, report_results, run_one
from test_gates_engine import second_gpu


def split_ctx(tmp_path, **opts):
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), **opts)
    ctx.under_test = ctx.gpus = [fake_gpu(), second_gpu()]
    return ctx


def failed(res) -> list[str]:
    return [c.name for c in res.checks if not c.ok]


def test_parity_on_every_gpu_with_a_target_per_device(tmp_path):
    res = run_one("resident-parity", split_ctx(tmp_path, parity_gen=4))
    assert res.verdict == "pass", failed(res)
    assert [g["uuid"] for g in res.gpus] == ["GPU-fake-0000", "GPU-fake-0001"]
    for kv in ("f16", "q8_0"):
        case = res.results[f"kv_{kv}"]
        a, b = (int(x) for x in case["vram_target"].split(","))  # one --vram-target per device
        assert case["shift+state"]["vram_target"] == case["vram_target"]
        assert case["compare"]["max_abs_diff"] == 0.0 and case["compare"]["tokens_equal"]
        assert set(case["resident"]["devices"]) == {"CUDA0", "CUDA1"}  # the resident run spans both
        assert set(case["fixed_mib"]) == {"CUDA0", "CUDA1"}
        # one record per device: its window, its compute reserve, its tail
        devs = case["devices"]
        assert [d["device"] for d in devs] == ["CUDA0", "CUDA1"]
        assert all(not d["fully_resident"] and d["host_tail_mib"] > 0 and d["compute_reserve_mib"] == 556.0
                   and d["budget"]["vram_target"] in (a, b) for d in devs)
        assert f"{kv}: a host tail on every GPU (2)" in [c.name for c in res.checks]
    md = "\n".join(report.report_rows("resident-parity", res.results))
    assert md.count("| CUDA0 | ") == 2 and md.count("| CUDA1 | ") == 2 and "window (C / cells)" in md


def test_a_target_list_of_the_wrong_length_fails_with_the_engines_words(tmp_path, monkeypatch):
    """patch 0005: a --vram-target list whose length is neither one nor the devices in use is an error
    naming both; the gate stops its search on it (no other target can help) and reports it."""
    monkeypatch.setenv("FAKE_WINDOW_DEVICES", "3")
    ctx = split_ctx(tmp_path, parity_gen=4)
    ctx.env = dict(os.environ)
    res = run_one("resident-parity", ctx)
    [bad] = [c for c in res.checks if not c.ok]
    assert bad.name == "gate ran to completion" and "WindowRefused" in bad.detail
    assert "--vram-target has 2 values but the model uses 3 GPU device(s) (CUDA0, CUDA1, CUDA2)" in bad.detail
    windows = [c for c in res.commands if "-krm window --vram-target" in c]
    assert len(windows) == 2 and windows[0].endswith("--vram-target 1")  # the probe, then one attempt
    assert re.search(r"-krm window --vram-target [0-9]+,[0-9]+$", windows[1])


def test_speed_with_a_tail_on_every_gpu_against_each_gpu_alone(tmp_path):
    res = run_one("speed", split_ctx(tmp_path, reps=1, speed_depths="16384"))
    assert res.verdict == "pass", failed(res)
    [row] = report_results(res)["split"]["rows"]
    assert [d["device"] for d in row["devices"]] == ["CUDA0", "CUDA1"]
    assert all(0.5 <= d["tail_fraction"] <= 0.65 for d in row["devices"])
    # the fake reads each device's tail over its own 51 GB/s link, one device after the other
    assert row["per_device_gbps"] == {"CUDA0": pytest.approx(51.0, rel=0.01), "CUDA1": pytest.approx(51.0, rel=0.01)}
    assert row["effective_gbps"] == pytest.approx(51.0, rel=0.01) and row["links_add_up"] is False
    assert row["together_over_sum"] == pytest.approx(0.5, abs=0.01)
    assert row["window_over_bound"] == pytest.approx(1.0, abs=0.01)
    # one GPU with the same total tail: the same bytes per token, the same decode
    one = row["one_gpu"][0]
    assert one["tail_read_mib_per_token"] == pytest.approx(row["tail_read_total_mib"], rel=0.1)
    assert row["window_over_one_gpu"] == pytest.approx(1.0, abs=0.02)
    assert any("do not add up" in n for n in res.notes)
    # the GPUs alone run with only their own GPU visible, the rest with both
    benches = [c for c in res.commands if "llama-bench -m" in c]
    by_env = [c.split(" ", 1)[0] for c in benches]
    assert by_env == ["CUDA_VISIBLE_DEVICES=GPU-fake-0000,GPU-fake-0001"] * 3 + [
        "CUDA_VISIBLE_DEVICES=GPU-fake-0000"] * 3 + ["CUDA_VISIBLE_DEVICES=GPU-fake-0001"] * 3
    md = "\n".join(report.report_rows("speed", report_results(res)))
    assert "together / sum" in md and "| CUDA1 | " in md


def test_boot_beyond_every_gpu_and_one(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_MIB_PER_CELL", "0.1875")  # the 14B shape's f16 KV per cell
    monkeypatch.setattr(boot_beyond, "host_memory", lambda: {"total_mib": 1 << 20, "available_mib": 1 << 20})
    ctx = split_ctx(tmp_path)
    ctx.env = dict(os.environ)
    res = run_one("boot-beyond", ctx)
    assert res.verdict == "pass", failed(res)
    r = res.results
    assert r["n_ctx"] == 2097152 and r["kv_mib"] == 2097152 * 0.1875 > r["gpu_free_mib"]
    assert [d["device"] for d in r["devices"]] == ["CUDA0", "CUDA1"] and all(d["host_tail_mib"] > 0 for d in r["devices"])
    ctx.under_test = [fake_gpu()]
    res = run_one("boot-beyond", ctx)
    assert res.verdict == "pass" and res.results["n_ctx"] == 1048576, failed(res)


def test_boot_beyond_sizes_and_skips():
    h200 = 143771
    assert boot_beyond.beyond_ctx(2 * h200, 0.1875) == 2097152  # 384 GiB against 2 x 141 GiB
    assert boot_beyond.beyond_ctx(h200, 0.1875) == 1048576


def test_boot_beyond_needs_host_memory_for_the_tail_only_when_it_is_pinned_at_boot(tmp_path, monkeypatch):
    """Patch 0101: the tail is pinned as cells come into use, so a host smaller than the tail still boots the
    context (and the gate checks that little of the tail is pinned); with LLAMA_KV_HOST_ON_DEMAND=0 the tail is
    pinned at boot, and the gate skips on such a host."""
    monkeypatch.setenv("FAKE_SERVER_MIB_PER_CELL", "0.1875")
    monkeypatch.setattr(boot_beyond, "host_memory", lambda: {"total_mib": 65536, "available_mib": 60000})
    ctx = split_ctx(tmp_path)
    ctx.env = dict(os.environ)
    res = run_one("boot-beyond", ctx)
    assert res.verdict == "pass", failed(res)
    r = res.results
    assert r["host_tail_reserved_mib"] > 60000 and r["host_tail_pinned_mib"] == 0, r
    assert any(c.name.startswith("the host tail is pinned on demand") and c.ok for c in res.checks)
    (tmp_path / "eager").mkdir()
    ctx = split_ctx(tmp_path / "eager")
    ctx.env = {**os.environ, "LLAMA_KV_HOST_ON_DEMAND": "0"}
    res = run_one("boot-beyond", ctx)
    assert res.verdict == "skip" and res.commands == [] and "pinned at boot" in res.notes[0], res.notes


def test_run_gates_all_gpus_in_one_process(tmp_path):
    probe = gpu_mod.GPUProbe(gpus=[fake_gpu(), second_gpu()], driver_version="580.159", cuda_driver_version="13.0")
    reps, rdir = run_gates(["engine", "resident-parity"], probe.gpus, build=FAKE, work=tmp_path / "w",
                           reports=tmp_path / "r", probe=probe, options={"model": str(_prompt_model(tmp_path)),
                                                                         "parity_gen": 4},
                           env=dict(os.environ), split=True)
    assert [(r["gate"], r["verdict"]) for r in reps] == [("engine", "skip"), ("resident-parity", "pass")]
    assert "runs per GPU" in reps[0]["notes"][0]
    js = json.loads((rdir / "resident-parity-gpus0+1.json").read_text())
    assert [g["uuid"] for g in js["gpus"]] == ["GPU-fake-0000", "GPU-fake-0001"] and js["gpu"]["index"] == 0
    assert "GPU-fake-0000 + NVIDIA H200 GPU-fake-0001" in (rdir / "SUMMARY.md").read_text()
    assert "(one process, layer split)" in (rdir / "resident-parity-gpus0+1.md").read_text()
    # one GPU: an all-GPU run has nothing to run on
    reps, _ = run_gates(["resident-parity"], [fake_gpu()], build=FAKE, work=tmp_path / "w1", reports=tmp_path / "r1",
                        probe=probe, split=True)
    assert reps[0]["verdict"] == "skip" and "needs two or more GPUs; 1 given" in reps[0]["notes"][0]
