"""All parsing of llama.cpp output for the gates, in one place.

Formats come from the pinned upstream tree and docs/ENGINE-INTERFACE.md:

- window line (patch "position window"), both forms::

    llama_kv_cache: position window = 123904 / 524288 cells resident (device 23232.00 MiB, host tail 75072.00 MiB)
    llama_kv_cache: position window = FULLY RESIDENT (524288 cells, device 98304.00 MiB)

- two-pass compute reserve (patch 0089): ``kv compute reserve: pass 1 measured ...``,
  ``pass 2 sizes the window ...``, ``pass 2 done (... ms)``, ``single pass ...``, ``fixed ... MiB``
- upstream: ``sched_reserve: %10s compute buffer size = %8.2f MiB`` (llama-context.cpp),
  ``load_tensors: %12s model buffer size = %8.2f MiB`` (llama-model.cpp),
  ``llama_kv_cache: %10s KV buffer size = %8.2f MiB`` (llama-kv-cache.cpp),
  ``graph_reserve: failed to allocate compute buffers``, ``llama_context: n_ctx = %u``,
  ``load_tensors: offloaded %d/%d layers to GPU``, CUDA ``cudaMalloc failed`` lines
- llama-bench ``-o json`` / ``-o jsonl`` rows
- llama-server ``/completion`` response ``timings`` and the ``print_timings`` log lines.

Lines may carry ANSI colours and the common-log prefix (timestamp, ``I ``/``W ``/``E ``):
patterns search inside the line, never anchor at its start.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Iterable

ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NUM = r"([0-9]+(?:\.[0-9]+)?)"

WINDOW_RE = re.compile(
    r"position window = (\d+) / (\d+) cells resident \(device " + NUM + r" MiB, host tail " + NUM + r" MiB\)")
WINDOW_FULL_RE = re.compile(r"position window = FULLY RESIDENT \((\d+) cells, device " + NUM + r" MiB\)")
PASS1_RE = re.compile(
    r"kv compute reserve: pass 1 measured (\S+) compute buffer = " + NUM + r" MiB \(" + NUM + r" ms\)")
PASS2_SIZE_RE = re.compile(
    r"kv compute reserve: pass 2 sizes the window with reserve = " + NUM + r" MiB \(measured " + NUM
    + r" \+ safety " + NUM + r"\)")
PASS2_DONE_RE = re.compile(r"kv compute reserve: pass 2 done \(" + NUM + r" ms\)")
SINGLE_PASS_RE = re.compile(r"kv compute reserve: single pass\b")
FIXED_RE = re.compile(r"kv compute reserve: fixed " + NUM + r" MiB")
COMPUTE_BUF_RE = re.compile(r"(\w+): +(\S+) compute buffer size = +" + NUM + r" MiB")
MODEL_BUF_RE = re.compile(r"load_tensors: +(\S+) model buffer size = +" + NUM + r" MiB")
KV_BUF_RE = re.compile(r"(\w+): +(\S+) KV buffer size = +" + NUM + r" MiB")
KV_SIZE_RE = re.compile(r"llama_kv_cache: size = +" + NUM + r" MiB \( *(\d+) cells, +(\d+) layers")
NO_WINDOW_RE = re.compile(
    r"window mode: no device memory left for the KV window on (\S+) \(free (\d+) MiB, vram target (\d+) MiB, "
    r"model (\d+) MiB, compute reserve (\d+) MiB, margin (\d+) MiB\)")
# configuration refusals of window mode (patches 0001/0003): searching a --vram-target cannot help
REFUSED_RE = re.compile(r"(--kv-residency-mode window (needs|supports|does not support)[^\n]*|"
                        r"window mode: the \S+ backend of [^\n]*cannot place KV cells[^\n]*|"
                        r"window mode: the driver of [^\n]*cannot map host memory[^\n]*)")
GRAPH_FAIL_RE = re.compile(r"graph_reserve: failed to allocate compute buffers")
N_CTX_RE = re.compile(r"llama_context: n_ctx += (\d+)")
N_UBATCH_RE = re.compile(r"llama_context: n_ubatch += (\d+)")
N_BATCH_RE = re.compile(r"llama_context: n_batch += (\d+)")
OFFLOAD_RE = re.compile(r"load_tensors: offloaded (\d+)/(\d+) layers to GPU")
CUDA_OOM_RE = re.compile(r"(cudaMalloc failed|out of memory|failed to allocate \S+ buffer of size)", re.I)
CTX_FAIL_RE = re.compile(r"failed to (initialize the context|create context)[^\n]*")
# llama-server print_timings (SLT_INF prefix "slot print_timing: id  0 | task 0 | ")
PROMPT_EVAL_RE = re.compile(
    r"prompt eval time = +" + NUM + r" ms / +(\d+) tokens \( *" + NUM + r" ms per token, +" + NUM
    + r" tokens per second\)")
EVAL_RE = re.compile(
    r"(?<!prompt )eval time = +" + NUM + r" ms / +(\d+) tokens \( *" + NUM + r" ms per token, +" + NUM
    + r" tokens per second\)")


def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


@dataclass
class Window:
    """One KV cache's window line."""

    fully_resident: bool
    kv_size: int
    cells_resident: int
    device_mib: float
    host_tail_mib: float

    @property
    def tail_fraction(self) -> float:
        """Fraction of the cache's cells in the host tail (0 when fully resident).

        Counted in cells, not in the logged MiB: each K/V tensor's device segment and host tail are
        rounded up to whole VMM granules (2 MiB), so the MiB pair overstates small tails.
        """
        return 0.0 if self.kv_size <= 0 else (self.kv_size - self.cells_resident) / self.kv_size


@dataclass
class ComputeReserve:
    pass1_device: str | None = None
    pass1_measured_mib: float | None = None
    pass1_ms: float | None = None
    pass2_reserve_mib: float | None = None
    pass2_measured_mib: float | None = None
    pass2_safety_mib: float | None = None
    pass2_ms: float | None = None
    single_pass: bool = False
    fixed_mib: float | None = None

    @property
    def two_pass(self) -> bool:
        return self.pass1_measured_mib is not None


@dataclass
class LlamaLog:
    windows: list[Window] = field(default_factory=list)
    reserve: ComputeReserve = field(default_factory=ComputeReserve)
    compute_buffers: dict[str, float] = field(default_factory=dict)  # last value per buffer type
    compute_buffer_history: list[tuple[str, str, float]] = field(default_factory=list)  # (func, buft, MiB)
    model_buffers: dict[str, float] = field(default_factory=dict)
    kv_buffers: dict[str, float] = field(default_factory=dict)  # summed over caches
    kv_caches: list[tuple[float, int, int]] = field(default_factory=list)  # (MiB, cells, layers) per cache
    no_window: dict[str, Any] | None = None  # "no device memory left for the KV window" numbers (MiB)
    window_refused: str | None = None
    graph_reserve_failed: bool = False
    context_failed: str | None = None
    oom_lines: list[str] = field(default_factory=list)
    n_ctx: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    offloaded_layers: tuple[int, int] | None = None
    prompt_eval: dict[str, float] | None = None  # from llama-server print_timings
    eval: dict[str, float] | None = None

    @property
    def window(self) -> Window | None:
        """The main cache's window: the one with a host tail, else the largest cache."""
        if not self.windows:
            return None
        tails = [w for w in self.windows if not w.fully_resident]
        pool = tails or self.windows
        return max(pool, key=lambda w: w.kv_size)

    def window_for(self, n_cells: int) -> Window | None:
        """The window of the smallest cache holding n_cells (llama-bench makes one context per test,
        sized depth + n_prompt or depth + n_gen and padded to 256 cells: decode uses the smaller)."""
        fits = [w for w in self.windows if w.kv_size >= n_cells]
        return min(fits, key=lambda w: w.kv_size) if fits else None

    @property
    def kv_mib_per_cell(self) -> float | None:
        """Exact KV bytes per cell (MiB) of the largest cache, from its `llama_kv_cache: size` line."""
        if not self.kv_caches:
            return None
        mib, cells, _ = max(self.kv_caches, key=lambda c: c[1])
        return mib / cells if cells else None

    @property
    def kv_mib_largest_cache(self) -> float:
        """KV MiB of the largest cache (kv_buffers sums every cache of every context a tool made:
        llama-bench logs one context per test)."""
        return max((c[0] for c in self.kv_caches), default=sum(self.kv_buffers.values()))

    def compute_mib(self, device: str = "CUDA0") -> float | None:
        return self.compute_buffers.get(device)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        w = self.window
        d["window"] = None if w is None else {**asdict(w), "tail_fraction": w.tail_fraction}
        return d


def parse_log(text: str | Iterable[str]) -> LlamaLog:
    """Parse a llama.cpp log (llama-server, llama-cli, llama-bench -v, llama-logits-dump)."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    out = LlamaLog()
    r = out.reserve
    for raw in lines:
        line = strip_ansi(raw)
        if "position window" in line:
            m = WINDOW_RE.search(line)
            if m:
                out.windows.append(Window(False, int(m.group(2)), int(m.group(1)),
                                          float(m.group(3)), float(m.group(4))))
                continue
            m = WINDOW_FULL_RE.search(line)
            if m:
                n = int(m.group(1))
                out.windows.append(Window(True, n, n, float(m.group(2)), 0.0))
                continue
        if "kv compute reserve" in line:
            if m := PASS1_RE.search(line):
                r.pass1_device, r.pass1_measured_mib, r.pass1_ms = m.group(1), float(m.group(2)), float(m.group(3))
            elif m := PASS2_SIZE_RE.search(line):
                r.pass2_reserve_mib, r.pass2_measured_mib, r.pass2_safety_mib = (
                    float(m.group(1)), float(m.group(2)), float(m.group(3)))
            elif m := PASS2_DONE_RE.search(line):
                r.pass2_ms = float(m.group(1))
            elif SINGLE_PASS_RE.search(line):
                r.single_pass = True
            elif m := FIXED_RE.search(line):
                r.fixed_mib = float(m.group(1))
            continue
        if m := COMPUTE_BUF_RE.search(line):
            out.compute_buffers[m.group(2)] = float(m.group(3))
            out.compute_buffer_history.append((m.group(1), m.group(2), float(m.group(3))))
            continue
        if m := MODEL_BUF_RE.search(line):
            out.model_buffers[m.group(1)] = out.model_buffers.get(m.group(1), 0.0) + float(m.group(2))
            continue
        if m := KV_BUF_RE.search(line):
            out.kv_buffers[m.group(2)] = out.kv_buffers.get(m.group(2), 0.0) + float(m.group(3))
            continue
        if m := KV_SIZE_RE.search(line):
            out.kv_caches.append((float(m.group(1)), int(m.group(2)), int(m.group(3))))
            continue
        if "window" in line:
            if m := NO_WINDOW_RE.search(line):
                out.no_window = {"device": m.group(1), "free": int(m.group(2)), "vram_target": int(m.group(3)),
                                 "model": int(m.group(4)), "compute_reserve": int(m.group(5)),
                                 "margin": int(m.group(6))}
            elif out.window_refused is None and (m := REFUSED_RE.search(line)):
                out.window_refused = m.group(0).strip()
        if GRAPH_FAIL_RE.search(line):
            out.graph_reserve_failed = True
        if m := CTX_FAIL_RE.search(line):
            out.context_failed = m.group(0).strip()
        if CUDA_OOM_RE.search(line):
            out.oom_lines.append(line.strip())
        if out.n_ctx is None and (m := N_CTX_RE.search(line)):
            out.n_ctx = int(m.group(1))
        elif out.n_batch is None and (m := N_BATCH_RE.search(line)):
            out.n_batch = int(m.group(1))
        elif out.n_ubatch is None and (m := N_UBATCH_RE.search(line)):
            out.n_ubatch = int(m.group(1))
        elif m := OFFLOAD_RE.search(line):
            out.offloaded_layers = (int(m.group(1)), int(m.group(2)))
        elif m := PROMPT_EVAL_RE.search(line):
            out.prompt_eval = _timing(m)
        elif m := EVAL_RE.search(line):
            out.eval = _timing(m)
    return out


def _timing(m: re.Match[str]) -> dict[str, float]:
    return {"ms": float(m.group(1)), "n": int(m.group(2)), "ms_per_token": float(m.group(3)),
            "tokens_per_second": float(m.group(4))}


# ----------------------------------------------------------------------------- llama-bench

@dataclass
class BenchRow:
    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float
    stddev_ts: float
    avg_ns: int
    n_ubatch: int | None = None
    n_batch: int | None = None
    type_k: str | None = None
    type_v: str | None = None
    no_kv_offload: bool | None = None
    flash_attn: int | None = None
    kv_residency_mode: str | None = None
    vram_target: int | None = None
    kv_tail_staging: str | None = None  # "auto" / "on" / "off" (patch 0008)
    gpu_info: str | None = None
    build_commit: str | None = None
    samples_ts: list[float] = field(default_factory=list)

    @property
    def test(self) -> str:
        """'pp512', 'tg64', 'pp512+tg64', with ' @ d16384' when deep (llama-bench's own naming)."""
        if self.n_prompt and self.n_gen:
            name = f"pp{self.n_prompt}+tg{self.n_gen}"
        elif self.n_gen:
            name = f"tg{self.n_gen}"
        else:
            name = f"pp{self.n_prompt}"
        return name + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def kind(self) -> str:
        return "pg" if self.n_prompt and self.n_gen else ("tg" if self.n_gen else "pp")


def parse_bench_json(text: str) -> list[BenchRow]:
    """Rows of `llama-bench -o json` (one JSON array) or `-o jsonl` (one object a line)."""
    text = strip_ansi(text).strip()
    if not text:
        return []
    objs: list[dict[str, Any]]
    if text.startswith("["):
        objs = json.loads(text)
    else:
        start = text.find("[")
        if start >= 0 and not text.lstrip().startswith("{"):
            objs = json.loads(text[start:text.rfind("]") + 1])
        else:
            objs = [json.loads(ln) for ln in text.splitlines() if ln.strip().startswith("{")]
    rows = []
    for o in objs:
        rows.append(BenchRow(
            n_prompt=int(o["n_prompt"]), n_gen=int(o["n_gen"]), n_depth=int(o.get("n_depth", 0)),
            avg_ts=float(o["avg_ts"]), stddev_ts=float(o.get("stddev_ts", 0.0)), avg_ns=int(o.get("avg_ns", 0)),
            n_ubatch=o.get("n_ubatch"), n_batch=o.get("n_batch"), type_k=o.get("type_k"), type_v=o.get("type_v"),
            no_kv_offload=None if o.get("no_kv_offload") is None else bool(o["no_kv_offload"]),
            flash_attn=o.get("flash_attn"), kv_residency_mode=o.get("kv_residency_mode"),
            vram_target=None if o.get("vram_target") is None else int(o["vram_target"]),
            kv_tail_staging=o.get("kv_tail_staging"),
            gpu_info=o.get("gpu_info"), build_commit=o.get("build_commit"),
            samples_ts=[float(x) for x in o.get("samples_ts") or []],
        ))
    return rows


# ----------------------------------------------------------------------------- llama-server

@dataclass
class Timings:
    prompt_n: int
    prompt_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    cache_n: int = 0


def parse_completion(resp: dict[str, Any]) -> tuple[str, Timings | None]:
    """(content, timings) of a llama-server `/completion` JSON response."""
    content = str(resp.get("content", ""))
    t = resp.get("timings")
    if not isinstance(t, dict):
        return content, None
    return content, Timings(
        prompt_n=int(t.get("prompt_n", 0)), prompt_ms=float(t.get("prompt_ms", 0.0)),
        prompt_per_second=float(t.get("prompt_per_second", 0.0)),
        predicted_n=int(t.get("predicted_n", 0)), predicted_ms=float(t.get("predicted_ms", 0.0)),
        predicted_per_second=float(t.get("predicted_per_second", 0.0)), cache_n=int(t.get("cache_n", 0)),
    )
