"""End to end on the real pin: fetch -> source (patches/series) -> pack -> unpack -> CPU build
-> run the binaries on a random-weight model. The build is the session's one shared CPU build
(tests/conftest.py: cpu_build, about 12 min on 2 cores), which the recipe test uses too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import PATCHES, fetch_settings

from rollkv_dist.series import PROVENANCE_FILE, read_series

# one xdist worker runs every test of the shared build (nox: -n 2 --dist loadgroup), so it is built once
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("llama-cpu-build")]

REPO = Path(__file__).resolve().parent.parent


def test_repo_patches_regenerate_byte_for_byte(tmp_path):
    """`rollkv patches check` on the repository's own queue (what CI guards)."""
    from rollkv_dist.patches import check_queue

    assert check_queue(PATCHES, fetch_settings(tmp_path), workdir=tmp_path) == 0


def test_the_boot_repro_baseline_is_the_series_before_the_reserve_patch(tmp_path):
    """The gates' baseline (boot-repro) applies on the pinned tree: the series before the compute-reserve patch,
    whose code it lacks. Leaving that patch out alone does not apply: the patches after it build on it."""
    from rollkv_dist.errors import PatchError
    from rollkv_dist.series import COMPUTE_RESERVE_ROLE, from_patch_on, patch_with_role
    from rollkv_dist.source import SourceSettings, prepare_source

    fetch = fetch_settings(tmp_path)
    names = read_series(PATCHES)
    reserve = patch_with_role(PATCHES, COMPUTE_RESERVE_ROLE)
    left_out = from_patch_on(names, reserve)
    tree = prepare_source(SourceSettings(target=tmp_path / "before", patches_dir=PATCHES, without=left_out,
                                         fetch=fetch))
    prov = json.loads((tree / PROVENANCE_FILE).read_text())
    assert prov["series"] == names[:names.index(reserve)] and prov["excluded"] == list(left_out)
    context = (tree / "src" / "llama-context.cpp").read_text()
    assert "--kv-residency-mode" in (tree / "common" / "arg.cpp").read_text()  # the window is there
    assert "pass 1 measured" not in context and "two-pass" not in context  # the measured reserve is not
    if names[-1] != reserve:
        with pytest.raises(PatchError, match="does not apply"):
            prepare_source(SourceSettings(target=tmp_path / "without", patches_dir=PATCHES, without=(reserve,),
                                          fetch=fetch))


# the four files of the lab overlay as they were in the tree that every GPU report up to 2026-12-07 measured (the
# 22-patch series of c4496fc, whose 0004 still read the prefetch copy switches): `rollkv source --lab` rebuilds it
MEASURED_TREE = {
    "ggml/src/ggml-cuda/common.cuh": "683bb14534e4f8a54e0c79a54e6f95d372b74c8404a190414643eb66d3481d1e",
    "ggml/src/ggml-cuda/cpy.cu": "807ae64e072ad14e694c3e9296e19ef04d7267a2e8e7912ceb697136902c34c8",
    "ggml/src/ggml-cuda/cpy.cuh": "ba4254fd229748776a0359ea8fd75fb323b524c0802cfee4bf1f8c6324ee0b49",
    "ggml/src/ggml-cuda/ggml-cuda.cu": "dde65662e5754f31b68b2dbf4d512dd7d8eca805dc2044391b12de1b089dd559",
}
# patches newer than the tree the reports measured that change its files (0101 adds host memory on demand to
# ggml-cuda.cu, 0104 the concurrent streams to its scratch bound): the proof takes them back out of those files (git
# apply -R, newest first) before it compares
AFTER_MEASURED = ("0104-ggml-cuda-the-scratch-bound-counts-concurrent.patch",
                  "0101-kv-cache-host-memory-on-demand-the-host-tail-is.patch")
LAB_SWITCHES = ("GGML_CUDA_WINDOW_PREFETCH", "GGML_CUDA_PREFETCH_COPY", "GGML_CUDA_PREFETCH_SM_DIV",
                "GGML_CUDA_PREFETCH_DEVICE_CELLS", "GGML_CUDA_PREFETCH_GROUP")


def test_the_lab_overlay_rebuilds_the_measured_tree_and_the_product_has_no_switches(tmp_path):
    """Issue 27's proof: the product series reads none of the prefetch copy switches; the series plus the lab
    overlay, less the patches newer than the measurement (AFTER_MEASURED, taken back out of those files), is byte
    for byte the tree the GPU reports measured; the product differs from it only in those files."""
    from rollkv_dist.series import read_lab
    from rollkv_dist.source import SourceSettings, prepare_source
    from rollkv_dist.util import sha256_file

    fetch = fetch_settings(tmp_path)
    lab = prepare_source(SourceSettings(target=tmp_path / "lab", patches_dir=PATCHES, without=(), fetch=fetch,
                                        lab=True))
    product = prepare_source(SourceSettings(target=tmp_path / "product", patches_dir=PATCHES, without=(),
                                            fetch=fetch))
    # the patches newer than the measurement, taken back out of these files of both trees
    for tree in (lab, product):
        for name in AFTER_MEASURED:
            subprocess.run(["git", "apply", "-R", *(f"--include={rel}" for rel in MEASURED_TREE), str(PATCHES / name)],
                           cwd=tree, check=True, capture_output=True)
    assert {rel: sha256_file(lab / rel) for rel in MEASURED_TREE} == MEASURED_TREE
    assert json.loads((lab / PROVENANCE_FILE).read_text())["lab"] == read_lab(PATCHES)
    changed = sorted(rel for rel in MEASURED_TREE if sha256_file(product / rel) != MEASURED_TREE[rel])
    assert changed == sorted(MEASURED_TREE)
    for rel in MEASURED_TREE:
        text = (product / rel).read_text()
        assert not any(f'"{s}' in text for s in LAB_SWITCHES), f"{rel} reads a lab switch"
    assert all(f'"{s}"' in (lab / "ggml/src/ggml-cuda/ggml-cuda.cu").read_text() for s in LAB_SWITCHES)
    # every other file of the two trees is the same (the overlay touches these four only)
    rest = [p.relative_to(product) for p in product.rglob("*") if p.is_file() and p.name != PROVENANCE_FILE]
    assert len(rest) > 1000
    assert [str(r) for r in rest if str(r) not in MEASURED_TREE and sha256_file(product / r) != sha256_file(lab / r)] == []


def test_source_and_pack(cpu_build):
    prov = json.loads((cpu_build["src"] / PROVENANCE_FILE).read_text())
    assert prov["series"] == read_series(PATCHES)
    assert prov["manifest"]["status"] in ("byte-identical-verified", "empty-series")
    size = cpu_build["archive"].stat().st_size
    assert size < 12_000_000, f"pack is {size / 1e6:.1f} MB"
    tree = cpu_build["tree"]
    assert (tree / "models" / "ggml-vocab-qwen2.gguf").is_file()
    assert (tree / "patches" / "series").read_text() == (PATCHES / "series").read_text()
    assert not (tree / "docs").exists() and not (tree / "tests").exists()


def test_build_info(cpu_build):
    info = cpu_build["info"]
    assert info["variant"] == "cpu"
    assert info["series"] == read_series(PATCHES)
    # the effective cache: rollkv.cmake's values, as the build dir ended up with them
    assert info["cmake_cache"]["LLAMA_USE_PREBUILT_UI"] == "OFF"
    assert info["cmake_cache"]["LLAMA_OPENSSL"] == "OFF"
    assert info["cmake_cache"]["LLAMA_BUILD_COMMIT"] == f"0c1e57098+rollkv.{len(info['series'])}"
    assert info["compilers"]["cxx"]["version"]
    for t in cpu_build["targets"]:
        assert f"bin/{t}" in info["installed"]
    assert (cpu_build["prefix"] / "share" / "rollkv" / PROVENANCE_FILE).is_file()


def test_version_names_the_pin(cpu_build):
    exe = cpu_build["prefix"] / "bin" / "llama-cli"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert f"commit 0c1e57098+rollkv.{len(read_series(PATCHES))}" in text


def test_version_gate_passes_on_the_real_build(cpu_build, tmp_path):
    """The version gate's reading of `--version` against the real programs, not only the fakes (its first
    GPU run, on the conda artifact, failed on the format the fakes did not print)."""
    from test_gates import ctx_for, run_one

    ctx = ctx_for(tmp_path)
    ctx.build = cpu_build["prefix"]
    res = run_one("version", ctx)
    assert res.verdict == "pass", [(c.name, c.detail) for c in res.checks if not c.ok]
    assert res.results["programs"]["llama-server"]["version"].startswith("version: ")


def test_server_generates_tokens(cpu_build, tiny_model):
    """The CPU smoke gate (`rollkv smoke`) on the source build."""
    from rollkv_dist.smoke import N_PREDICT, run_smoke

    res = run_smoke(cpu_build["prefix"], tiny_model, cpu_build["work"] / "smoke")
    assert res["tokens_predicted"] == N_PREDICT and res["repeatable"], res
    assert res["server"] == str(cpu_build["prefix"] / "bin" / "llama-server")


def test_recipe_test_passes_on_the_source_build(cpu_build):
    """`rollkv build` records the series like the conda package: recipe/run_test.sh applies."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    proc = subprocess.run(["bash", str(REPO / "recipe" / "run_test.sh")],
                          env={**env, "PREFIX": str(cpu_build["prefix"])},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: llama-server --help shows --kv-compute-reserve" in proc.stdout


def test_cli_single_turn_generates(cpu_build, tiny_model):
    exe = cpu_build["prefix"] / "bin" / "llama-cli"
    out = subprocess.run(
        [str(exe), "-m", str(tiny_model), "-p", "Hello", "-n", "8", "-st", "-t", "2",
         "-c", "256", "--temp", "0"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    after = out.stdout.split("> Hello", 1)[1]
    generated = after.split("[ Prompt:", 1)[0].strip()
    assert generated, out.stdout[-2000:]
    assert "Generation:" in after


def test_logits_dump_is_greedy(cpu_build, tiny_model, tmp_path):
    import numpy as np

    if "llama-logits-dump" not in cpu_build["targets"]:
        pytest.skip("the series has no tools/logits-dump")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is")
    exe = cpu_build["prefix"] / "bin" / "llama-logits-dump"
    out = subprocess.run(
        [str(exe), "-m", str(tiny_model), "-f", str(prompt), "-n", "4",
         "--logits-out", str(tmp_path / "ld"), "-t", "2"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    meta = json.loads((tmp_path / "ld.json").read_text())
    rows = np.fromfile(tmp_path / "ld.f32", dtype=np.float32)
    assert rows.size == meta["n_rows"] * meta["n_vocab"]
    rows = rows.reshape(meta["n_rows"], meta["n_vocab"])
    assert len(meta["tokens"]) == 4 and meta["n_prompt"] > 0
    assert list(rows.argmax(axis=1)[:4]) == meta["tokens"]


def test_window_test_on_a_cpu_build_skips_what_needs_a_gpu(cpu_build):
    # the engine gate's program on a CPU-only build: the CPU backend must not export window
    # buffers, everything that needs them is a SKIP, and nothing fails
    if "llama-window-test" not in cpu_build["targets"]:
        pytest.skip("the series has no tools/window-test")
    exe = cpu_build["prefix"] / "bin" / "llama-window-test"
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "PASS CPU: the CPU backend exports no window buffers" in lines
    assert any(ln.startswith("SKIP window buffers:") for ln in lines)
    assert not any(ln.startswith("FAIL") for ln in lines)
    assert lines[-1] == "window-test: 0 device(s) with window buffers, 0 failure(s)"


def test_llama_bench_ctx_size_sets_every_tests_context(cpu_build, tiny_model):
    """0006's -c: each test's context has at least N cells (the curve gate's --curve-ctx); default as upstream."""
    exe = cpu_build["prefix"] / "bin" / "llama-bench"

    def n_ctx(*extra):
        p = subprocess.run([str(exe), "-m", str(tiny_model), "-p", "8", "-n", "0", "-r", "1", "-v", *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return [int(ln.split("=")[1]) for ln in p.stderr.splitlines() if "llama_context: n_ctx " in ln]

    assert n_ctx("-c", "4096") == [4096]
    assert n_ctx() == [256]  # 8 prompt tokens, padded as upstream
    p = subprocess.run([str(exe), "-m", str(tiny_model), "-c", "x"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "invalid value for --ctx-size: 'x' (expected cells >= 0)" in p.stdout + p.stderr


def test_rolling_kv_flags_and_auto_on_a_cpu_build(cpu_build, tiny_model, tmp_path):
    # auto resolves to resident without a GPU (with the reason, at the default verbosity); an
    # explicit window is refused with the flag to change; a --vram-target list of the wrong length
    # and a bad --kv-compute-reserve name the flag
    exe = cpu_build["prefix"] / "bin" / "llama-logits-dump"
    if not exe.exists():
        pytest.skip("the series has no tools/logits-dump")
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello")
    base = [str(exe), "-m", str(tiny_model), "-f", str(prompt), "-n", "1", "-t", "2", "-c", "256"]
    auto = subprocess.run([*base, "--logits-out", str(tmp_path / "a"), "-krm", "auto"],
                          capture_output=True, text=True, timeout=300)
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "kv residency: auto -> resident: there is no GPU device" in auto.stdout + auto.stderr
    win = subprocess.run([*base, "--logits-out", str(tmp_path / "w"), "-krm", "window", "-fa", "on"],
                         capture_output=True, text=True, timeout=300)
    assert win.returncode != 0
    assert "needs a GPU backend" in win.stdout + win.stderr
    two = subprocess.run([*base, "--logits-out", str(tmp_path / "t"), "-krm", "window", "-fa", "on",
                          "--vram-target", "9000,9000"], capture_output=True, text=True, timeout=300)
    assert two.returncode != 0
    assert "--vram-target has 2 values but the model uses 0 GPU device(s) (none)" in two.stdout + two.stderr
    bad = subprocess.run([*base, "--logits-out", str(tmp_path / "b"), "--kv-compute-reserve", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "invalid value for --kv-compute-reserve: 'x'" in bad.stdout + bad.stderr


@pytest.mark.parametrize("extra", [[], ["--kv-shift", "64", "--state-roundtrip"]], ids=["plain", "shift+state"])
def test_staging_graph_gives_the_plain_logits_on_a_cpu_build(cpu_build, tiny_model, tmp_path, extra):
    """0020's LLAMA_KV_STAGE_EVERY_CELL=1 builds the staging graph of a host tail (0008) with the prefetch (0017:
    the next layer's copy made first, this ubatch's rows written into it after) on the CPU: the logits must be
    the plain run's, bit for bit. A prompt of several ubatches makes the rows land in copies of earlier cells.
    (With the rows of 0017 left out on purpose the logits differed by up to 1.15 on this model.)"""
    import numpy as np

    exe = cpu_build["prefix"] / "bin" / "llama-logits-dump"
    if not exe.exists():
        pytest.skip("the series has no tools/logits-dump")
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(words[(7 * i) % len(words)] for i in range(700)))
    base = [str(exe), "-m", str(tiny_model), "-f", str(prompt), "-n", "8", "-c", "2048", "-fa", "on",
            "-b", "512", "-ub", "128", "-t", "2", *extra]
    runs = {}
    for name, env in (("plain", {}), ("staged", {"LLAMA_KV_STAGE_EVERY_CELL": "1"})):
        out = subprocess.run([*base, "--logits-out", str(tmp_path / name)], capture_output=True, text=True,
                             timeout=300, env={**os.environ, **env})
        assert out.returncode == 0, out.stderr[-3000:]
        staged_line = "LLAMA_KV_STAGE_EVERY_CELL=1: every layer reads a staged copy" in out.stderr
        assert staged_line is (name == "staged")
        runs[name] = (json.loads((tmp_path / f"{name}.json").read_text()),
                      np.fromfile(tmp_path / f"{name}.f32", dtype=np.float32))
    (meta_p, plain), (meta_s, staged) = runs["plain"], runs["staged"]
    assert meta_p["n_prompt"] > 4 * 128 and plain.shape == staged.shape and plain.size > 0
    assert float(np.abs(plain - staged).max()) == 0.0
    assert meta_p["tokens"] == meta_s["tokens"]
    if extra:
        assert meta_p.get("kv_shift") == meta_s.get("kv_shift") == 64


def _rpc_server(prefix: Path, log: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """ggml-rpc-server (its CPU backend) on a free loopback port, listening: the rpc gate's own starter; env is
    added to this process's environment."""
    from rollkv_dist.gates.context import GateResult
    from rollkv_dist.gates.rpc import RpcServer

    if not (prefix / "bin" / "ggml-rpc-server").exists():
        pytest.skip("the build has no ggml-rpc-server (GGML_RPC off)")
    node = RpcServer(prefix / "bin" / "ggml-rpc-server", log, {**os.environ, **(env or {})},
                     GateResult(gate="test", gpu=None))
    node.__enter__()
    return node.proc, node.port


def test_a_node_killed_during_a_prompt_stops_the_client_naming_it(cpu_build, tiny_model, tmp_path):
    """The rpc-server is killed while the client evaluates a 3001-token prompt in ubatches of 2 (about 6 s on
    the CPU): the client stops within a minute, naming the node and the command that got no answer (0100),
    instead of a nameless abort or a hang."""
    import random
    import time

    server, port = _rpc_server(cpu_build["prefix"], tmp_path / "rpc-server.log")
    rng = random.Random(0)
    words = "the of and river mountain window garden engine signal pattern".split()
    (tmp_path / "p.txt").write_text(" ".join(rng.choice(words) for _ in range(3000)))
    cmd = [str(cpu_build["prefix"] / "bin" / "llama-logits-dump"), "-m", str(tiny_model), "-f", str(tmp_path / "p.txt"),
           "-n", "8", "-t", "2", "-c", "8192", "-b", "2", "-ub", "2", "--rpc", f"127.0.0.1:{port}", "-ngl", "99",
           "--logits-out", str(tmp_path / "out")]
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        seen = []
        for line in client.stdout:
            seen.append(line)
            if "logits-dump: prompt 3001 tokens" in line:  # the context is up; the prompt's ubatches start
                time.sleep(1.0)
                server.kill()
                break
        assert any("logits-dump: prompt 3001 tokens" in ln for ln in seen), "".join(seen)[-3000:]
        server.wait(timeout=10)
        rest, _ = client.communicate(timeout=60)  # a client that hangs on its dead node fails here
        said = "".join(seen) + rest
        assert client.returncode != 0
        assert "prompt evaluated" not in said, "the prompt finished before the node was killed: " + said[-2000:]
        assert re.search(rf"RPC server 127\.0\.0\.1:{port} stopped answering \([A-Z_]+\): it exited, its "
                         r"connection broke or its reply was malformed; restart it, or leave it out of --rpc", said), \
            said[-3000:]
    finally:
        for p in (client, server):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_a_client_killed_during_a_prompt_leaves_the_node_serving_the_next(cpu_build, tiny_model, tmp_path):
    """The other side of a lost peer: a client killed while its prompt runs on the rpc-server. The server drops
    that connection only and answers the next client, whose logits are a fresh client's."""
    import time

    import numpy as np

    prefix = cpu_build["prefix"]
    server, port = _rpc_server(prefix, tmp_path / "rpc-server.log")
    (tmp_path / "p.txt").write_text(" ".join(["river mountain window garden"] * 750))

    def dump(name: str, ub: str) -> list[str]:
        return [str(prefix / "bin" / "llama-logits-dump"), "-m", str(tiny_model), "-f", str(tmp_path / "p.txt"),
                "-n", "2", "-t", "2", "-c", "8192", "-b", ub, "-ub", ub, "--rpc", f"127.0.0.1:{port}", "-ngl", "99",
                "--logits-out", str(tmp_path / name)]

    try:
        ref = subprocess.run(dump("ref", "512"), capture_output=True, text=True, timeout=300)
        assert ref.returncode == 0, ref.stderr[-2000:]
        victim = subprocess.Popen(dump("victim", "2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
        for line in victim.stdout:
            if "logits-dump: prompt " in line:
                time.sleep(1.0)
                break
        victim.kill()
        assert victim.wait(timeout=30) == -9
        time.sleep(0.5)
        assert server.poll() is None, (tmp_path / "rpc-server.log").read_text()[-2000:]
        after = subprocess.run(dump("after", "512"), capture_output=True, text=True, timeout=300)
        assert after.returncode == 0, after.stderr[-2000:]
        assert np.array_equal(np.fromfile(tmp_path / "ref.f32", dtype=np.float32),
                              np.fromfile(tmp_path / "after.f32", dtype=np.float32))
        assert server.poll() is None
    finally:
        server.kill()
        server.wait(timeout=30)


def test_the_rpc_gate_runs_against_the_real_programs(cpu_build, tiny_model, tmp_path):
    """The rpc gate (a GPU gate) with the CPU build's programs: two real ggml-rpc-servers (their CPU devices
    standing in for a GPU, patch 0102's test hook), the tiny model's layers split over them (-ts 1,3), every
    KV cell of each node in its host tail (--rpc-keep 0 at -c 65536: under one 2 MiB granule per tensor), and
    the probes, runs, server lines and fault handling hold. Only resident-over-RPC against the local CPU may
    differ here: a CPU server's backend can lay the weights out otherwise than the local CPU's (on a GPU both
    are the same kernels); the window runs are held to resident's over the same nodes bit for bit."""
    from rollkv_dist.gates import context
    from rollkv_dist.gates.runner import run_gate

    ctx = context.GateContext(build=cpu_build["prefix"], work=tmp_path / "work", gpu=None,
                              options={"model": str(tiny_model), "rpc_keep": 0.0, "rpc_ctx": 65536,
                                       "rpc_tensor_split": "1,3", "rpc_words": 3000},
                              env=dict(os.environ))
    res = run_gate("rpc", ctx)
    failed = [c.name for c in res.checks if not c.ok]
    assert set(failed) <= {f"{run} vs local{' resident' if run != 'resident over RPC' else ''}: logits identical "
                           "(max |diff| == 0)" for run in ("resident over RPC", "window over RPC with host tails",
                                                           "auto over RPC with host tails")}, res.checks
    assert [c.name for c in res.checks if "vs resident over the same nodes" in c.name and c.ok] == [
        f"{mode} over RPC with host tails vs resident over the same nodes: {what}" for mode in ("window", "auto")
        for what in ("logits finite", "logits identical (max |diff| == 0)", "greedy tokens identical")]
    runs = res.results["runs"]
    for mode in ("window", "auto"):
        assert {d: (w["cells_resident"], w["kv_size"]) for d, w in runs[f"rpc-{mode}"]["windows"].items()} == {
            "RPC0": (0, 65536), "RPC1": (0, 65536)}
    # every run that ran its prompt says what it cost per token (llama_perf's lines); the probes stop before
    assert all(r["prefill_tps"] > 0 and r["decode_tps"] > 0 for n, r in runs.items() if r["rc"] == 0), runs
    assert all(r["prefill_tps"] is None for n, r in runs.items() if n.startswith("rpc-probe")), runs
    assert res.results["fault"]["killed"] and res.results["fault"]["rc"] not in (0, None, "hung")
    assert any(c.name.startswith("fault: the client names the node") and c.ok for c in res.checks)
    assert any(c.name == "no process left running (none holds GPU memory)" and c.ok for c in res.checks)


def test_an_rpc_device_keeps_the_kv_whole_where_it_cannot_hold_a_tail(cpu_build, tiny_model, tmp_path):
    """ggml-rpc-server (its CPU backend) on loopback is a GPU device of the client. Its KV above the device budget:
    auto keeps it whole on the device (0099) with the line that says why, and gives resident's logits bit for bit;
    window mode refuses with what to change. A malformed request closes that connection only: the next client
    is served."""
    import socket

    import numpy as np

    prefix = cpu_build["prefix"]
    server, port = _rpc_server(prefix, tmp_path / "rpc-server.log")
    try:
        (tmp_path / "p.txt").write_text("The capital of France is")

        def dump(mode: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [str(prefix / "bin" / "llama-logits-dump"), "-m", str(tiny_model), "-f", str(tmp_path / "p.txt"),
                 "-n", "2", "-t", "2", "-c", "262144", "-fa", "on", "--rpc", f"127.0.0.1:{port}", "-ngl", "99",
                 "--vram-target", "1", "-krm", mode, "--logits-out", str(tmp_path / mode)],
                capture_output=True, text=True, timeout=300)

        window = dump("window")
        said = window.stdout + window.stderr
        assert window.returncode != 0
        assert ("does not fit the device budget of RPC0" in said and "its rpc-server cannot map host memory" in said
                and "lower -c, raise --vram-target" in said), said[-3000:]
        assert "RPC0[127.0.0.1:" in said and "cannot hold a KV host tail: the server's device CPU (CPU backend) has no " \
            "window buffers" in said, said[-3000:]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # not the protocol's HELLO
            s.sendall(bytes(range(200, 256)) * 4)
            s.settimeout(5)
            try:
                assert s.recv(100) == b""
            except ConnectionResetError:
                pass
        auto, resident = dump("auto"), dump("resident")
        assert auto.returncode == 0 and resident.returncode == 0, auto.stderr[-2000:] + resident.stderr[-2000:]
        said = auto.stdout + auto.stderr
        assert re.search(r"kv residency: auto -> resident on RPC0: the KV cache \(\d+ MiB\) is above its device "
                         r"budget \(-\d+ MiB\), and its RPC backend cannot place KV cells", said), said[-3000:]
        assert "position window = FULLY RESIDENT (262144 cells" in said
        a = np.fromfile(tmp_path / "auto.f32", dtype=np.float32)
        assert a.size > 0 and np.array_equal(a, np.fromfile(tmp_path / "resident.f32", dtype=np.float32))
        assert server.poll() is None
        assert "Expected HELLO command" in (tmp_path / "rpc-server.log").read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
