"""End to end on the real pin: fetch -> source (patches/series) -> pack -> unpack -> CPU build
-> run the binaries on a random-weight model. One build per session (about 12 min on 2 cores).

Set ROLLKV_TEST_WORKDIR to keep the work (and the build dir) between runs: an unchanged tree
then reuses its build. The sdist comes from the user cache when it is there and hash-valid, else it is
fetched with pip into a clean cache under the work dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from rollkv_dist.build import BuildSettings, run_build
from rollkv_dist.fetch import FetchSettings
from rollkv_dist.pack import PackSettings, run_pack
from rollkv_dist.series import read_series
from rollkv_dist.source import PROVENANCE_FILE, SourceSettings, prepare_source
from rollkv_dist.util import sha256_file

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"


def _fetch_settings(work: Path) -> FetchSettings:
    """The user's settings when they name a local copy ($ROLLKV_SDIST) or their cache is good;
    else a clean cache under the work dir (still honouring $ROLLKV_SDIST)."""
    user = FetchSettings.resolve()
    cached = user.cached_sdist
    if user.sdist is not None or (cached.is_file() and sha256_file(cached) == user.pin.sha256):
        return user
    keep = {k: v for k, v in os.environ.items() if k == "ROLLKV_SDIST"}
    return FetchSettings.resolve(cache_dir=work / "cache", env=keep)


def _tree_key(tree: Path) -> str:
    """Hash of every file of the tree but the provenance (which carries a creation time)."""
    h = hashlib.sha256()
    for p in sorted(tree.rglob("*")):
        if p.is_file() and p.name != PROVENANCE_FILE:
            h.update(str(p.relative_to(tree)).encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()[:12]


@pytest.fixture(scope="session")
def cpu_build(tmp_path_factory):
    env_work = os.environ.get("ROLLKV_TEST_WORKDIR")
    work = Path(env_work) if env_work else tmp_path_factory.mktemp("rollkv-cpu")
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("src", "unpacked", "prefix", "rollkv-src.tar.xz"):
        p = work / stale
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    fetch = _fetch_settings(work)
    src = work / "src"
    prepare_source(SourceSettings(target=src, patches_dir=PATCHES, without=(), fetch=fetch))
    archive = work / "rollkv-src.tar.xz"
    run_pack(PackSettings.resolve(str(archive), str(src), str(PATCHES)))
    (work / "unpacked").mkdir()
    with tarfile.open(archive) as tf:
        tf.extractall(work / "unpacked", filter="data")
    tree = work / "unpacked" / "rollkv-src"
    targets = ["llama-server", "llama-cli"]
    if (tree / "tools" / "logits-dump").is_dir():
        targets.append("llama-logits-dump")
    # The archive's entries carry one fixed mtime, so a build dir may only be reused for the
    # very same files (ninja would not see changed ones): key it by the tree's content.
    build_dir = work / f"build-{_tree_key(tree)}"
    settings = BuildSettings.resolve(tree, work / "prefix", targets=",".join(targets), jobs=2,
                                     build_dir=build_dir)
    info_path = run_build(settings)
    return {"work": work, "src": src, "tree": tree, "archive": archive,
            "prefix": work / "prefix", "info": json.loads(info_path.read_text()),
            "targets": targets}


@pytest.fixture(scope="session")
def tiny_model(cpu_build):
    from rollkv_dist.models import SHAPES, write_random_gguf

    path = cpu_build["work"] / "tiny-f16.gguf"
    write_random_gguf(path, shape=SHAPES["tiny"], qtype="f16", llama_tree=cpu_build["tree"],
                      seed=0, progress=False)
    return path


def test_repo_patches_regenerate_byte_for_byte(tmp_path):
    """`rollkv patches check` on the repository's own queue (what CI guards)."""
    from rollkv_dist.patches import check_queue

    assert check_queue(PATCHES, _fetch_settings(tmp_path), workdir=tmp_path) == 0


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
    assert info["cmake_definitions"]["LLAMA_USE_PREBUILT_UI"] == "OFF"
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_generates_tokens(cpu_build, tiny_model):
    import requests

    port = _free_port()
    exe = cpu_build["prefix"] / "bin" / "llama-server"
    logf = open(cpu_build["work"] / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(exe), "-m", str(tiny_model), "--host", "127.0.0.1", "--port", str(port),
         "-c", "256", "-t", "2", "-np", "1", "--no-webui"],
        stdout=logf, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (cpu_build["work"] / "server.log").read_text()[-3000:]
            try:
                if requests.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            time.sleep(0.5)
        body = {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0,
                "cache_prompt": False}
        r1 = requests.post(f"{base}/completion", json=body, timeout=120).json()
        r2 = requests.post(f"{base}/completion", json=body, timeout=120).json()
        assert r1["tokens_predicted"] == 8, r1
        assert r1["tokens_evaluated"] > 0
        assert r1["content"] == r2["content"], "greedy decoding must repeat"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()


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
