"""Issue 25 in CI, without a GPU: the archs gate on the shared CPU build, one model of the pin's fixture per
memory type. Under the packaged default each loads and decodes (auto runs resident: no GPU), and its
staging graph (patch 0007: LLAMA_KV_STAGE_EVERY_CELL=1, every cache reads a staged copy of its K/V with the
prefetch, as if every cell were in a host tail) gives the resident logits bit for bit.

The fixture's writer, upstream's tests/test-llama-archs.cpp, is not in the shipped programs: the gate builds it
for the CPU from the `rollkv source` tree the shared build was packed from, with test-backend-ops (about 8 min on
2 cores, once per work folder).

With patch 0092's LLAMA_KV_TEST_HOST_DEVICE_MIB the CPU stands in for a GPU: the plain, iSWA and hybrid memories
then take windows with a host tail on the CPU build, exactly as on the H200."""

from __future__ import annotations

import os
import re

import pytest

from conftest import shown
from rollkv_dist.gates import archs, context
from rollkv_dist.gates.runner import run_gate

# one fixture model per memory type (the memory each is, as patch 0090 names it on a GPU build:
# reports/2026-12-02-every-memory/archs.json)
MODELS = {
    "llama-dense": "an attention KV cache",
    "gemma3-dense": "an iSWA attention KV cache (a full cache and a sliding-window cache)",
    "qwen35-dense": "hybrid (an attention KV cache beside recurrent state)",
    "lfm2moe-moe": "hybrid (an attention KV cache beside recurrent state)",  # its iSWA form
    "qwen4exp-moe": "hybrid (an attention KV cache with an indexer cache, beside recurrent state)",
    "deepseek32-moe": "sparse attention (DSA: an attention KV cache with an indexer K cache)",
    "dots3note-moe": "sparse attention (DSA: an attention KV cache with an indexer K cache)",  # DSA-iSWA
    "minimax-m3-moe": "sparse attention (MSA: an attention KV cache with an indexer K cache)",
    "deepseek4-moe": "DeepSeek-V4's compressed KV cache",
    "mamba-dense": "recurrent state only (no attention KV cache)",
}


@pytest.fixture(scope="module")
def writer(cpu_build, request):
    """The fixture's writer, built for the CPU once per work folder (the archs gate's own way)."""
    ctx = context.GateContext(build=cpu_build["prefix"], work=cpu_build["work"] / "archs-writer", gpu=None,
                             llama_tree=cpu_build["src"], options=archs.Options())
    with shown(request):
        return str(archs.find_writer(ctx))


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_every_memory_type_stages_exactly_on_the_cpu_build(cpu_build, writer, request):
    flt = "^(" + "|".join(re.escape(m) for m in MODELS) + ")$"
    ctx = context.GateContext(build=cpu_build["prefix"], work=cpu_build["work"] / "archs-cpu", gpu=None,
                             llama_tree=cpu_build["src"], env=dict(os.environ),
                             options={"archs_filter": flt, "archs_jobs": 2, "archs_ctx": 2048, "archs_writer": writer})
    with shown(request):
        res = run_gate("archs", ctx)
    rows = {r["arch"]: r for r in res.results.get("rows", [])}
    assert sorted(rows) == sorted(MODELS), [c for c in res.checks if not c.ok]
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    for name, row in rows.items():
        assert row["resident_ok"] and row["auto_ok"], (name, row)
        assert row["staged_max_abs_diff"] == 0.0, (name, row)
    staged = [c for c in res.checks if c.name.endswith("gives the resident logits")]
    assert len(staged) == len(MODELS) and all(c.ok for c in staged)
    assert sum(c.startswith("LLAMA_KV_STAGE_EVERY_CELL=1 ") for c in res.commands) == len(MODELS)
    # the CPU build runs resident under auto, and says why
    assert all("there is no GPU device" in row["note"] for row in rows.values())


# the CPU standing in for a GPU (patch 0092): the plain, iSWA and hybrid memories, Grok (flash attention forced off
# upstream: K alone takes the window, patch 0093), and recurrent state
STAND_IN_MODELS = ("llama-dense", "gemma3-dense", "qwen35-dense", "grok-moe", "mamba-dense")
STAND_IN_MIB = "65536"


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_windows_with_a_host_tail_on_the_cpu_standing_in_for_a_gpu(cpu_build, writer, request):
    """With LLAMA_KV_TEST_HOST_DEVICE_MIB the auto decision, the sizer (a `--vram-target 1` probe, then the search),
    the two-pass reserve and the window allocation run on the CPU build: per memory type the default takes its
    window (the `kv residency` line names the memory), window mode with >= 40 % of the cells in the tail gives the
    resident logits bit for bit, and so does the shift/state pair, and (patch 0093) the pair with -fa off, where V
    stays whole on the device and K alone takes the window; recurrent state has nothing to window."""
    flt = "^(" + "|".join(re.escape(m) for m in STAND_IN_MODELS) + ")$"
    ctx = context.GateContext(build=cpu_build["prefix"], work=cpu_build["work"] / "archs-stand-in", gpu=None,
                             llama_tree=cpu_build["src"], env={**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB},
                             options={"archs_filter": flt, "archs_jobs": 2, "archs_writer": writer})
    with shown(request):
        res = run_gate("archs", ctx)
    rows = {r["arch"]: r for r in res.results.get("rows", [])}
    assert res.verdict == "pass" and sorted(rows) == sorted(STAND_IN_MODELS), [c for c in res.checks if not c.ok]
    for name in STAND_IN_MODELS[:-1]:
        r = rows[name]
        assert r["memory"] == MODELS.get(name, "an attention KV cache"), r
        assert r["tail_fraction"] >= 0.4 and r["max_abs_diff"] == 0.0 and r["tokens_equal"], r
        assert r["shift_max_abs_diff"] == 0.0 and r["shift_tokens_equal"] and r["staged_max_abs_diff"] == 0.0, r
    for name in ("llama-dense", "gemma3-dense", "qwen35-dense"):  # archs.FA_OFF_MODELS
        r = rows[name]
        assert r["fa_off_max_abs_diff"] == 0.0 and r["fa_off_tokens_equal"] and r["fa_off_tail_fraction"] >= 0.4, r
    assert "V stays in device memory" in rows["grok-moe"]["note"]
    m = rows["mamba-dense"]
    assert m["memory"] == MODELS["mamba-dense"] and m["max_abs_diff"] is None and "nothing to window" in m["note"]
    assert any(c.name == "mamba-dense: -krm window runs resident, with a line" and c.ok for c in res.checks)


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_the_single_pass_estimate_bounds_the_compute_buffers_with_flash_attention_off(cpu_build, writer, tmp_path):
    """Patch 0093: where auto decides a single pass (the full KV fits the budget under an estimate of the compute
    buffers), the estimate is an upper bound of the buffers the context then measures, with flash attention off
    too, whose KQ and softmax of n_ctx x n_ubatch per head the old estimate (1536 MiB + the mask and logits) left
    out. The CPU stands in for a GPU (0092) with room for the whole KV."""
    import subprocess

    from rollkv_dist.gates import logparse

    out = tmp_path / "models"
    out.mkdir()
    subprocess.run([writer, "-a", "llama", "--n-head", "16", "-o", out], check=True, capture_output=True)
    model = out / "llama-dense.gguf"
    (tmp_path / "p.txt").write_text("a b c d e f g h")
    n_ctx, n_ubatch = 32768, 1024
    p = subprocess.run([cpu_build["prefix"] / "bin" / "llama-logits-dump", "-m", model, "-f", tmp_path / "p.txt",
                        "-n", "1", "-c", str(n_ctx), "-b", str(n_ubatch), "-ub", str(n_ubatch), "-fa", "off",
                        "-krm", "auto",
                        "--logits-out", tmp_path / "d", "-lv", "4"],
                       env={**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB}, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    log = logparse.parse_log(p.stderr)
    bound, measured = log.reserve.single_pass_bound_mib, log.compute_buffers.get("CPU")
    assert log.reserve.single_pass and bound is not None and measured is not None, p.stderr[-3000:]
    assert measured <= bound, (measured, bound)
    # the case is one the old estimate did not bound (16 heads, ubatch 1024: 2 GiB of KQ)
    old = 1536 + 4 * n_ubatch * (n_ctx + 1000) / 2**20  # the fixture's vocabulary is far below 1000 tokens
    assert measured > old, (measured, old)


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_a_v_kept_whole_that_does_not_fit_the_window_budget_is_refused(cpu_build, writer, tmp_path):
    """Patch 0093: with flash attention off V is stored transposed and kept whole in device memory (0093). Where
    it needs more than the window budget, window mode refuses with the MiB it needs and what to change, instead of
    allocating it out of the compute reserve's safety and the margin; a budget that holds V runs, with the cache's
    device memory within the budget. The CPU stands in for a GPU (0092)."""
    import subprocess

    from rollkv_dist.gates import logparse

    out = tmp_path / "models"
    out.mkdir()
    subprocess.run([writer, "-a", "llama", "-o", out], check=True, capture_output=True)
    (tmp_path / "p.txt").write_text("a b c d e f g h")

    def run(*args: str) -> tuple[subprocess.CompletedProcess, logparse.LlamaLog]:
        p = subprocess.run([cpu_build["prefix"] / "bin" / "llama-logits-dump", "-m", out / "llama-dense.gguf",
                            "-f", tmp_path / "p.txt", "-n", "1", "-c", "65536", "-b", "64", "-ub", "64", "-fa", "off",
                            "--logits-out", tmp_path / "d", "-lv", "4", *args],
                           env={**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB}, capture_output=True,
                           text=True, timeout=600)
        return p, logparse.parse_log(p.stderr)

    p, log = run("-krm", "resident")
    assert p.returncode == 0 and log.kv_caches, p.stderr[-3000:]
    kv_mib = log.kv_caches[0][0]
    assert kv_mib >= 32, kv_mib  # room for the targets below to fall on either side of V
    p, log = run("-krm", "window", "--vram-target", "1")  # the probe: the budget line gives the fixed part
    assert p.returncode != 0 and log.budgets, p.stderr[-3000:]
    fixed = 1 - log.budgets[-1]["budget"]
    p, log = run("-krm", "window", "--vram-target", str(int(fixed + 0.75 * kv_mib)))
    assert p.returncode == 0 and log.v_on_device_mib.get("CPU"), p.stderr[-3000:]
    v_mib = log.v_on_device_mib["CPU"]
    # V a few MiB short of its budget: refused, with the shortfall
    p, log = run("-krm", "window", "--vram-target", str(int(fixed + v_mib - 4)))
    assert p.returncode != 0, p.stderr[-3000:]
    r = log.v_whole_refused
    assert r is not None and r["device"] == "CPU" and r["need"] >= v_mib and r["budget"] < r["need"], p.stderr[-3000:]
    assert r["raise_by"] >= r["need"] - r["budget"] and log.budgets[-1]["budget"] == r["budget"]
    # raised by that: it runs, and the cache's device memory stays within the window budget
    p, log = run("-krm", "window", "--vram-target", str(int(fixed + v_mib - 4 + r["raise_by"] + 4)))
    assert p.returncode == 0, p.stderr[-3000:]
    w = log.window
    assert w is not None and not w.fully_resident and w.device_mib <= log.budgets[-1]["budget"], (w, log.budgets)


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_the_window_reserve_counts_the_backends_scratch(cpu_build, writer, tmp_path):
    """Patch 0097: the window's compute reserve is the measured compute buffer, the backend's scratch (on CUDA the
    pool bound of 0097) and the safety. The CPU standing in for a GPU (0092) has no scratch of its own;
    LLAMA_KV_TEST_SCRATCH_MIB gives it one. Two passes: pass 2's reserve counts it and the window's budget shrinks
    by it. A single pass whose estimate does not hold the scratch makes the caches again with the measurement, so
    a KV that fitted under the estimate gets a host tail instead of overrunning the budget."""
    import subprocess

    from rollkv_dist.gates import logparse

    out = tmp_path / "models"
    out.mkdir()
    subprocess.run([writer, "-a", "llama", "-o", out], check=True, capture_output=True)
    (tmp_path / "p.txt").write_text("a b c d e f g h")

    def run(scratch_mib: int | None, *args: str) -> tuple[subprocess.CompletedProcess, logparse.LlamaLog]:
        env = {**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB}
        env.pop("LLAMA_KV_TEST_SCRATCH_MIB", None)
        if scratch_mib is not None:
            env["LLAMA_KV_TEST_SCRATCH_MIB"] = str(scratch_mib)
        p = subprocess.run([cpu_build["prefix"] / "bin" / "llama-logits-dump", "-m", out / "llama-dense.gguf",
                            "-f", tmp_path / "p.txt", "-n", "1", "-c", "65536", "-b", "64", "-ub", "64", "-fa", "on",
                            "--logits-out", tmp_path / "d", "-lv", "4", *args],
                           env=env, capture_output=True, text=True, timeout=600)
        return p, logparse.parse_log(p.stderr)

    p, log = run(None, "-krm", "resident")
    assert p.returncode == 0 and log.kv_caches, p.stderr[-3000:]
    kv_mib = log.kv_caches[0][0]
    p, log = run(None, "-krm", "window", "--vram-target", "1")  # the probe: the budget line gives the fixed part
    assert p.returncode != 0 and log.budgets, p.stderr[-3000:]
    fixed = 1 - log.budgets[-1]["budget"]

    # two passes (the KV cannot fit): the scratch joins the reserve, and the budget is smaller by it
    target = str(int(fixed + kv_mib / 2))
    p0, l0 = run(None, "-krm", "window", "--vram-target", target)
    p1, l1 = run(16, "-krm", "window", "--vram-target", target)
    assert p0.returncode == 0 and p1.returncode == 0, (p0.stderr[-2000:], p1.stderr[-2000:])
    r0, r1 = l0.reserve.by_device["CPU"], l1.reserve.by_device["CPU"]
    assert r0["scratch_mib"] == 0 and "CPU" not in l0.reserve.scratch
    assert r1["scratch_mib"] == 16 and l1.reserve.scratch["CPU"] == {"scratch_mib": 16, "pool_mib": 16, "kept_mib": 0}
    assert r1["reserve_mib"] == pytest.approx(r1["measured_mib"] + 16 + r1["safety_mib"], abs=0.01)
    assert l1.budgets[-1]["compute_reserve"] == int(r1["reserve_mib"])
    assert l1.budgets[-1]["budget"] == pytest.approx(l0.budgets[-1]["budget"] - 16, abs=1)
    assert l1.window.cells_resident < l0.window.cells_resident, (l0.window, l1.window)

    # a single pass: at a target where the whole KV fits under the estimate, with half the KV to spare, no scratch
    # keeps it whole ...
    p, log = run(None, "-krm", "auto")
    assert p.returncode == 0 and log.reserve.single_pass, p.stderr[-3000:]
    bound, b = log.reserve.single_pass_bound_mib, log.budgets[-1]
    target = str(int(b["model"] + b["compute_reserve"] + b["margin"] + 1.5 * kv_mib))
    p2, l2 = run(None, "-krm", "auto", "--vram-target", target)
    assert p2.returncode == 0 and l2.reserve.single_pass and l2.window.fully_resident, p2.stderr[-3000:]
    assert not l2.reserve.single_pass_short
    # ... and a scratch that takes the need 8 MiB past the estimate measures in two passes: the caches now get a
    # host tail, whose staged copies are compute buffer the single pass (made for a KV that fitted) did not measure
    single = l2.compute_buffers.get("CPU")
    assert single is not None and bound is not None, p2.stderr[-3000:]
    scratch = int(bound - single - 256) + 8
    assert scratch > 0, (bound, single)
    p3, l3 = run(scratch, "-krm", "auto", "--vram-target", target)
    assert p3.returncode == 0, p3.stderr[-3000:]
    need = l3.reserve.single_pass_short.get("CPU")
    assert need == pytest.approx(single + scratch + 256, abs=0.01) and need > bound, p3.stderr[-3000:]
    r3 = l3.reserve.by_device.get("CPU")
    assert r3 is not None and r3["scratch_mib"] == scratch, p3.stderr[-3000:]
    assert r3["reserve_mib"] == pytest.approx(r3["measured_mib"] + scratch + 256, abs=0.01)
    assert l3.compute_buffers["CPU"] <= r3["measured_mib"] + 0.01  # pass 1's measurement holds the real buffers
    assert [x["compute_reserve"] for x in l3.budgets] == [int(r3["reserve_mib"])]  # the first making's lines dropped
    w = l3.window
    assert len(l3.windows) == 1 and not w.fully_resident and w.device_mib <= l3.budgets[-1]["budget"], l3.windows


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_the_servers_prompt_cache_is_lowered_to_fit_beside_the_host_tail(cpu_build, writer, tmp_path):
    """Patch 0095 (issue 26's host budget) with 0101: llama-server's prompt cache (--cache-ram, 8192 MiB by default,
    which also holds the idle-slot saves) is host memory beside the KV host tail, which is pinned as cells come into
    use. With a window, a limit larger than the memory available less what the tail may still pin (less 1 GiB kept
    free) is lowered to that, down to 0 (disabled), and the log says so; a limit that fits is logged as fitting; a
    resident server is left as upstream has it. The CPU stands in for a GPU (0092) and
    LLAMA_KV_TEST_HOST_AVAILABLE_MIB for the host's memory."""
    import socket
    import subprocess
    import time

    from rollkv_dist.gates import logparse

    out = tmp_path / "models"
    out.mkdir()
    subprocess.run([writer, "-a", "llama", "-o", out], check=True, capture_output=True)
    model = out / "llama-dense.gguf"

    def serve(avail_mib: int, *args: str, env_extra: dict[str, str] | None = None) -> tuple[int | None, str]:
        """Start llama-server, wait until it listens (or exits), stop it; its return code if it exited, its log."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tmp_path / f"server-{port}.log"
        env = {**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB,
               "LLAMA_KV_TEST_HOST_AVAILABLE_MIB": str(avail_mib), **(env_extra or {})}
        with open(log, "w") as f:
            p = subprocess.Popen([cpu_build["prefix"] / "bin" / "llama-server", "-m", model, "-c", "65536",
                                  "-b", "64", "-ub", "64", "--host", "127.0.0.1", "--port", str(port), "-lv", "4", *args],
                                 env=env, stdout=f, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and p.poll() is None and "listening on" not in log.read_text():
                time.sleep(0.5)
            rc = p.poll()
            if rc is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        return rc, log.read_text(errors="replace")

    # the fixed part of the budget (the probe), then a target that leaves a host tail of the KV
    rc, text = serve(100000, "-krm", "resident")
    assert rc is None and "listening on" in text, text[-3000:]
    log = logparse.parse_log(text)
    assert log.kv_caches and log.prompt_cache is None, text[-3000:]  # a resident server keeps upstream's cache
    kv_mib = log.kv_caches[0][0]
    rc, text = serve(100000, "-krm", "window", "--vram-target", "1")  # the probe: the budget line gives the fixed part
    log = logparse.parse_log(text)
    assert rc not in (None, 0) and log.budgets, text[-3000:]
    target = str(int(1 - log.budgets[-1]["budget"] + kv_mib / 2))

    def to_pin_of(text: str) -> int:
        """What the tail may still pin when the server checks its cache: the reserved tail less what the worker has
        pinned by then (it may back a first step at boot), one of the amounts the log's growth lines leave."""
        log = logparse.parse_log(text)
        assert len(log.host_tails) == 1 and log.host_tails[0]["pinned_mib"] == 0, text[-3000:]
        reserved = int(log.host_tails[0]["reserved_mib"])
        assert reserved > 0 and log.prompt_cache is not None, text[-3000:]
        left = {reserved, *(reserved - int(g["pinned_mib"]) for g in log.host_tail_grows)}
        assert log.prompt_cache["to_pin"] in left, (left, text[-3000:])
        return log.prompt_cache["to_pin"]

    # the default limit (8192 MiB) on a host with 4096 MiB available: lowered to 4096 less what the tail may still
    # pin less the 1024 kept free
    rc, text = serve(4096, "-krm", "window", "--vram-target", target)
    log = logparse.parse_log(text)
    assert rc is None and "listening on" in text, text[-3000:]
    assert log.window is not None and not log.window.fully_resident and log.window.host_tail_mib > 0, text[-3000:]
    to_pin = to_pin_of(text)
    assert to_pin > 0
    assert log.prompt_cache == {"was": 8192, "limit": 4096 - to_pin - 1024, "available": 4096, "to_pin": to_pin,
                                "lowered": True}, text[-3000:]
    # no limit on a host with 512 MiB: disabled
    rc, text = serve(512, "-krm", "window", "--vram-target", target, "--cache-ram", "-1")
    assert rc is None and logparse.parse_log(text).prompt_cache == {"was": None, "limit": 0, "available": 512,
                                                                    "to_pin": to_pin_of(text), "lowered": True}, text[-3000:]
    # a limit that fits is kept
    rc, text = serve(100000, "-krm", "window", "--vram-target", target, "--cache-ram", "2048")
    assert rc is None and logparse.parse_log(text).prompt_cache == {
        "was": 2048, "limit": 2048, "available": 100000, "to_pin": to_pin_of(text), "lowered": False}, text[-3000:]
    # with the tail pinned at boot (LLAMA_KV_HOST_ON_DEMAND=0) nothing is left to pin: the limit is 4096 - 1024
    rc, text = serve(4096, "-krm", "window", "--vram-target", target, env_extra={"LLAMA_KV_HOST_ON_DEMAND": "0"})
    assert rc is None and logparse.parse_log(text).prompt_cache == {"was": 8192, "limit": 3072, "available": 4096,
                                                                    "to_pin": 0, "lowered": True}, text[-3000:]


# upstream's own failures at -c 512 and one generated token: the learned-position models, whose prompt runs past
# their n_ctx_train of 256 (the diffusion models, which fail at the H200 gate's -c 8192 with 8 tokens, run here;
# their memory is none: no KV cache)
UPSTREAM_FAILURES = ["gpt2-dense", "mpt-dense", "starcoder-dense"]
NO_KV = ("recurrent state only", "none (")


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_every_architecture_runs_under_the_default_with_the_cpu_standing_in_for_a_gpu(cpu_build, writer, request):
    """Every model of the fixture that resident runs also loads and decodes under the packaged default, through
    patch 0092's hook, so auto's window path (the decision, the sizer, the reserve) runs for every architecture in
    CI; every attention memory's default takes the window mode."""
    ctx = context.GateContext(build=cpu_build["prefix"], work=cpu_build["work"] / "archs-every", gpu=None,
                             llama_tree=cpu_build["src"], env={**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB},
                             options={"archs_default_only": True, "archs_jobs": 2, "archs_ctx": 512, "archs_gen": 1,
                                      "archs_writer": writer})
    with shown(request):
        res = run_gate("archs", ctx)
    s = res.results["summary"]
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    assert s["models"] == 128 and s["auto_fails_where_resident_runs"] == []
    assert s["upstream_failures"] == UPSTREAM_FAILURES
    rows = res.results["rows"]
    took = [r for r in rows if r["resident_ok"] and r["memory"] and not r["memory"].startswith(NO_KV)]
    no_kv = sorted(r["arch"] for r in rows if r["resident_ok"] and r["memory"] and r["memory"].startswith(NO_KV))
    assert no_kv == ["dream-dense", "llada-dense", "llada-moe-moe", "mamba-dense", "mamba2-dense", "rnd1-moe"]
    assert len(took) == 128 - len(UPSTREAM_FAILURES) - len(no_kv)  # every other memory: auto -> window mode


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_the_server_gate_on_the_cpu_standing_in_for_a_gpu(cpu_build, writer, request):
    """Issue 26's server-defaults gate with the real llama-server of the CPU build, the CPU standing in for a GPU
    (0092): at the packaged defaults (slot count and unified KV untouched), window with >= 40 % of the cells in
    the host tail gives the resident answers through waves, idle-slot saves and restores from the prompt cache,
    cache reuse (a K-shift of cached chunks), a slot saved to a file, erased and restored (the files identical),
    ubatches of 16 with a q8_0 K, speculative decoding with a draft model (the main and the draft context
    together within one --vram-target, patch 0096), and a context shift of a q8_0 K with the other slots answering
    beside it (its f32 copies in chunks within the compute buffer, patch 0098). A small model and context keep it to a
    CI budget."""
    ctx = context.GateContext(build=cpu_build["prefix"], work=cpu_build["work"] / "server-stand-in", gpu=None,
                             llama_tree=cpu_build["src"], env={**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB},
                             options={"archs_writer": writer, "server_layers": 2, "server_embd": 256,
                                      "server_heads": 4, "server_ff": 512, "server_ctx": 16384, "server_gen": 4})
    with shown(request):
        res = run_gate("server", ctx)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    cases = {c["case"]: c for c in res.results["cases"]}
    assert sorted(cases) == sorted(["defaults", "cache-reuse", "slot-file", "short-ubatch", "draft", "context-shift"])
    assert all(c["tail_fraction"] >= 0.4 and c["cells_used"] > c["cells_resident"] for c in cases.values()), cases
    rows = res.results["rows"]
    assert rows and all(r["tokens_equal"] and r["max_abs_diff"] == 0.0 for r in rows)
    # the real server restored the wave-2 prompts from its prompt cache and moved the cached chunks
    assert all(r["cache_n"] > 0 for r in rows if r["step"] in ("wave 4", "moved", "after restore")), rows
    assert cases["slot-file"]["n_restored"] == cases["slot-file"]["n_saved"] > 0
    # the draft case: speculative decoding ran on both servers, and the draft context took a window of its own
    assert [c.ok for c in res.checks if c.name.startswith("draft, ") and "drafted" in c.name] == [True, True]
    assert any(n.startswith("draft: the window server's caches") for n in res.notes), res.notes
    together = next(c for c in res.checks if c.name == "draft: the main and the draft context together keep to the "
                                                          "--vram-target")
    assert together.ok and "budget lines: 2" in together.detail, together
    # the real server shifted the long prompt's slot on both servers
    assert [c.ok for c in res.checks if c.name.startswith("context-shift, ") and "slot shifted" in c.name] == [True, True]
    # its q8_0 K shifted in chunks within the compute buffer on both servers (patch 0098)
    assert [c.ok for c in res.checks if c.name.startswith("context-shift, ") and "in chunks" in c.name] == [True, True]


def _stand_in_dump(cpu_build, model, prompt_file, out, *args, env=None):
    """llama-logits-dump with the CPU standing in for a GPU (0092); its exit, stderr and parsed log."""
    import subprocess

    from rollkv_dist.gates import logparse

    p = subprocess.run([cpu_build["prefix"] / "bin" / "llama-logits-dump", "-m", model, "-f", prompt_file, "-n", "2",
                        "-b", "512", "-ub", "512", "-fa", "on", "--logits-out", out, "-lv", "4", *args],
                       env={**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB, **(env or {})},
                       capture_output=True, text=True, timeout=900)
    return p, logparse.parse_log(p.stderr)


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_the_host_tail_is_pinned_as_cells_come_into_use(cpu_build, writer, tmp_path):
    """Patch 0101 (issue 28): the host tail is address space at boot and is pinned in steps as the cells are used,
    ahead of them. On the CPU standing in for a GPU (0092) the tail's pages stay inaccessible until backed, so a
    read of a cell past the backed ones would end the process. A 20 000-token prompt at -c 65536 with a window of
    about an eighth of the cells: nothing pinned at boot, several steps as the prompt fills the tail, less than
    the whole tail pinned at the end, and the logits, also after a K-shift and a state save/clear/restore (whose
    cells are backed before they are written), identical to resident and to the tail pinned at boot
    (LLAMA_KV_HOST_ON_DEMAND=0). With the pinned tail capped below what the prompt needs
    (LLAMA_KV_HOST_PIN_CAP_MIB), the decode that needed more fails with the MiB needed and what to change."""
    import itertools
    import random
    import re
    import subprocess

    out = tmp_path / "models"
    out.mkdir()
    subprocess.run([writer, "-a", "llama", "-o", out], check=True, capture_output=True)
    model = out / "llama-dense.gguf"
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join("".join(rng.choice(letters) for _ in range(4)) for _ in range(20000)))
    ctx = ["-c", "65536"]
    shift = ["--kv-shift", "512", "--state-roundtrip"]

    p, log = _stand_in_dump(cpu_build, model, prompt, tmp_path / "resident", *ctx, "-krm", "resident", *shift)
    assert p.returncode == 0 and log.kv_caches, p.stderr[-3000:]
    n_prompt = int(re.search(r"logits-dump: prompt (\d+) tokens", p.stderr).group(1))
    kv_mib = log.kv_caches[0][0]
    p, log = _stand_in_dump(cpu_build, model, prompt, tmp_path / "probe", *ctx, "-krm", "window", "--vram-target", "1")
    assert p.returncode != 0 and log.budgets, p.stderr[-3000:]
    target = str(int(1 - log.budgets[-1]["budget"] + kv_mib / 8))
    window = [*ctx, "-krm", "window", "--vram-target", target]

    p, log = _stand_in_dump(cpu_build, model, prompt, tmp_path / "ondemand", *window, *shift)
    assert p.returncode == 0, p.stderr[-3000:]
    w = log.window
    assert w is not None and not w.fully_resident and w.cells_resident < n_prompt < w.kv_size, (w, n_prompt)
    assert log.host_tails == [{"reserved_mib": w.host_tail_mib, "pinned_mib": 0.0, "on_demand": True}], log.host_tails
    grows = log.host_tail_grows
    assert len(grows) >= 2, p.stderr[-3000:]
    cells = [g["cells"] for g in grows]
    assert cells == sorted(cells) and cells[-1] >= n_prompt and cells[-1] < w.kv_size, grows
    assert [g["pinned_mib"] for g in grows] == list(itertools.accumulate(g["mib"] for g in grows))
    assert grows[-1]["pinned_mib"] < grows[-1]["reserved_mib"] == int(w.host_tail_mib), grows
    ref = (tmp_path / "resident.f32").read_bytes()
    assert (tmp_path / "ondemand.f32").read_bytes() == ref

    p, log = _stand_in_dump(cpu_build, model, prompt, tmp_path / "eager", *window, *shift,
                            env={"LLAMA_KV_HOST_ON_DEMAND": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert log.host_tails == [{"reserved_mib": w.host_tail_mib, "pinned_mib": w.host_tail_mib, "on_demand": False}]
    assert not log.host_tail_grows and (tmp_path / "eager.f32").read_bytes() == ref

    # the cap: the first step fits, the prompt needs more
    cap = grows[0]["mib"] + 1
    p, log = _stand_in_dump(cpu_build, model, prompt, tmp_path / "capped", *window,
                            env={"LLAMA_KV_HOST_PIN_CAP_MIB": str(cap)})
    assert p.returncode != 0, p.stderr[-3000:]
    f = log.host_tail_failed
    assert f is not None and f["device"] == "CPU" and f["room_mib"] < f["need_mib"], p.stderr[-3000:]
    assert w.cells_resident < f["cells"] <= n_prompt + 512, (f, w)
    assert f"LLAMA_KV_HOST_PIN_CAP_MIB {cap}" in p.stderr and "shorten the prompt" in p.stderr
    failed_at = int(re.search(r"failed to decode the prompt at token (\d+)", p.stderr).group(1))
    assert w.cells_resident <= failed_at + 512 and failed_at < n_prompt, (failed_at, w)


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_a_tail_that_cannot_grow_fails_that_request_and_the_server_goes_on(cpu_build, tiny_model, tmp_path):
    """Patch 0101: llama-server with a window whose host tail is pinned on demand and capped below what a long
    prompt needs: that request is answered with the reason (the MiB needed, what to change), and the server goes
    on: a short request after it is answered, and so is a prompt that fills the window without the tail."""
    from rollkv_dist.errors import RollkvError
    from rollkv_dist.gates.llama_server import LlamaServer

    # f32 K/V: 512 bytes a cell of the tiny model, a granule of 2 MiB holds 4096 cells of each tensor
    args = ["-m", str(tiny_model), "-c", "32768", "-ctk", "f32", "-ctv", "f32", "-np", "1", "-b", "512", "-ub", "512",
            "-fa", "on", "-krm", "window", "-lv", "4"]
    env = {**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": STAND_IN_MIB, "LLAMA_KV_HOST_PIN_CAP_MIB": "1"}
    server = cpu_build["prefix"] / "bin" / "llama-server"
    with LlamaServer(server, [*args, "--vram-target", "1"], tmp_path / "probe.log", env=env, boot_timeout=300) as probe:
        assert not probe.booted  # the probe: the budget line gives the fixed part
        budgets = probe.parsed().budgets
    assert budgets, probe.log()[-3000:]
    # a 15 MiB budget for the 16 MiB KV (four tensors): one granule of each on the device, 16384 cells
    target = str(int(1 - budgets[-1]["budget"] + 15))
    srv = LlamaServer(server, [*args, "--vram-target", target], tmp_path / "server.log", env=env, boot_timeout=300,
                      request_timeout=600)
    with srv:
        assert srv.booted, srv.log()[-3000:]
        w = srv.parsed().window
        assert w is not None and 0 < w.cells_resident < 32768 - 2048, w

        def ask(n: int, seed: int) -> dict:
            return srv.post("/completion", {"prompt": [1000 + (7919 * i + seed) % 50000 for i in range(n)],
                                            "n_predict": 4, "temperature": 0, "cache_prompt": False,
                                            "return_tokens": True})

        with pytest.raises(RollkvError) as e:
            ask(w.cells_resident + 1024, 0)
        assert "HTTP 500" in str(e.value) and "more pinned host memory" in str(e.value), str(e.value)
        assert "LLAMA_KV_HOST_PIN_CAP_MIB 1" in str(e.value) and "shorten the prompt" in str(e.value)
        assert len(ask(200, 1)["tokens"]) == 4
        assert len(ask(w.cells_resident - 512, 2)["tokens"]) == 4
        assert srv.get("/health")["status"] == "ok"
        failed = srv.parsed().host_tail_failed
    assert failed is not None and failed["room_mib"] == 1 and failed["cells"] > w.cells_resident, failed


@pytest.mark.xdist_group("llama-cpu-build")
def test_auto_without_a_context_keeps_the_training_context_with_the_tail_pinned_on_demand(cpu_build, tmp_path):
    """Patch 0101 (issue 28's default context): with the host tail pinned as cells come into use, llama-server in auto
    without -c keeps the model's training context (262 144 cells here): common's fit fits the layers only and says
    so, the window holds what the device budget allows and the rest is a tail reserved with nothing pinned. With
    LLAMA_KV_HOST_ON_DEMAND=0 (the tail pinned at boot) auto fits as upstream: the layers-only line is absent and
    the tail is pinned at boot. The CPU stands in for a 1400 MiB GPU (0092)."""
    from rollkv_dist import models
    from rollkv_dist.gates import logparse
    from rollkv_dist.gates.llama_server import LlamaServer

    # 2 KiB of f16 K+V a cell over both layers: 512 MiB at the training context, more than the stand-in's budget
    shape = models.Shape("ctx262k", n_layer=2, n_embd=256, n_head=2, n_head_kv=2, n_ff=512, n_ctx_train=262144,
                         rope_theta=1e6, rms_eps=1e-6, tied_output=True)
    model = models.write_random_gguf(tmp_path / "ctx262k.gguf", shape, qtype="f16", llama_tree=cpu_build["tree"],
                                     progress=False)["path"]
    server = cpu_build["prefix"] / "bin" / "llama-server"
    args = ["-m", str(model), "-b", "64", "-ub", "64", "-lv", "4"]
    base_env = {**os.environ, "LLAMA_KV_TEST_HOST_DEVICE_MIB": "1400"}
    base_env.pop("LLAMA_KV_HOST_ON_DEMAND", None)
    runs = {}
    for name, env in (("on-demand", base_env), ("at-boot", {**base_env, "LLAMA_KV_HOST_ON_DEMAND": "0"})):
        with LlamaServer(server, args, tmp_path / f"{name}.log", env=env, boot_timeout=300) as srv:
            assert srv.booted, srv.log()[-3000:]
            runs[name] = (srv.log(), logparse.parse_log(srv.log()))
    text, log = runs["on-demand"]
    assert "n_ctx = 0 keeps the model's training context" in text, text[-3000:]
    assert log.n_ctx == 262144, text[-3000:]
    assert log.window is not None and 0 < log.window.cells_resident < 262144, text[-3000:]
    assert len(log.host_tails) == 1 and log.host_tails[0]["on_demand"], text[-3000:]
    assert log.host_tails[0]["reserved_mib"] > 0 and log.host_tails[0]["pinned_mib"] == 0, text[-3000:]
    text, log = runs["at-boot"]
    assert "fitting the layers only" not in text, text[-3000:]
    assert len(log.host_tails) == 1 and not log.host_tails[0]["on_demand"], text[-3000:]
    assert log.host_tails[0]["pinned_mib"] == log.host_tails[0]["reserved_mib"] > 0, text[-3000:]
