"""All parsing of llama.cpp output for the gates, in one place.

Formats come from the pinned upstream tree, the format strings in patches/*.patch and
docs/ENGINE-INTERFACE.md (tests/test_log_formats.py renders the rolling-KV lines from the patches'
own format strings and reads them back):

- window line (patch 0006 "position window"), both forms, with `` on CUDAn`` appended when the
  model spans several devices (one line per device and cache)::

    llama_kv_cache: position window = 123904 / 524288 cells resident (device 23232.00 MiB, host tail 75072.00 MiB)
    llama_kv_cache: position window = FULLY RESIDENT (524288 cells, device 98304.00 MiB) on CUDA1

- the sizer's budget line (patch 0006, one per device): ``CUDA0: free F MiB, vram target T MiB,
  model M MiB, other KV K MiB, compute reserve R MiB, margin G MiB -> window budget B MiB``
- two-pass compute reserve (patch 0089): ``kv compute reserve: pass 1 measured CUDAn ...`` and
  ``pass 2 sizes the window ...`` once per device, ``pass 2 done (... ms)``, ``single pass ...``,
  ``fixed ... MiB``
- a draft beside the main context (patch 0096): ``rolling KV: leaving N MiB on DEV for the draft (weights ...``
  and the refusal ``rolling KV: --vram-target T MiB on DEV is what the main and the draft context hold together,
  and the draft alone needs N MiB there``
- upstream: ``sched_reserve: %10s compute buffer size = %8.2f MiB`` (llama-context.cpp),
  ``load_tensors: %12s model buffer size = %8.2f MiB`` (llama-model.cpp),
  ``llama_kv_cache: %10s KV buffer size = %8.2f MiB`` (llama-kv-cache.cpp, one per device and
  cache), ``graph_reserve: failed to allocate compute buffers``, ``llama_context: n_ctx = %u``,
  ``load_tensors: offloaded %d/%d layers to GPU``, CUDA ``cudaMalloc failed`` lines
- refusals no --vram-target can change (patches 0005/0006), among them a ``--vram-target`` list whose
  length is neither one nor the number of devices in use
- llama-bench ``-o json`` / ``-o jsonl`` rows
- llama-window-test (patch 0012) on stdout: ``PASS <check>``, ``FAIL <check>: <detail>``,
  ``SKIP <check>: <reason>`` (a check is ``<device>: <what>`` or a device-less ``window buffers``),
  then ``window-test: N device(s) with window buffers, F failure(s)[ (GGML_CUDA_P2P set)]``
- llama-server ``/completion`` response ``timings`` and the ``print_timings`` log lines.

Lines may carry ANSI colours and the common-log prefix (timestamp, ``I ``/``W ``/``E ``), and
the window, budget and reserve lines may come at any verbosity: patterns search inside the
line, never anchor at its start.

Strict: a line that mentions a field these parsers read (its trigger, e.g. ``position window =``)
but does not match the field's format raises LogParseError naming the source and line, and so
does a number that makes no sense (a resident count above the total, a negative size). Sizes
may be written ``1,234.50 MiB`` or in KiB/GiB/TiB; they are converted to MiB, and any other unit
is an error, never 0. Values that a log lacks are None, and the gates ask for them with
``LlamaLog.require_mib``, which raises instead of assuming 0.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from rollkv_dist.errors import LogParseError

ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# a number as printed, with or without thousands separators (checked in _number), and a unit
NUM = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"
INT = r"(-?[0-9][0-9,]*)"
SIZE = NUM + r" ?([A-Za-z]+)"
DEV = r"(?: on (\S+))?"
END = r"\s*$"
UNIT_MIB = {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0, "TiB": 1024.0 * 1024.0}
_GROUPED = re.compile(r"^-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?$")
_PLAIN = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")

WINDOW_RE = re.compile(r"position window = " + INT + r" / " + INT + r" cells resident \(device " + SIZE
                       + r", host tail " + SIZE + r"\)" + DEV + END)
WINDOW_FULL_RE = re.compile(r"position window = FULLY RESIDENT \(" + INT + r" cells, device " + SIZE + r"\)"
                            + DEV + END)
BUDGET_RE = re.compile(r"(\S+): free " + SIZE + r", vram target " + SIZE + r", model " + SIZE + r", other KV "
                       + SIZE + r", compute reserve " + SIZE + r", margin " + SIZE + r" -> window budget "
                       + SIZE + END)
PASS1_RE = re.compile(
    r"kv compute reserve: pass 1 measured (\S+) compute buffer = " + SIZE + r" \(" + NUM + r" ms\)" + END)
PASS2_SIZE_RE = re.compile(
    r"kv compute reserve: pass 2 sizes the window with reserve = " + SIZE + r" \(measured " + NUM
    + r"(?: \+ scratch " + NUM + r")? \+ safety " + NUM + r"\)" + END)
# patch 0097: the backend's scratch bound (pool and kept workspaces), and a single pass whose estimate fell short
SCRATCH_RE = re.compile(r"kv compute reserve: (\S+) scratch outside the compute buffers = " + SIZE + r" \(pool "
                        + SIZE + r", kept workspaces " + SIZE + r"\)" + END)
SHORT_RE = re.compile(r"kv compute reserve: single pass short: (\S+) needs " + SIZE + r" beside the KV")
PASS2_DONE_RE = re.compile(r"kv compute reserve: pass 2 done \(" + NUM + r" ms\)" + END)
# patch 0093 adds the estimate it decided with (an upper bound of the compute buffers)
SINGLE_PASS_RE = re.compile(r"kv compute reserve: single pass\b(?: \(full KV fits the budget with an upper bound of "
                            + SIZE + r" on the compute buffers\))?")
FIXED_RE = re.compile(r"kv compute reserve: fixed " + SIZE + r" \(--kv-compute-reserve\)" + END)
COMPUTE_BUF_RE = re.compile(r"(\w+): +(\S+) compute buffer size = +" + SIZE + END)
MODEL_BUF_RE = re.compile(r"load_tensors: +(\S+) model buffer size = +" + SIZE + END)
KV_BUF_RE = re.compile(r"(\w+): +(\S+) KV buffer size = +" + SIZE + END)
KV_SIZE_RE = re.compile(r"llama_kv_cache: size = +" + SIZE + r" \( *" + INT + r" cells, +" + INT + r" layers")
NO_WINDOW_RE = re.compile(
    r"window mode: no device memory left for the KV window on (\S+) \(free " + INT + r" MiB, vram target " + INT
    + r" MiB, model " + INT + r" MiB, compute reserve " + INT + r" MiB, margin " + INT + r" MiB\)")
# configuration refusals of window mode (patches 0005/0006): searching a --vram-target cannot help
REFUSED_RE = re.compile(r"(--kv-residency-mode window (needs|supports|does not support)[^\n]*|"
                        r"--vram-target has [0-9]+ values but the model uses [^\n]*|"
                        r"window mode: the \S+ backend of [^\n]*cannot place KV cells[^\n]*|"
                        r"window mode: the driver of [^\n]*cannot map host memory[^\n]*)")
# patch 0093: -fa off stores V transposed; it stays whole in device memory and K alone takes the window
V_ON_DEVICE_RE = re.compile(r"(\S+): flash attention is off, so V is stored transposed \(no cell prefix\): its " + INT
                            + r" MiB stay in device memory")
# patch 0093: the V kept whole needs more than the window budget (a larger --vram-target helps)
V_WHOLE_REFUSED_RE = re.compile(r"window mode: with flash attention off, V \(stored transposed, no cell prefix\) stays "
                                r"whole in device memory and needs " + INT + r" MiB on (\S+), but the window budget "
                                r"leaves " + INT + r" MiB .*raise --vram-target by at least " + INT + r" MiB")
# patch 0095 (0101's wording): llama-server's prompt cache limit beside a host tail: lowered to the host memory left
# once the tail's unpinned part is counted, or fits
PROMPT_CACHE_LOWERED_RE = re.compile(r"rolling KV: prompt cache limit (no limit|" + INT + r" MiB) -> " + INT
                                     + r" MiB(?: \(disabled\))?: .* " + INT + r" MiB are available of which the tail may "
                                     r"still pin " + INT + r" MiB \(keeping " + INT + r" MiB free\)")
PROMPT_CACHE_FITS_RE = re.compile(r"rolling KV: prompt cache limit " + INT + r" MiB fits beside the KV host tail \("
                                  + INT + r" MiB available, of which the tail may still pin " + INT + r" MiB\)")
# patch 0096: with a draft (-md, MTP) and a --vram-target, the main context takes the target less the draft's part
DRAFT_ROOM_RE = re.compile(r"rolling KV: leaving " + INT + r" MiB on (\S+) for the draft \(weights ")
DRAFT_REFUSED_RE = re.compile(r"rolling KV: --vram-target " + INT + r" MiB on (\S+) is what the main and the draft "
                              r"context hold together, and the draft alone needs " + INT + r" MiB there")
# patch 0101: host memory on demand: the tail reserved at boot and pinned as cells come into use (or at boot)
HOST_TAIL_RE = re.compile(r"kv host tail: " + NUM + r" MiB reserved, " + NUM + r" MiB pinned \((pinned as cells come "
                          r"into use|at boot)")
HOST_TAIL_GROW_RE = re.compile(r"kv host tail: pinned " + INT + r" MiB more on (\S+), cells up to " + INT + r" of " + INT
                               + r" backed: " + INT + r" of " + INT + r" MiB pinned \(" + INT + r" ms\)" + END)
HOST_TAIL_WAIT_RE = re.compile(r"kv host tail: waited " + NUM + r" ms for cells up to " + INT + r" on (\S+)" + END)
HOST_TAIL_FAIL_RE = re.compile(r"the KV host tail on (\S+) needs " + INT + r" MiB more pinned host memory for cells up "
                               r"to " + INT + r" of " + INT + r", but " + INT + r" MiB can be pinned")
GRAPH_FAIL_RE = re.compile(r"graph_reserve: failed to allocate compute buffers")
# 0098: a quantized K-shift in chunks within the compute buffer; 0001: a shift whose graph could not be allocated
KV_SHIFT_RE = re.compile(r"kv shift: (\S+) K of " + INT + r" cells shifted in chunks of " + INT + r" cells, their f32 "
                         r"copies within the (\S+) compute buffer \(" + NUM + r" MiB\)" + END)
# 0011: llama-logits-dump's --kv-shift says what it removed and moved (the request, not the engine's shift)
DUMP_SHIFT_RE = re.compile(r"logits-dump: kv shift: positions \[" + INT + r", " + INT + r"\) dropped, the rest moved "
                           r"back by " + INT + END)
KV_SHIFT_FAIL_RE = re.compile(r"failed to (allocate compute graph|compute) (for )?K-shift")
N_CTX_RE = re.compile(r"llama_context: n_ctx += +" + INT + END)
N_UBATCH_RE = re.compile(r"llama_context: n_ubatch += +" + INT + END)
N_BATCH_RE = re.compile(r"llama_context: n_batch += +" + INT + END)
OFFLOAD_RE = re.compile(r"load_tensors: offloaded " + INT + r"/" + INT + r" layers to GPU" + END)
CUDA_OOM_RE = re.compile(r"(cudaMalloc failed|out of memory|failed to allocate \S+ buffer of size)", re.I)
# patch 0090: where a residency of auto (or window) went, and the model's memory it saw
RESIDENCY_RE = re.compile(r"kv residency: (auto|window) -> (resident|window mode): (.+?)\s*$")
MEMORY_RE = re.compile(r"this model's memory is (.+?)(?:; the KV stays|, which takes|, so there is|$)")
CTX_FAIL_RE = re.compile(r"failed to (initialize the context|create context)[^\n]*")
# llama-server print_timings (SLT_INF prefix "slot print_timing: id  0 | task 0 | "); llama_perf's
# "eval time" line says "runs" where the server says "tokens"
# llama_perf_context_print writes "inf tokens per second" when nothing was timed (llama-bench's contexts)
_TIMING = (r" time = +" + NUM + r" ms / +" + INT + r" (?:tokens|runs) +\( *" + NUM + r" ms per token, +(" + NUM[1:-1]
           + r"|inf|nan)" + r" tokens per second\)" + END)
PROMPT_EVAL_RE = re.compile(r"prompt eval" + _TIMING)
EVAL_RE = re.compile(r"(?<!prompt )eval" + _TIMING)


def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


class _Line:
    """The line being parsed, for errors that name it."""

    def __init__(self, source: str, number: int, text: str):
        self.source, self.number, self.text = source, number, text

    def error(self, what: str) -> LogParseError:
        return LogParseError(f"{self.source}:{self.number}: {what}: {self.text.strip()!r} (the engine's output "
                             f"format differs from the one rollkv_dist/gates/logparse.py reads: fix the parser "
                             f"or the engine, the gate cannot trust this run)")

    def number_of(self, text: str) -> float:
        if not (_PLAIN.match(text) or _GROUPED.match(text)):
            raise self.error(f"unreadable number {text!r}")
        return float(text.replace(",", ""))

    def count(self, text: str) -> int:
        v = self.number_of(text)
        if v != int(v) or v < 0:
            raise self.error(f"{text!r} is not a count")
        return int(v)

    def mib(self, num: str, unit: str, signed: bool = False) -> float:
        if unit not in UNIT_MIB:
            raise self.error(f"unknown size unit {unit!r} (expected one of {', '.join(UNIT_MIB)})")
        v = self.number_of(num) * UNIT_MIB[unit]
        if v < 0 and not signed:
            raise self.error(f"negative size {num} {unit}")
        return v


@dataclass
class Window:
    """One KV cache's window line on one device (device None: the model is on one device and the
    engine names none)."""

    fully_resident: bool
    kv_size: int
    cells_resident: int
    device_mib: float
    host_tail_mib: float
    device: str | None = None

    @property
    def tail_fraction(self) -> float:
        """Fraction of the cache's cells in the host tail (0 when fully resident).

        Counted in cells, not in the logged MiB: each K/V tensor's device segment and host tail are
        rounded up to whole VMM granules (2 MiB), so the MiB pair overstates small tails.
        """
        return 0.0 if self.kv_size <= 0 else (self.kv_size - self.cells_resident) / self.kv_size


def combine(windows: list[Window]) -> Window:
    """One cache's windows on several devices as one: a cell is in host memory on every device only
    beyond the largest C, so cells_resident is the largest C (the smallest tail); MiB are summed."""
    if len(windows) == 1:
        return windows[0]
    return Window(all(w.fully_resident for w in windows), windows[0].kv_size,
                  max(w.cells_resident for w in windows), sum(w.device_mib for w in windows),
                  sum(w.host_tail_mib for w in windows), "+".join(str(w.device) for w in windows))


@dataclass
class ComputeReserve:
    """The two-pass reserve lines of the last context in the log. The pass1_*/pass2_* fields are
    its first device's; by_device has every device's (pass 2's sizing line follows each device's
    pass 1 line)."""

    pass1_device: str | None = None
    pass1_measured_mib: float | None = None
    pass1_ms: float | None = None
    by_device: dict[str, dict[str, float]] = field(default_factory=dict)
    pass2_reserve_mib: float | None = None
    pass2_measured_mib: float | None = None
    pass2_safety_mib: float | None = None
    pass2_ms: float | None = None
    single_pass: bool = False  # the full KV fit the budget: no measuring pass
    single_pass_bound_mib: float | None = None  # the compute estimate that decided it (0093)
    fixed_mib: float | None = None  # --kv-compute-reserve
    # 0097: per device, the backend's scratch bound (scratch_mib = pool_mib + kept_mib), and the need of a single
    # pass whose estimate fell short (the context then measured in two passes)
    scratch: dict[str, dict[str, float]] = field(default_factory=dict)
    single_pass_short: dict[str, float] = field(default_factory=dict)

    @property
    def two_pass(self) -> bool:
        return self.pass1_measured_mib is not None

    def overruns(self, compute_buffers: dict[str, float]) -> dict[str, tuple[float, float]]:
        """Per device, (pass 1's measurement, the compute buffer allocated after pass 2) where the allocation is
        larger: the window was sized for the measured buffer, so it must hold (reports/2026-12-07-h100-d found
        one staged f16 K/V of a layer more, 0097's graph split twice)."""
        out = {}
        for dev, rec in self.by_device.items():
            measured, allocated = rec.get("measured_mib"), compute_buffers.get(dev)
            if measured is not None and allocated is not None and allocated > measured + 0.005:
                out[dev] = (measured, allocated)
        return out


@dataclass
class Residency:
    """A `kv residency: FROM -> TO: DETAIL` line (patches 0005, 0090): auto's decision, or a window
    that ran resident because the memory has nothing to window. memory: the kind the line names
    (None where a requirement of window mode decided, e.g. no GPU device)."""

    origin: str  # auto | window
    to: str  # resident | window
    detail: str
    memory: str | None


@dataclass
class LlamaLog:
    source: str = "log"
    windows: list[Window] = field(default_factory=list)
    budgets: list[dict[str, Any]] = field(default_factory=list)  # the sizer's budget line per device (MiB)
    reserve: ComputeReserve = field(default_factory=ComputeReserve)
    compute_buffers: dict[str, float] = field(default_factory=dict)  # last value per buffer type
    compute_buffer_history: list[tuple[str, str, float]] = field(default_factory=list)  # (func, buft, MiB)
    model_buffers: dict[str, float] = field(default_factory=dict)
    kv_buffers: dict[str, float] = field(default_factory=dict)  # per buffer type (device), summed over caches
    kv_caches: list[tuple[float, int, int]] = field(default_factory=list)  # (MiB, cells, layers) per cache
    no_window: dict[str, Any] | None = None  # "no device memory left for the KV window" numbers (MiB)
    window_refused: str | None = None
    residency: Residency | None = None  # the last `kv residency:` line
    stand_in: bool = False  # the CPU stood in for a GPU (patch 0092's LLAMA_KV_TEST_HOST_DEVICE_MIB, tests)
    v_on_device_mib: dict[str, int] = field(default_factory=dict)  # per device: a transposed V kept whole (0093)
    v_whole_refused: dict[str, Any] | None = None  # 0093: V kept whole did not fit the window budget (MiB)
    # 0095: the server's prompt cache limit beside a host tail (MiB): {"was": MiB or None (no limit), "limit", "available",
    # "to_pin" (what the tail may still pin, 0101), "lowered"}
    prompt_cache: dict[str, Any] | None = None
    draft_room: dict[str, int] = field(default_factory=dict)  # 0096: per device, the MiB left for a draft (its part)
    draft_refused: dict[str, int] = field(default_factory=dict)  # 0096: per device, a draft's need above the target
    # 0098: per chunked K-shift {"type", "cells", "chunk", "device", "buffer_mib"}
    kv_shifts: list[dict[str, Any]] = field(default_factory=list)
    dump_shift: tuple[int, int, int] | None = None  # 0011: llama-logits-dump's (first, end, moved back by)
    kv_shift_failed: bool = False  # 0001: a K-shift's graph could not be allocated or computed
    # 0101: per window buffer with a tail {"reserved_mib", "pinned_mib", "on_demand"}; the growths {"mib", "device",
    # "cells", "kv_size", "pinned_mib", "reserved_mib", "ms"}; the first decode a tail could not grow for {"device",
    # "need_mib", "cells", "kv_size", "room_mib"}
    host_tails: list[dict[str, Any]] = field(default_factory=list)
    host_tail_grows: list[dict[str, Any]] = field(default_factory=list)
    host_tail_failed: dict[str, Any] | None = None
    host_tail_waits: list[float] = field(default_factory=list)  # 0101: ms a decode waited for its cells (-lv 4)
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
    def caches(self) -> list[Window]:
        """One window per cache: consecutive lines of one cache on different devices combined."""
        groups: list[list[Window]] = []
        for w in self.windows:
            g = groups[-1] if groups else None
            if (g and w.device is not None and g[0].kv_size == w.kv_size
                    and all(x.device is not None and x.device != w.device for x in g)):
                g.append(w)
            else:
                groups.append([w])
        return [combine(g) for g in groups]

    @property
    def window(self) -> Window | None:
        """The main cache's window: the one with a host tail, else the largest cache."""
        caches = self.caches
        if not caches:
            return None
        tails = [w for w in caches if not w.fully_resident]
        pool = tails or caches
        return max(pool, key=lambda w: w.kv_size)

    def window_for(self, n_cells: int) -> Window | None:
        """The window of the smallest cache holding n_cells (llama-bench makes one context per test,
        sized depth + n_prompt or depth + n_gen and padded to 256 cells: decode uses the smaller)."""
        fits = [w for w in self.caches if w.kv_size >= n_cells]
        return min(fits, key=lambda w: w.kv_size) if fits else None

    def windows_on(self, device: str) -> list[Window]:
        """The window lines of one device (the engine names devices only when there are several)."""
        return [w for w in self.windows if w.device == device]

    @property
    def kv_mib_per_cell(self) -> float | None:
        """Exact KV bytes per cell (MiB) of the largest cache, from its `llama_kv_cache: size` line."""
        if not self.kv_caches:
            return None
        mib, cells, _ = max(self.kv_caches, key=lambda c: c[1])
        return mib / cells if cells else None

    @property
    def kv_mib_largest_cache(self) -> float | None:
        """KV MiB of the largest cache over all its devices (kv_buffers sums every cache of every
        context a tool made: llama-bench logs one context per test); None without a size line."""
        return max((c[0] for c in self.kv_caches), default=None)

    def compute_mib(self, device: str = "CUDA0") -> float | None:
        return self.compute_buffers.get(device)

    def require_mib(self, what: str, device: str = "CUDA0") -> float:
        """A logged size the caller cannot do without ('model', 'kv', 'compute' on `device`, or
        'kv-largest-cache'); raises LogParseError naming the line that is missing."""
        values: dict[str, Callable[[], float | None]] = {
            "model": lambda: self.model_buffers.get(device),
            "kv": lambda: self.kv_buffers.get(device),
            "compute": lambda: self.compute_buffers.get(device),
            "kv-largest-cache": lambda: self.kv_mib_largest_cache,
        }
        lines = {"model": f"load_tensors: {device} model buffer size = ... MiB",
                 "kv": f"llama_kv_cache: {device} KV buffer size = ... MiB",
                 "compute": f"sched_reserve: {device} compute buffer size = ... MiB",
                 "kv-largest-cache": "llama_kv_cache: size = ... MiB (... cells, ... layers, ...)"}
        v = values[what]()
        if v is None:
            raise LogParseError(f"{self.source}: no `{lines[what]}` line: the run did not log it (llama-server "
                                f"and llama-logits-dump print it at -lv 4, llama-bench at -v), so the gate "
                                f"cannot size its runs")
        return v

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        w = self.window
        d["window"] = None if w is None else {**asdict(w), "tail_fraction": w.tail_fraction}
        return d


def _window(ln: _Line, m: re.Match[str], full: bool) -> Window:
    if full:
        n = ln.count(m.group(1))
        w = Window(True, n, n, ln.mib(m.group(2), m.group(3)), 0.0, m.group(4))
    else:
        w = Window(False, ln.count(m.group(2)), ln.count(m.group(1)), ln.mib(m.group(3), m.group(4)),
                   ln.mib(m.group(5), m.group(6)), m.group(7))
    if w.kv_size <= 0 or w.cells_resident > w.kv_size:
        raise ln.error(f"resident cells {w.cells_resident} of {w.kv_size}: not a window")
    return w


def _reserve(ln: _Line, out: LlamaLog, pending: str | None, ctx_mark: tuple[int, int]) -> str | None:
    """One `kv compute reserve:` line into out.reserve; returns the device whose pass 2 sizing line
    is due (it follows that device's pass 1 line and does not name the device). A single pass that
    fell short makes the context's caches again: the windows and budgets parsed since ctx_mark (their
    counts when the context began) no longer describe it and are dropped."""
    r = out.reserve
    if m := PASS1_RE.search(ln.text):
        dev = m.group(1)
        if dev in r.by_device:  # the same device again: a new context (llama-bench makes several)
            out.reserve = r = ComputeReserve()
        r.by_device[dev] = {"measured_mib": ln.mib(m.group(2), m.group(3)), "ms": ln.number_of(m.group(4))}
        if r.pass1_device is None:
            r.pass1_device, r.pass1_measured_mib, r.pass1_ms = dev, r.by_device[dev]["measured_mib"], r.by_device[dev]["ms"]
        return dev
    if m := PASS2_SIZE_RE.search(ln.text):
        if pending is None:
            raise ln.error("pass 2 sizing line without a pass 1 line for its device before it")
        vals = {"reserve_mib": ln.mib(m.group(1), m.group(2)), "measured2_mib": ln.number_of(m.group(3)),
                "scratch_mib": ln.number_of(m.group(4)) if m.group(4) is not None else 0.0,
                "safety_mib": ln.number_of(m.group(5))}
        r.by_device[pending].update(vals)
        if pending == r.pass1_device:
            r.pass2_reserve_mib, r.pass2_measured_mib, r.pass2_safety_mib = (
                vals["reserve_mib"], vals["measured2_mib"], vals["safety_mib"])
    elif m := SCRATCH_RE.search(ln.text):
        r.scratch[m.group(1)] = {"scratch_mib": ln.mib(m.group(2), m.group(3)), "pool_mib": ln.mib(m.group(4), m.group(5)),
                                 "kept_mib": ln.mib(m.group(6), m.group(7))}
    elif m := SHORT_RE.search(ln.text):
        r.single_pass_short[m.group(1)] = ln.mib(m.group(2), m.group(3))
        del out.windows[ctx_mark[0]:]
        del out.budgets[ctx_mark[1]:]
    elif m := PASS2_DONE_RE.search(ln.text):
        r.pass2_ms = ln.number_of(m.group(1))
    elif m := SINGLE_PASS_RE.search(ln.text):
        r.single_pass = True
        if m.group(1) is not None:
            r.single_pass_bound_mib = ln.mib(m.group(1), m.group(2))
    elif m := FIXED_RE.search(ln.text):
        r.fixed_mib = ln.mib(m.group(1), m.group(2))
    else:
        raise ln.error("a `kv compute reserve:` line of no known form")
    return None


def _budget(ln: _Line, m: re.Match[str]) -> dict[str, Any]:
    keys = ("free", "vram_target", "model", "other_kv", "compute_reserve", "margin", "budget")
    vals = [ln.mib(m.group(2 + 2 * i), m.group(3 + 2 * i), signed=(k == "budget")) for i, k in enumerate(keys)]
    return {"device": m.group(1), **dict(zip(keys, vals, strict=True))}


STAND_IN_MARK = "llama_kv_test_host_device: LLAMA_KV_TEST_HOST_DEVICE_MIB="  # patch 0092's warning


def parse_log(text: str | Iterable[str], source: str = "log") -> LlamaLog:
    """Parse a llama.cpp log (llama-server, llama-cli, llama-bench -v, llama-logits-dump).

    `source` (a file name) goes into the LogParseError raised for a line that mentions a known
    field in an unknown form."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    out = LlamaLog(source=source)
    pending: str | None = None  # device whose pass 2 sizing line comes next
    ctx_mark = (0, 0)  # windows and budgets parsed before this context began (see _reserve)
    for number, raw in enumerate(lines, 1):
        line = strip_ansi(raw)
        ln = _Line(source, number, line)
        if STAND_IN_MARK in line:
            out.stand_in = True
            continue
        if "position window =" in line:
            if m := WINDOW_RE.search(line):
                out.windows.append(_window(ln, m, full=False))
            elif m := WINDOW_FULL_RE.search(line):
                out.windows.append(_window(ln, m, full=True))
            else:
                raise ln.error("a `position window =` line of no known form")
            continue
        if "-> window budget" in line:
            if not (m := BUDGET_RE.search(line)):
                raise ln.error("a window budget line of no known form")
            out.budgets.append(_budget(ln, m))
            continue
        if "constructing llama_context" in line:
            ctx_mark = (len(out.windows), len(out.budgets))
        if "kv compute reserve:" in line:
            pending = _reserve(ln, out, pending, ctx_mark)
            continue
        if "compute buffer size =" in line:
            if not (m := COMPUTE_BUF_RE.search(line)):
                raise ln.error("a `compute buffer size =` line of no known form")
            mib = ln.mib(m.group(3), m.group(4))
            out.compute_buffers[m.group(2)] = mib
            out.compute_buffer_history.append((m.group(1), m.group(2), mib))
            continue
        if "load_tensors:" in line and "model buffer size" in line:
            if not (m := MODEL_BUF_RE.search(line)):
                raise ln.error("a `model buffer size` line of no known form")
            out.model_buffers[m.group(1)] = out.model_buffers.get(m.group(1), 0.0) + ln.mib(m.group(2), m.group(3))
            continue
        if "KV buffer size" in line:
            if not (m := KV_BUF_RE.search(line)):
                raise ln.error("a `KV buffer size` line of no known form")
            out.kv_buffers[m.group(2)] = out.kv_buffers.get(m.group(2), 0.0) + ln.mib(m.group(3), m.group(4))
            continue
        if "llama_kv_cache: size =" in line:
            if not (m := KV_SIZE_RE.search(line)):
                raise ln.error("a `llama_kv_cache: size =` line of no known form")
            out.kv_caches.append((ln.mib(m.group(1), m.group(2)), ln.count(m.group(3)), ln.count(m.group(4))))
            continue
        if "kv host tail:" in line:
            if m := HOST_TAIL_RE.search(line):
                out.host_tails.append({"reserved_mib": ln.number_of(m.group(1)), "pinned_mib": ln.number_of(m.group(2)),
                                       "on_demand": m.group(3) != "at boot"})
            elif m := HOST_TAIL_GROW_RE.search(line):
                keys = ("mib", "device", "cells", "kv_size", "pinned_mib", "reserved_mib", "ms")
                out.host_tail_grows.append({k: m.group(i) if k == "device" else ln.count(m.group(i))
                                            for i, k in enumerate(keys, 1)})
            elif m := HOST_TAIL_WAIT_RE.search(line):
                out.host_tail_waits.append(ln.number_of(m.group(1)))
            elif "pinning ahead stopped" not in line:  # a step ahead that did not fit (debug): a later decode says
                raise ln.error("a `kv host tail:` line of no known form")
            continue
        if "the KV host tail on" in line and out.host_tail_failed is None:
            if not (m := HOST_TAIL_FAIL_RE.search(line)):
                raise ln.error("a `the KV host tail on ... needs` line of no known form")
            out.host_tail_failed = {"device": m.group(1), "need_mib": ln.count(m.group(2)),
                                    "cells": ln.count(m.group(3)), "kv_size": ln.count(m.group(4)),
                                    "room_mib": ln.count(m.group(5))}
            continue
        if "so V is stored transposed" in line:
            if not (m := V_ON_DEVICE_RE.search(line)):
                raise ln.error("a `V is stored transposed` line of no known form")
            out.v_on_device_mib[m.group(1)] = out.v_on_device_mib.get(m.group(1), 0) + ln.count(m.group(2))
            continue
        if "stays whole in device memory and needs" in line:
            if not (m := V_WHOLE_REFUSED_RE.search(line)):
                raise ln.error("a `V ... stays whole in device memory and needs` line of no known form")
            out.v_whole_refused = {"device": m.group(2), "need": ln.count(m.group(1)), "budget": ln.count(m.group(3)),
                                   "raise_by": ln.count(m.group(4))}
            continue
        if "rolling KV: prompt cache limit" in line:
            if m := PROMPT_CACHE_LOWERED_RE.search(line):
                out.prompt_cache = {"was": None if m.group(1) == "no limit" else ln.count(m.group(2)),
                                    "limit": ln.count(m.group(3)), "available": ln.count(m.group(4)),
                                    "to_pin": ln.count(m.group(5)), "lowered": True}
            elif m := PROMPT_CACHE_FITS_RE.search(line):
                out.prompt_cache = {"was": ln.count(m.group(1)), "limit": ln.count(m.group(1)),
                                    "available": ln.count(m.group(2)), "to_pin": ln.count(m.group(3)), "lowered": False}
            else:
                raise ln.error("a `rolling KV: prompt cache limit` line of no known form")
            continue
        if "for the draft (weights" in line or "the draft alone needs" in line:
            if m := DRAFT_ROOM_RE.search(line):
                out.draft_room[m.group(2)] = ln.count(m.group(1))
            elif m := DRAFT_REFUSED_RE.search(line):
                out.draft_refused[m.group(2)] = ln.count(m.group(3))
            else:
                raise ln.error("a rolling-KV draft line of no known form")
            continue
        if "no device memory left for the KV window" in line:
            if not (m := NO_WINDOW_RE.search(line)):
                raise ln.error("a `no device memory left for the KV window` line of no known form")
            keys = ("free", "vram_target", "model", "compute_reserve", "margin")
            out.no_window = {"device": m.group(1),
                             **{k: ln.count(m.group(i)) for i, k in enumerate(keys, 2)}}
        elif (("window" in line or "--vram-target" in line) and out.window_refused is None
              and (m := REFUSED_RE.search(line))):
            out.window_refused = m.group(0).strip()
        if "kv residency:" in line:
            if not (m := RESIDENCY_RE.search(line)):
                raise ln.error("a `kv residency:` line of no known form")
            mem = MEMORY_RE.search(m.group(3))
            out.residency = Residency(m.group(1), "window" if m.group(2) == "window mode" else "resident",
                                      m.group(3), mem.group(1) if mem else None)
        if "kv shift:" in line:
            if m := DUMP_SHIFT_RE.search(line):
                out.dump_shift = (ln.count(m.group(1)), ln.count(m.group(2)), ln.count(m.group(3)))
                continue
            if not (m := KV_SHIFT_RE.search(line)):
                raise ln.error("a `kv shift:` line of no known form")
            out.kv_shifts.append({"type": m.group(1), "cells": ln.count(m.group(2)), "chunk": ln.count(m.group(3)),
                                  "device": m.group(4), "buffer_mib": ln.number_of(m.group(5))})
            continue
        if KV_SHIFT_FAIL_RE.search(line):
            out.kv_shift_failed = True
        if GRAPH_FAIL_RE.search(line):
            out.graph_reserve_failed = True
        if m := CTX_FAIL_RE.search(line):
            out.context_failed = m.group(0).strip()
        if CUDA_OOM_RE.search(line):
            out.oom_lines.append(line.strip())
        for key, rx in (("n_ctx", N_CTX_RE), ("n_batch", N_BATCH_RE), ("n_ubatch", N_UBATCH_RE)):
            if f"llama_context: {key} " in line and re.search(rf"llama_context: {key} += ", line):
                if not (m := rx.search(line)):
                    raise ln.error(f"a `llama_context: {key} =` line of no known form")
                if getattr(out, key) is None:
                    setattr(out, key, ln.count(m.group(1)))
        if "layers to GPU" in line and "offloaded" in line:
            if not (m := OFFLOAD_RE.search(line)):
                raise ln.error("an `offloaded N/M layers to GPU` line of no known form")
            out.offloaded_layers = (ln.count(m.group(1)), ln.count(m.group(2)))
            if out.offloaded_layers[0] > out.offloaded_layers[1]:
                raise ln.error("more layers offloaded than the model has")
        if "prompt eval time =" in line:
            if not (m := PROMPT_EVAL_RE.search(line)):
                raise ln.error("a `prompt eval time =` line of no known form")
            out.prompt_eval = _timing(ln, m)
        elif "eval time =" in line:
            if not (m := EVAL_RE.search(line)):
                raise ln.error("an `eval time =` line of no known form")
            out.eval = _timing(ln, m)
    return out


def _timing(ln: _Line, m: re.Match[str]) -> dict[str, float]:
    return {"ms": ln.number_of(m.group(1)), "n": ln.count(m.group(2)), "ms_per_token": ln.number_of(m.group(3)),
            "tokens_per_second": float(m.group(4)) if m.group(4) in ("inf", "nan") else ln.number_of(m.group(4))}


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
    kv_tail_staging: str | None = None  # "auto" / "on" / "off" (patch 0007)
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

    @property
    def median_ts(self) -> float:
        """Median t/s of the row's repetitions (samples_ts), avg_ts when it has none. One slow or
        fast repetition moves the mean but not the median: on the H200 two pp repetitions of the
        same test gave 17687 and 12070 t/s."""
        return statistics.median(self.samples_ts) if self.samples_ts else self.avg_ts


BENCH_REQUIRED = ("n_prompt", "n_gen", "n_depth", "avg_ns", "avg_ts", "stddev_ts")
KV_TAIL_STAGINGS = ("auto", "on", "off")


def _bench_objects(text: str, source: str) -> list[Any]:
    try:
        if text.startswith("["):
            return json.loads(text)
        start = text.find("[")
        if start >= 0 and not text.lstrip().startswith("{"):
            return json.loads(text[start:text.rfind("]") + 1])
        return [json.loads(ln) for ln in text.splitlines() if ln.strip().startswith("{")]
    except ValueError as e:
        raise LogParseError(f"{source}: llama-bench output is not JSON ({e}): was it cut short?") from e


def parse_bench_json(text: str, source: str = "llama-bench output") -> list[BenchRow]:
    """Rows of `llama-bench -o json` (one JSON array) or `-o jsonl` (one object a line).

    A row without one of BENCH_REQUIRED, or with a value of the wrong type, raises LogParseError
    naming the row (never a 0 t/s or depth)."""
    text = strip_ansi(text).strip()
    if not text:
        return []
    objs = _bench_objects(text, source)
    if not isinstance(objs, list):
        raise LogParseError(f"{source}: llama-bench JSON is a {type(objs).__name__}, not a list of rows")
    rows = []
    for i, o in enumerate(objs):
        try:
            missing = [k for k in BENCH_REQUIRED if k not in o]
            if missing:
                raise KeyError(", ".join(missing))
            rows.append(BenchRow(
                n_prompt=_int(o["n_prompt"]), n_gen=_int(o["n_gen"]), n_depth=_int(o["n_depth"]),
                avg_ts=float(o["avg_ts"]), stddev_ts=float(o["stddev_ts"]), avg_ns=_int(o["avg_ns"]),
                n_ubatch=o.get("n_ubatch"), n_batch=o.get("n_batch"), type_k=o.get("type_k"),
                type_v=o.get("type_v"),
                no_kv_offload=None if o.get("no_kv_offload") is None else bool(o["no_kv_offload"]),
                flash_attn=o.get("flash_attn"), kv_residency_mode=o.get("kv_residency_mode"),
                vram_target=None if o.get("vram_target") is None else _int(o["vram_target"]),
                kv_tail_staging=_staging(o.get("kv_tail_staging")),
                gpu_info=o.get("gpu_info"), build_commit=o.get("build_commit"),
                samples_ts=[float(x) for x in o.get("samples_ts") or []],
            ))
        except (KeyError, TypeError, ValueError) as e:
            raise LogParseError(f"{source}: llama-bench row {i} is not a result row "
                                f"({type(e).__name__}: {e}): {json.dumps(o)[:300]}") from e
    return rows


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise ValueError(f"{v!r} is not an integer")
    return int(v)


def _staging(v: Any) -> str | None:
    """A row's kv_tail_staging (llama_kv_tail_staging_name: auto, on or off), None when the build's
    llama-bench does not report it."""
    if v is not None and v not in KV_TAIL_STAGINGS:
        raise ValueError(f"kv_tail_staging {v!r} is not one of {', '.join(KV_TAIL_STAGINGS)}")
    return v


# ----------------------------------------------------------------------------- llama-window-test

WT_STATUSES = ("PASS", "FAIL", "SKIP")
# anything that starts like a check line (any case, "FAILED", "SKIPPED", no name) must have the form
WT_TRIGGER_RE = re.compile(r"^(pass|fail|skip)(ed|ped)?\b", re.I)
WT_PASS_RE = re.compile(r"^PASS (\S.*)$")
# "<device>: <what>: <detail>" or "<what>: <detail>"; FAIL prints "name: " even for an empty detail
WT_FAIL_SKIP_RE = re.compile(r"^(FAIL|SKIP) ((?:\S+: )?\S.*?):(?: (.*))?$")
WT_SUMMARY_TRIGGER = "window-test:"
WT_SUMMARY_RE = re.compile(r"^window-test: " + INT + r" device\(s\) with window buffers, " + INT
                           + r" failure\(s\)( \(GGML_CUDA_P2P set\))?$")


@dataclass
class WindowTestCheck:
    """One check line of llama-window-test: status PASS, FAIL or SKIP; detail is FAIL's detail or
    SKIP's reason; line is its line number in the output."""

    status: str
    name: str
    detail: str = ""
    line: int = 0


@dataclass
class WindowTestSummary:
    devices: int  # devices with window buffers
    failures: int
    p2p: bool  # the program saw GGML_CUDA_P2P in its environment


@dataclass
class WindowTestOutput:
    source: str = "llama-window-test output"
    checks: list[WindowTestCheck] = field(default_factory=list)
    summary: WindowTestSummary | None = None

    def with_status(self, status: str) -> list[WindowTestCheck]:
        return [c for c in self.checks if c.status == status]


def parse_window_test(text: str | Iterable[str], source: str = "llama-window-test output") -> WindowTestOutput:
    """The check lines and the summary of llama-window-test's stdout. Other lines are left alone;
    a line that starts like a check line or the summary but lacks its form, and a second summary,
    raise LogParseError naming the source and line."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    out = WindowTestOutput(source=source)
    for number, raw in enumerate(lines, 1):
        line = strip_ansi(raw).rstrip()
        ln = _Line(source, number, line)
        if WT_TRIGGER_RE.match(line):
            if m := WT_PASS_RE.match(line):
                out.checks.append(WindowTestCheck("PASS", m.group(1), "", number))
            elif m := WT_FAIL_SKIP_RE.match(line):
                out.checks.append(WindowTestCheck(m.group(1), m.group(2), m.group(3) or "", number))
            else:
                raise ln.error("a check line of no known form (expected `PASS <check>`, `FAIL <check>: <detail>` "
                               "or `SKIP <check>: <reason>`)")
        elif line.startswith(WT_SUMMARY_TRIGGER):
            if not (m := WT_SUMMARY_RE.match(line)):
                raise ln.error("a `window-test:` summary line of no known form")
            if out.summary is not None:
                raise ln.error("a second `window-test:` summary line")
            out.summary = WindowTestSummary(ln.count(m.group(1)), ln.count(m.group(2)), m.group(3) is not None)
    return out


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


TIMINGS_REQUIRED = ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                    "predicted_per_second")


def parse_completion(resp: dict[str, Any]) -> tuple[str, Timings | None]:
    """(content, timings) of a llama-server `/completion` JSON response. Timings are None when the
    response has none; timings without one of TIMINGS_REQUIRED raise LogParseError."""
    content = str(resp.get("content", ""))
    t = resp.get("timings")
    if t is None:
        return content, None
    try:
        missing = [k for k in TIMINGS_REQUIRED if k not in t]
        if missing:
            raise KeyError(", ".join(missing))
        return content, Timings(
            prompt_n=_int(t["prompt_n"]), prompt_ms=float(t["prompt_ms"]),
            prompt_per_second=float(t["prompt_per_second"]),
            predicted_n=_int(t["predicted_n"]), predicted_ms=float(t["predicted_ms"]),
            predicted_per_second=float(t["predicted_per_second"]), cache_n=_int(t.get("cache_n", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise LogParseError(f"llama-server /completion timings unreadable ({type(e).__name__}: {e}): "
                            f"{json.dumps(t)[:300]}") from e
