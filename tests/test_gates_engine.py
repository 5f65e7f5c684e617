"""engine gate end to end against the fake llama-window-test (tests/data/fake_llama/bin): its
PASS/FAIL/SKIP lines as checks and notes, per run (the GPU under test; all GPUs with
GGML_CUDA_P2P=1 when the machine has two), and every way the program can let the gate down."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from rollkv_dist import gpu as gpu_mod
from rollkv_dist.errors import UsageError
from rollkv_dist.gates import engine, logparse, report
from rollkv_dist.gates.runner import DEFAULT_GATES, check_inputs, run_gates
from rollkv_dist.gates.base import registry

from test_gates import FAKE, ctx_for, fake_gpu, run_one

SOLO, P2P = engine.SOLO, engine.P2P


def second_gpu() -> gpu_mod.GPUInfo:
    return gpu_mod.GPUInfo(index=1, uuid="GPU-fake-0001", name="NVIDIA H200", memory_total=143 << 30,
                           memory_free=140 << 30, compute_capability=(9, 0))


def run_engine(tmp_path, monkeypatch=None, env=None, gpus=1, **opts):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    ctx = ctx_for(tmp_path, **opts)
    ctx.gpus = [fake_gpu(), second_gpu()][:gpus]
    return ctx, run_one("engine", ctx)


def stdout_lines(run: dict, status: str) -> list[str]:
    """The program's own output lines of one status, read back from the kept log."""
    return [ln for ln in open(run["stdout"]).read().splitlines() if ln.startswith(status + " ")]


def wt_commands(res) -> list[str]:
    """The llama-window-test command lines (the op suite's runs come after them)."""
    return [c for c in res.commands if c.endswith("llama-window-test")]


def failed(res) -> set[str]:
    return {c.name for c in res.checks if not c.ok}


def test_engine_gate_is_registered_and_a_default():
    assert registry()["engine"] is engine.GATE and "engine" in DEFAULT_GATES
    assert engine.BINARIES == engine.GATE.binaries == ("llama-window-test",)


def test_one_gpu_every_pass_line_is_a_check_and_skips_are_notes(tmp_path):
    ctx, res = run_engine(tmp_path)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    [run] = res.results["runs"]
    assert run["run"] == SOLO and run["rc"] == 0 and run["env"] == {"CUDA_VISIBLE_DEVICES": "GPU-fake-0000"}
    assert run["summary"] == {"devices": 1, "failures": 0, "p2p": False}
    passes = stdout_lines(run, "PASS")
    assert len(passes) >= 10 and run["counts"]["PASS"] == len(passes)
    names = [c.name for c in res.checks]
    for ln in passes:  # each PASS line is a check of its own, named after the run it came from
        assert f"{SOLO}: {ln[5:]}" in names
    # the SKIP line (one GPU: no peer copy) is a note, never a check
    skips = stdout_lines(run, "SKIP")
    assert skips == ["SKIP CUDA0: copy out of a window buffer into another device: one GPU"]
    assert f"{SOLO}: SKIP CUDA0: copy out of a window buffer into another device: one GPU" in res.notes
    assert not any("another device" in n for n in names)
    assert any("peer-copy checks" in n and "did not run" in n for n in res.notes)
    # the command is recorded with the environment that made it run on the GPU under test; stderr kept
    assert wt_commands(res)[-1] == f"CUDA_VISIBLE_DEVICES=GPU-fake-0000 {FAKE / 'bin' / 'llama-window-test'}"
    assert "ggml_cuda_init: found 1 CUDA devices" in open(run["stderr"]).read()
    assert run["stdout"] in res.logs and run["stderr"] in res.logs
    assert f"{SOLO}: window buffers on the GPU under test" in names


def test_two_gpus_add_a_p2p_run_with_every_gpu_visible(tmp_path):
    ctx, res = run_engine(tmp_path, gpus=2)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    solo, p2p = res.results["runs"]
    assert solo["run"] == SOLO and p2p["run"] == P2P
    assert p2p["env"] == {"CUDA_VISIBLE_DEVICES": "GPU-fake-0000,GPU-fake-0001", "GGML_CUDA_P2P": "1"}
    assert solo["summary"]["p2p"] is False and p2p["summary"] == {"devices": 2, "failures": 0, "p2p": True}
    assert wt_commands(res)[-1].startswith("CUDA_VISIBLE_DEVICES=GPU-fake-0000,GPU-fake-0001 GGML_CUDA_P2P=1 ")
    names = [c.name for c in res.checks]
    # the peer copies come from the P2P run only, each named after it
    peer = [n for n in names if "copy out of a window buffer into CUDA" in n]
    assert peer == [f"{P2P}: CUDA0: copy out of a window buffer into CUDA1",
                    f"{P2P}: CUDA1: copy out of a window buffer into CUDA0"]
    assert f"{P2P}: window buffers on >= 2 devices and peer copies checked" in names
    assert f"{P2P}: the program saw GGML_CUDA_P2P" in names
    assert len(stdout_lines(p2p, "PASS")) == sum(n.startswith(P2P + ": CUDA") or n.startswith(P2P + ": CPU")
                                                 for n in names)
    assert not any("did not run" in n for n in res.notes)


def test_the_machines_gpus_come_from_the_probe(tmp_path):
    """rollkv gates --gpu 0 on a two-GPU machine: the gate tests GPU 0, the P2P run sees both."""
    probe = gpu_mod.GPUProbe(gpus=[fake_gpu(), second_gpu()], driver_version="580.159", cuda_driver_version="13.0")
    reps, rdir = run_gates(["engine"], [fake_gpu()], build=FAKE, work=tmp_path / "w", reports=tmp_path / "r",
                           probe=probe, env=dict(os.environ))
    [rep] = reps
    assert rep["verdict"] == "pass" and [r["run"] for r in rep["results"]["runs"]] == [SOLO, P2P]
    md = (rdir / "engine-gpu0.md").read_text()
    assert md.startswith("# engine: PASS")
    assert re.search(rf"\| {re.escape(P2P)} \| `CUDA_VISIBLE_DEVICES=GPU-fake-0000,GPU-fake-0001` "
                     r"`GGML_CUDA_P2P=1` \| 0 \| 2 \| \d+ \| 0 \| 0 \| 0 \|", md), md
    js = json.loads((rdir / "engine-gpu0.json").read_text())
    assert all(k in js for k in report.REQUIRED_KEYS)


def test_a_report_records_the_engine_environment_its_children_run_with(tmp_path):
    """GGML_*/LLAMA_* change what the engine does (GGML_CUDA_PREFETCH_COPY=sm: the SMs read the host tail):
    the report names them, a secret by name only, and says so when none is set."""
    probe = gpu_mod.GPUProbe(gpus=[fake_gpu()], driver_version="580.159", cuda_driver_version="13.0")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_", "LLAMA_"))}
    env = {**base, "GGML_CUDA_PREFETCH_COPY": "sm", "LLAMA_API_KEY": "hunter2", "ROLLKV_NOT_ENGINE": "x"}
    reps, rdir = run_gates(["engine"], [fake_gpu()], build=FAKE, work=tmp_path / "w", reports=tmp_path / "r",
                           probe=probe, env=env)
    assert reps[0]["verdict"] == "pass"
    js_text = (rdir / "engine-gpu0.json").read_text()
    md = (rdir / "engine-gpu0.md").read_text()
    assert json.loads(js_text)["environment"] == {"GGML_CUDA_PREFETCH_COPY": "sm",
                                                  "LLAMA_API_KEY": "(set, value not recorded)"}
    assert ("- engine environment (GGML_*, LLAMA_*): `GGML_CUDA_PREFETCH_COPY=sm`, "
            "`LLAMA_API_KEY=(set, value not recorded)`\n") in md
    assert "hunter2" not in js_text + md and "ROLLKV_NOT_ENGINE" not in js_text + md

    reps, rdir = run_gates(["engine"], [fake_gpu()], build=FAKE, work=tmp_path / "w2", reports=tmp_path / "r2",
                           probe=probe, env=base)
    assert reps[0]["environment"] == {}
    assert "- engine environment (GGML_*, LLAMA_*): none set (the engine's defaults)\n" in \
        (rdir / "engine-gpu0.md").read_text()


def test_a_fail_line_fails_exactly_its_check(tmp_path, monkeypatch):
    ctx, res = run_engine(tmp_path, monkeypatch, {"FAKE_WT_FAIL": "q8_0 rows straddling"})
    assert res.verdict == "fail"
    name = f"{SOLO}: CUDA0: q8_0 rows straddling the device/host boundary read back"
    assert failed(res) == {name, f"{SOLO}: llama-window-test exits 0"}
    assert next(c for c in res.checks if c.name == name).detail == "first difference at byte 4096"
    assert res.results["runs"][0]["summary"]["failures"] == 1 and res.results["runs"][0]["rc"] == 1


def test_a_failure_only_with_peer_access_is_named_after_the_p2p_run(tmp_path, monkeypatch):
    ctx, res = run_engine(tmp_path, monkeypatch, {"FAKE_WT_FAIL_P2P": "copy out of a window buffer into"}, gpus=2)
    assert res.verdict == "fail"
    assert failed(res) == {f"{P2P}: CUDA0: copy out of a window buffer into CUDA1",
                           f"{P2P}: CUDA1: copy out of a window buffer into CUDA0", f"{P2P}: llama-window-test exits 0"}
    assert res.results["runs"][0]["rc"] == 0 and res.results["runs"][1]["summary"]["failures"] == 2


def test_a_missing_summary_fails_the_gate(tmp_path, monkeypatch):
    ctx, res = run_engine(tmp_path, monkeypatch, {"FAKE_WT_NO_SUMMARY": "1"})
    assert res.results["runs"][0]["rc"] == 0
    assert failed(res) == {f"{SOLO}: summary line printed"}


def test_a_crash_fails_the_gate_and_keeps_the_checks_before_it(tmp_path, monkeypatch):
    ctx, res = run_engine(tmp_path, monkeypatch, {"FAKE_WT_CRASH": "1"})
    assert failed(res) == {f"{SOLO}: llama-window-test exits 0", f"{SOLO}: summary line printed"}
    run = res.results["runs"][0]
    assert run["rc"] < 0 and run["summary"] is None
    crash = next(c for c in res.checks if c.name.endswith("exits 0"))
    assert "SIGABRT" in crash.detail and run["stderr"] in crash.detail
    assert "illegal memory access" in open(run["stderr"]).read()
    passed = [c.name for c in res.checks if c.ok and c.name.startswith(f"{SOLO}: CUDA0")]
    assert len(passed) == len(stdout_lines(run, "PASS")) - 1  # all but the CPU line are CUDA0's
    assert f"{SOLO}: CUDA0: memset across the boundary" in passed
    assert not any("flash attention" in n for n in passed)


def test_a_fail_line_fails_the_gate_even_when_the_program_exits_0(tmp_path, monkeypatch):
    ctx, res = run_engine(tmp_path, monkeypatch, {"FAKE_WT_STDOUT": "FAIL CUDA0: an extra check: it broke"})
    assert res.results["runs"][0]["rc"] == 0
    assert failed(res) == {f"{SOLO}: CUDA0: an extra check", f"{SOLO}: the summary's failure count equals the FAIL lines"}


def test_without_window_buffers_nothing_passes(tmp_path, monkeypatch):
    ctx, res = run_engine(tmp_path, monkeypatch, {"FAKE_WT_NO_WINDOWS": "1"})
    assert failed(res) == {f"{SOLO}: window buffers on the GPU under test"}
    run = res.results["runs"][0]
    skips = stdout_lines(run, "SKIP")
    assert len(skips) == run["counts"]["SKIP"] == 3
    for ln in skips:  # every SKIP line is a note, none a check
        assert f"{SOLO}: {ln}" in res.notes
    skipped = [c["name"] for c in run["checks"] if c["status"] == "SKIP"]
    assert skipped == ["CUDA0: window buffers", "window buffers", "teardown-under-capture"]
    assert not any(c.name == f"{SOLO}: {n}" for n in skipped for c in res.checks)
    assert run["summary"]["devices"] == 0


@pytest.mark.parametrize("line", ["PASS", "FAILED CUDA0: granularity: x", "SKIP CUDA0 window buffers",
                                  "pass CUDA0: granularity", "window-test: one device"])
def test_an_unreadable_check_line_fails_the_gate(tmp_path, monkeypatch, line):
    ctx, res = run_engine(tmp_path, monkeypatch, {"FAKE_WT_STDOUT": line})
    bad = [c for c in res.checks if not c.ok]
    assert [c.name for c in bad] == ["gate ran to completion"]
    assert "LogParseError" in bad[0].detail and f"{ctx.work / 'window-test.out'}:" in bad[0].detail
    assert repr(line) in bad[0].detail


def test_a_missing_program_is_a_usage_error_before_any_gate_runs(tmp_path):
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    for p in (FAKE / "bin").iterdir():
        if p.name != "llama-window-test":
            shutil.copy2(p, prefix / "bin" / p.name)
    check_inputs(["needle", "resident-parity"], prefix)  # the other gates do not need it
    with pytest.raises(UsageError, match="llama-window-test not found under"):
        check_inputs(["needle", "engine"], prefix)
    ctx = ctx_for(tmp_path)
    ctx.build = prefix
    with pytest.raises(UsageError, match="llama-window-test not found under"):
        run_one("engine", ctx)


def test_parse_window_test_lines():
    out = logparse.parse_window_test(
        "PASS CUDA0: granularity\n"
        "FAIL CUDA0: partial set/get across the boundary: piece [1, +2) differs: see: here\n"
        "FAIL CUDA1: window buffer of one device and one host granule: \n"
        "SKIP window buffers: no device exports them (CPU-only build, or no supported GPU)\n"
        "\x1b[32mggml_cuda_init: found 2 CUDA devices\x1b[0m\n"
        "window-test: 2 device(s) with window buffers, 2 failure(s) (GGML_CUDA_P2P set)\n", source="wt.out")
    assert [(c.status, c.name, c.detail, c.line) for c in out.checks] == [
        ("PASS", "CUDA0: granularity", "", 1),
        ("FAIL", "CUDA0: partial set/get across the boundary", "piece [1, +2) differs: see: here", 2),
        ("FAIL", "CUDA1: window buffer of one device and one host granule", "", 3),
        ("SKIP", "window buffers", "no device exports them (CPU-only build, or no supported GPU)", 4)]
    assert out.summary == logparse.WindowTestSummary(2, 2, True)
    assert logparse.parse_window_test("window-test: 1 device(s) with window buffers, 0 failure(s)").summary.p2p is False
    assert logparse.parse_window_test("").summary is None
    with pytest.raises(logparse.LogParseError, match=r"wt.out:2: a second `window-test:` summary"):
        logparse.parse_window_test("window-test: 1 device(s) with window buffers, 0 failure(s)\n" * 2, source="wt.out")
    with pytest.raises(logparse.LogParseError, match=r"wt.out:1: a check line of no known form"):
        logparse.parse_window_test("SKIPPED CUDA0: x: y", source="wt.out")
