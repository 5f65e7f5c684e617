"""Host-tail physics shared by the speed and curve gates.

A decoded token reads every used tail cell once, so window decode has a bound: time per token =
resident time + tail bytes / link rate ("the link bound"). The link rate is measured in the same
run, from a window decode that reads the tail zero-copy: f16 K/V with `-kts off` (or with
`auto`, which does not stage f16 decode: it stages quantized K/V and ubatches of >= 32 tokens).
Only without such a decode does the gate fall back to the nominal rate of the GPU's PCIe link (NVML's
generation and width), and says so.

Tail staging (`-kts`, patch 0007) is compared side by side in one llama-bench invocation:
"before" = off (the zero-copy reads of the window patches: flash attention re-reads the tail per
query tile), "after" = auto (a layer's K/V that reach into the tail copied to the device once per
ubatch before attention).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields
from typing import Any

from rollkv_dist.errors import LogParseError, UsageError
from rollkv_dist.gates import logparse
from rollkv_dist.gates.base import option
from rollkv_dist.gates.context import MiB
from rollkv_dist.gates.rows import Staged
from rollkv_dist.gpu import GPUInfo

BEFORE, AFTER = "off", "auto"
# the t/s the speed and curve gates read from a llama-bench row (logparse.BenchRow.median_ts)
TPS_STATISTIC = ("t/s are the median of each llama-bench row's repetitions (samples_ts; avg_ts for a row "
                 "without samples): llama-bench's pp repetitions vary a lot on the H200 (17687 vs 12070 t/s "
                 "for the same test), and one outlier moves a mean")
UNQUANTIZED_KV = ("f16", "bf16", "f32")

# the project issue's goals; options override them (percent, or a factor for -nkvo)
PREFILL_VS_RESIDENT = 0.70  # window (auto) prefill >= 70 % of resident prefill
PREFILL_VS_NKVO = 2.0  # window (auto) prefill >= 2x -nkvo prefill
DECODE_VS_LINK = 0.85  # quantized-KV window (auto) decode >= 85 % of the link bound
F16_DECODE_FLOOR = 0.97  # f16 window decode with auto >= 97 % of zero-copy (off): the noise floor
F16_DECODE_VS_OVERLAP = 0.75  # f16 window decode with auto >= 75 % of the overlap bound (the prefetch, patch 0007)
CURVE_DECODE_TOLERANCE = 0.10  # curve: decode at least 90 % of the link-rate line at every windowed point
CURVE_PREFILL_TAIL_MAX = 0.65  # curve: prefill checked where the pp context's tail is at most 65 % of its cells


@dataclass(frozen=True)
class Thresholds:
    prefill_vs_resident: float = PREFILL_VS_RESIDENT
    prefill_vs_nkvo: float = PREFILL_VS_NKVO
    decode_vs_link: float = DECODE_VS_LINK
    f16_decode_floor: float = F16_DECODE_FLOOR
    f16_decode_vs_overlap: float = F16_DECODE_VS_OVERLAP
    curve_decode_tolerance: float = CURVE_DECODE_TOLERANCE

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Thresholds:
        """A report's thresholds; the defaults stand in for goals a report written before them lacks."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})


def prefill_vs_resident_option() -> Any:
    """speed and curve share this goal (and its flag)."""
    return option("window (auto) prefill goal in % of resident", 100 * PREFILL_VS_RESIDENT,
                  flag="--prefill-vs-resident", metavar="PCT")


def quantized(kv_type: str) -> bool:
    return kv_type not in UNQUANTIZED_KV


def tail_read_mib(window: logparse.Window, depth: int, n_gen: int, mib_per_cell: float) -> float:
    """Tail MiB a decoded token reads on average: the used cells beyond C times the exact KV bytes
    per cell (from the `llama_kv_cache: size` line; the window line's MiB are rounded up to 2 MiB
    granules per tensor). Cells past the depth are empty and the attention kernels skip them."""
    used = max(0, min(window.kv_size, depth + n_gen // 2) - window.cells_resident)
    return used * mib_per_cell


def limit_tps(resident_tps: float, tail_read_mib_: float, gbps: float | None) -> float | None:
    """Decode t/s at the link bound: 1 / (1/resident + tail bytes a token reads / link rate); None
    without a link rate."""
    if not gbps:
        return None
    return 1.0 / (1.0 / resident_tps + tail_read_mib_ * MiB / (gbps * 1e9))


def overlap_tps(resident_tps: float, tail_read_mib_: float, gbps: float | None) -> float | None:
    """Decode t/s when the link and the compute overlap fully (tail staging with prefetch, patches
    0004/0007: the next layer's tail crosses the link while this layer computes): 1 / max(1/resident,
    tail bytes a token reads / link rate); None without a link rate."""
    if not gbps:
        return None
    return 1.0 / max(1.0 / resident_tps, tail_read_mib_ * MiB / (gbps * 1e9))


def tail_bandwidth_gbps(tail_read_mib_: float, window_tps: float, resident_tps: float) -> float | None:
    """Effective tail GB/s: tail bytes a token reads / (window time - resident time per token)."""
    dt = 1.0 / window_tps - 1.0 / resident_tps
    if tail_read_mib_ <= 0 or dt <= 0:
        return None
    return tail_read_mib_ * MiB / dt / 1e9


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def fmt(v: Any, spec: str = ",.1f") -> str:
    """A number for the report's tables ("-" when not measured)."""
    return "-" if v is None else format(v, spec)


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


@dataclass
class Link:
    """The link rate the bounds use, and where it came from (gbps None: nothing to go by)."""

    gbps: float | None
    measured: bool
    source: str
    samples: list[float] = field(default_factory=list)


def link_rate(zero_copy: list[tuple[str, float | None]], gpu: GPUInfo | None = None) -> Link:
    """Median effective tail GB/s of the f16 window decodes with `-kts off` (zero-copy by
    definition: each tail byte crosses the link once per token, after the compute); without any,
    the nominal rate of `gpu`'s PCIe link (NVML), labelled ASSUMED; None when NVML does not say
    either. Samples are (where, GB/s). `auto` is no source: where a cache prefetches it stages f16
    decode too, and its copies overlap the compute, so its "effective" rate is not the link's."""
    good = [(w, g) for w, g in zero_copy if g]
    if good:
        at = ", ".join(f"{w}: {g:g}" for w, g in good)
        return Link(round(statistics.median(g for _, g in good), 2), True,
                    "measured in this run: median effective tail GB/s of the f16 window decode with -kts off "
                    f"(zero-copy) ({at})", [g for _, g in good])
    nominal = None if gpu is None else gpu.pcie_gbps
    if nominal is None:
        return Link(None, False, "UNKNOWN: this run measured no zero-copy (-kts off) f16 window decode and NVML gave "
                    "no PCIe link for the GPU")
    return Link(nominal, False,
                f"ASSUMED {nominal:g} GB/s, the nominal rate of the GPU's PCIe link ({gpu.pcie_str()} per NVML): this "
                "run measured no zero-copy (-kts off) f16 window decode (those reach about 80 % of it on an H200)")


def kts_args(stagings: list[str]) -> list[str]:
    """`-kts` for one llama-bench invocation, auto first: llama-bench fills the depth in the first
    test's context and restores that state in the later ones, so the fill runs staged (fast) and
    "off" pays only its own tests."""
    return ["-kts", ",".join(sorted(set(stagings), key=lambda s: s != AFTER))]


def parse_stagings(spec: str) -> list[str]:
    vals = [s.strip() for s in str(spec).split(",") if s.strip()]
    bad = [s for s in vals if s not in (BEFORE, AFTER)]
    if bad or not vals or len(set(vals)) != len(vals):
        raise UsageError(f"tail staging list {spec!r}: expected 'off,auto', 'auto' or 'off'")
    return vals


def row_windows(log: logparse.LlamaLog, rows: list[logparse.BenchRow]) -> list[logparse.Window | None]:
    """The window of each row's context. llama-bench makes one context per test, in row order, and
    each logs one window line per device (LlamaLog.caches combines a cache's lines on several GPUs
    into one); otherwise the smallest window that holds the test (staging changes the compute
    reserve, so off and auto contexts can differ)."""
    caches = log.caches
    if len(caches) == len(rows):
        return caches
    return [log.window_for(r.n_depth + r.n_prompt + r.n_gen) for r in rows]


def used_tail_fraction(window: logparse.Window, used: int) -> float:
    """Share of the cells a test uses (depth + its tokens) that lie beyond the window's C: the same as
    the window's own tail fraction where the context is the test's (llama-bench's default), the part
    that matters where the context is larger (llama-bench -c)."""
    if used <= 0:
        return 0.0
    return max(0, min(used, window.kv_size) - window.cells_resident) / used


def by_staging(rows: list[logparse.BenchRow], log: logparse.LlamaLog, depth: int, n_prompt: int, n_gen: int,
               mib_per_cell: float | None, resident_tps: float | None) -> dict[str, Staged]:
    """Per `kv_tail_staging` value: decode and prefill t/s, each test's own window (decode: depth +
    n_gen cells, prefill: depth + n_prompt), its host tail MiB, the share of the window's cells in the
    tail (decode) and of the cells the prefill uses (used_tail_fraction), and for decode the tail MiB
    a token reads and the effective tail GB/s."""
    out: dict[str, Staged] = {}
    for r, w in zip(rows, row_windows(log, rows), strict=True):
        if r.kind not in ("tg", "pp"):
            continue
        if r.kv_tail_staging is None:  # the rows of different stagings would overwrite each other
            raise LogParseError(f"llama-bench row {r.test} of the run logged in {log.source} has no "
                                f"kv_tail_staging: the build's llama-bench took -kts but does not report it "
                                f"(patch 0007), so the rows of its stagings cannot be told apart")
        m = out.setdefault(r.kv_tail_staging, Staged())
        if r.kind == "pp":
            m.prefill_tps, m.prefill_samples_ts = r.median_ts, r.samples_ts
            if w is not None:
                m.prefill_window, m.prefill_host_tail_mib = w, w.host_tail_mib
                m.prefill_tail_fraction = round(used_tail_fraction(w, depth + n_prompt), 4)
        else:
            m.decode_tps, m.decode_samples_ts = r.median_ts, r.samples_ts
            if w is not None:
                m.window, m.host_tail_mib, m.tail_fraction = w, w.host_tail_mib, round(w.tail_fraction, 4)
    for m in out.values():
        if m.window is not None and mib_per_cell:
            m.tail_read_mib_per_token = round(tail_read_mib(m.window, depth, n_gen, mib_per_cell), 2)
            bw = (tail_bandwidth_gbps(m.tail_read_mib_per_token, m.decode_tps, resident_tps)
                  if m.decode_tps and resident_tps else None)
            m.effective_tail_gbps = None if bw is None else round(bw, 2)
    return out
