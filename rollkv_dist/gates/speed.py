"""speed: llama-bench per depth (default 16384, 65536) and K/V type (default f16, q8_0): resident,
window (50-65 % of the decode context's cells in the host tail) and -nkvo; then a ubatch sweep.

The window run compares tail staging side by side in one llama-bench invocation at the found
--vram-target: "before" = `-kts off` (zero-copy reads; the attention kernels re-read the tail per
query tile), "after" = `-kts auto` (a layer's K/V copied to the device once per ubatch, the next
layer's copy made while this one computes: patches 0004/0007). Above --speed-off-max-depth only
auto runs, and the report says "before" was not measured there.

The link rate is measured in the same run: the effective tail GB/s of the f16 zero-copy (-kts off)
window decode (tail.link_rate); where every f16 depth is above --speed-off-max-depth, a decode-only
probe at the shallowest one measures it (off's decode is seconds, its prefill minutes). Two decode
bounds come from it: the link bound (serial: resident time + tail bytes a token reads / link rate,
what zero-copy reaches) and the overlap bound (the larger of the two, what the prefetch can reach).
Checks per depth and K/V type (thresholds in tail.py, overridable): window (auto) prefill >= 70 % of
resident and >= 2x -nkvo; quantized K/V: window (auto) decode >= 85 % of the link bound; f16: window
(auto) decode >= 97 % of zero-copy (off) where off ran, and >= 75 % of the overlap bound.

In an all-GPU run (every GPU in one process, layer split) it measures decode with a tail on every
GPU instead: the effective link rate per device and together, against one GPU with the same total
tail (speed_split.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rollkv_dist.gates import logparse
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates import sizing
from rollkv_dist.gates.bench import SpeedModelOptions, bench_fixed, pick, run_bench
from rollkv_dist.gates.context import GateContext, GateResult, ensure_random_model, preflight
from rollkv_dist.gates.sizing import search_vram_target, window_outcome
from rollkv_dist.gates.curve import ENGINE_FLAGS
from rollkv_dist.gates.rows import (Rates, SpeedRatios, SpeedRow, SpeedWindow, SplitRun, Staged, UbatchPoint,
                                    UbatchSweep)
from rollkv_dist.gates.speed_split import markdown as split_markdown
from rollkv_dist.gates.speed_split import run_split
from rollkv_dist.gates.tail import (AFTER, BEFORE, DECODE_VS_LINK, F16_DECODE_FLOOR, F16_DECODE_VS_OVERLAP,
                                    PREFILL_VS_NKVO, TPS_STATISTIC, Link, Thresholds, by_staging, fmt, kts_args,
                                    limit_tps, link_rate, overlap_tps, pct, prefill_vs_resident_option, quantized,
                                    ratio)

NAME = "speed"
BINARIES = ("llama-bench",)
TAIL_LO, TAIL_HI = 0.5, 0.65  # host-tail share of the decode context's cells for the window run
N_PROMPT, N_GEN = 512, 64
DEPTHS = "16384,65536"
KV_TYPES = "f16,q8_0"
# the largest depth at which "before" (-kts off) runs too: off prefill re-reads the tail per query
# tile, so it is slow at depth (at 64k with half the cells in the tail: 374 t/s on an H200)
OFF_MAX_DEPTH = 16384
UBATCH_SWEEP = "512,1024,2048,4096"
UBATCH_SWEEP_DEPTH = 16384


@dataclass(frozen=True)
class Options(SpeedModelOptions):
    speed_depths: str = option("depths (comma list)", DEPTHS)
    kv_types: str = option("K/V types, -ctk T -ctv T (comma list)", KV_TYPES)
    speed_off_max_depth: int = option("largest depth at which -kts off (before) runs beside auto", OFF_MAX_DEPTH,
                                      metavar="D")
    ubatch_sweep: str = option("window prefill per ubatch at depth 16384, f16 K/V, -kts auto ('none' skips it)",
                               UBATCH_SWEEP, metavar="LIST")
    prefill_vs_resident_pct: float = prefill_vs_resident_option()
    prefill_vs_nkvo: float = option("window (auto) prefill goal as a multiple of -nkvo", PREFILL_VS_NKVO, metavar="X")
    decode_vs_link_pct: float = option("quantized-KV window (auto) decode goal in % of the link bound",
                                       100 * DECODE_VS_LINK, flag="--decode-vs-link", metavar="PCT")
    f16_decode_floor_pct: float = option("f16 window decode with auto in % of zero-copy (off)", 100 * F16_DECODE_FLOOR,
                                         flag="--f16-decode-floor", metavar="PCT")
    f16_decode_vs_overlap_pct: float = option("f16 window decode with auto in % of the overlap bound (link and compute "
                                              "overlapped)", 100 * F16_DECODE_VS_OVERLAP,
                                              flag="--f16-decode-vs-overlap", metavar="PCT")


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    if not preflight(ctx, res, ctx.bin("llama-bench"), ENGINE_FLAGS):
        return res
    model = str(o.model or ensure_random_model(ctx, o.speed_shape, "q8_0"))
    depths = [int(x) for x in o.speed_depths.split(",")]
    kv_types = [x.strip() for x in o.kv_types.split(",") if x.strip()]
    off_max = o.speed_off_max_depth
    th = Thresholds(prefill_vs_resident=o.prefill_vs_resident_pct / 100, prefill_vs_nkvo=o.prefill_vs_nkvo,
                    decode_vs_link=o.decode_vs_link_pct / 100, f16_decode_floor=o.f16_decode_floor_pct / 100,
                    f16_decode_vs_overlap=o.f16_decode_vs_overlap_pct / 100)
    res.results.update({"model": model, "kv_types": kv_types, "off_max_depth": off_max, "n_prompt": N_PROMPT,
                        "n_gen": N_GEN, "thresholds": asdict(th), "tps_statistic": TPS_STATISTIC, "rows": []})
    if ctx.split:  # every GPU in one process: decode with a tail on each (speed_split.py)
        run_split(ctx, res, model, depths, kv_types, th, o.reps)
        return res
    rows: list[SpeedRow] = res.results["rows"]
    for d in depths:
        for kv in kv_types:
            row = SpeedRow(depth=d, kv_type=kv)
            rows.append(row)
            _measure(ctx, res, row, model, d, kv, off_max)
    f16 = [r for r in rows if not quantized(r.kv_type) and r.window]
    zero_copy = [(f"d{r.depth} {r.kv_type}", r.before.effective_tail_gbps) for r in f16 if r.before]
    if not zero_copy and f16:
        zero_copy = _link_probe(ctx, res, model, min(f16, key=lambda r: r.depth))
    link = link_rate(zero_copy, ctx.gpu)
    res.results["link"] = asdict(link)
    if not link.measured:
        res.notes.append(f"link rate: {link.source}")
    for row in rows:
        _verdicts(res, row, link, th)
    _ubatch_sweep(ctx, res, model)
    return res


def _measure(ctx: GateContext, res: GateResult, row: SpeedRow, model: str, d: int, kv: str,
             off_max: int) -> None:
    """Resident, window (before/after) and -nkvo runs of one depth and K/V type; fills row."""
    tag = f"d{d} {kv}"
    base = _bench_base(ctx, kv, d, N_PROMPT)
    p, rows, log = run_bench(ctx, res, f"resident-{kv}-d{d}", model, [*base, "-krm", "resident"])
    tg, pp = pick(rows, "tg"), pick(rows, "pp")
    if not res.check(f"{tag}: resident bench runs", tg is not None and pp is not None, f"rc={p.rc}"):
        return
    row.resident = Rates.of(tg, pp)
    kv_mib = log.require_mib("kv-largest-cache")
    layers = log.kv_caches[0][2] if log.kv_caches else 0
    per_tensor_mib = kv_mib / (2 * layers) if layers else None
    row.kv_mib, row.kv_mib_per_tensor, row.kv_tensors = kv_mib, per_tensor_mib, 2 * layers
    row.kv_mib_per_cell = log.kv_mib_per_cell
    if per_tensor_mib is not None and per_tensor_mib < 2 * sizing.GRANULE_MIB:
        # a device segment is at least one 2 MiB granule per K/V tensor: no tail is possible
        res.notes.append(f"{tag}: window not applicable: {per_tensor_mib:.2f} MiB per K/V tensor is below "
                         f"two {sizing.GRANULE_MIB} MiB granules, so the whole KV stays on the device")
    else:
        _window(ctx, res, row, model, base, kv_mib, log, [AFTER, BEFORE] if d <= off_max else [AFTER])
        if row.window and not row.before:
            res.notes.append(f"{tag}: \"before\" (-kts off) not measured in this run: depth {d} is above "
                             f"--speed-off-max-depth {off_max}")
    p, rows, _ = run_bench(ctx, res, f"nkvo-{kv}-d{d}", model, [*base, "-nkvo", "1"])
    ntg, npp = pick(rows, "tg"), pick(rows, "pp")
    if res.check(f"{tag}: -nkvo bench runs", ntg is not None and npp is not None, f"rc={p.rc}"):
        row.nkvo = Rates.of(ntg, npp)


def _bench_base(ctx: GateContext, kv: str, d: int, n_prompt: int) -> list[str]:
    """llama-bench arguments shared by a depth's runs."""
    return ["-fa", "on", "-ngl", "99", "-ctk", kv, "-ctv", kv, "-d", str(d), "-p", str(n_prompt), "-n", str(N_GEN),
            "-r", str(ctx.options.reps)]


def _link_probe(ctx: GateContext, res: GateResult, model: str, row: SpeedRow) -> list[tuple[str, float | None]]:
    """The link rate where no f16 depth ran "before" (all above --speed-off-max-depth): a decode-only
    run (-p 0) of `row` (the shallowest f16 window row) at its --vram-target with -kts auto,off, so the depth
    fill runs staged and only off's decode reads the tail zero-copy (seconds, where off's prefill at
    64k would take minutes). Its effective tail GB/s is the run's link rate; without it the bounds
    rest on the PCIe link's nominal rate, which an H200 reaches about 80 % of. Fills row.link_probe."""
    d, vt = row.depth, row.window.vram_target
    args = [*_bench_base(ctx, row.kv_type, d, 0), "-krm", "window", "-vt", str(vt), *kts_args([AFTER, BEFORE])]
    p, bench_rows, log = run_bench(ctx, res, f"link-probe-{row.kv_type}-d{d}", model, args)
    meas = by_staging(bench_rows, log, d, N_PROMPT, N_GEN, row.kv_mib_per_cell, row.resident.decode_tps)
    off = meas.get(BEFORE)
    gbps = None if off is None else off.effective_tail_gbps
    if not res.check(f"d{d} {row.kv_type}: link probe (decode only, -kts off) runs", bool(gbps), f"rc={p.rc}"):
        return []
    row.link_probe = off
    return [(f"d{d} {row.kv_type} link probe", gbps)]


def _window(ctx: GateContext, res: GateResult, row: SpeedRow, model: str, base: list[str], kv_mib: float,
            log: logparse.LlamaLog, stagings: list[str]) -> None:
    """Window run(s) with 50-65 % of the (auto) decode context's cells in the host tail, staging
    `stagings` side by side in each invocation; fills row.window."""
    d, kv = row.depth, row.kv_type
    mid = (TAIL_LO + TAIL_HI) / 2
    # what the engine keeps before any cell with these very arguments (a -vt 1 probe fails before the
    # depth fill), so the first full run usually lands: each costs a depth fill
    fixed = bench_fixed(ctx, res, model, [*base, *kts_args(stagings)], f"window-{kv}-d{d}-vt1-probe",
                        ["CUDA0"])["CUDA0"]
    tensors = sizing.devices_of(log)[0].n_tensors
    found: dict[int, Any] = {}

    def attempt(t: int) -> tuple[bool, logparse.Window | None]:
        """A window run that keeps t MiB of the KV on the device."""
        vt = sizing.vram_target(fixed, t, tensors)
        p2, rows2, log2 = run_bench(ctx, res, f"window-{kv}-d{d}-vt{vt}", model,
                                    [*base, "-krm", "window", "-vt", str(vt), *kts_args(stagings)])
        found[t] = (vt, rows2, log2)
        # decode runs in the depth + n_gen context; auto runs first, so its context is the first that size
        return window_outcome(log2, p2.rc == 0 and bool(rows2), n_cells=d + N_GEN)

    t, w = search_vram_target(attempt, (1 - mid) * kv_mib, kv_mib, lo=TAIL_LO, hi=TAIL_HI, tries=6)
    vt, rows_t, log_t = found[t] if t is not None else (None, [], None)
    meas = {} if t is None else by_staging(rows_t, log_t, d, N_PROMPT, N_GEN, row.kv_mib_per_cell,
                                           row.resident.decode_tps)
    after = meas.get(AFTER) or Staged()
    if not res.check(f"d{d} {kv}: window bench with a host tail of {TAIL_LO:.0%}-{TAIL_HI:.0%} of the cells",
                     t is not None and bool(after.decode_tps) and bool(after.prefill_tps),
                     f"window={None if w is None else w.__dict__}"):
        return
    row.window = SpeedWindow(vram_target=vt, stagings=stagings, after=after, before=meas.get(BEFORE))
    res.check(f"d{d} {kv}: KV bytes per cell logged (llama_kv_cache: size)", bool(row.kv_mib_per_cell))


def _verdicts(res: GateResult, row: SpeedRow, link: Link, th: Thresholds) -> None:
    """Ratios of one depth and K/V type (row.ratios) and their checks."""
    a, b, r, n = row.after, row.before, row.resident, row.nkvo or Rates()
    if not a or not r:
        return
    tag = f"d{row.depth} {row.kv_type}"
    read = a.tail_read_mib_per_token
    bound = None if read is None else limit_tps(r.decode_tps, read, link.gbps)
    row.link_bound_decode_tps = None if bound is None else round(bound, 2)
    over = None if read is None else overlap_tps(r.decode_tps, read, link.gbps)
    row.overlap_bound_decode_tps = None if over is None else round(over, 2)
    q = row.ratios = SpeedRatios(
        prefill_after_over_resident=ratio(a.prefill_tps, r.prefill_tps),
        prefill_after_over_nkvo=ratio(a.prefill_tps, n.prefill_tps),
        decode_after_over_link_bound=ratio(a.decode_tps, bound),
        decode_after_over_overlap_bound=ratio(a.decode_tps, over),
        decode_after_over_nkvo=ratio(a.decode_tps, n.decode_tps))
    if b:
        bread = b.tail_read_mib_per_token
        q.prefill_before_over_resident = ratio(b.prefill_tps, r.prefill_tps)
        q.prefill_before_over_nkvo = ratio(b.prefill_tps, n.prefill_tps)
        q.prefill_after_over_before = ratio(a.prefill_tps, b.prefill_tps)
        q.decode_before_over_link_bound = ratio(b.decode_tps, None if bread is None else
                                                limit_tps(r.decode_tps, bread, link.gbps))
        # off at after's window: its own zero-copy rate over after's tail bytes. Equal to off's t/s when
        # both contexts got the same window (staging adds its copy to the compute reserve, which can
        # cost the auto context a granule of cells)
        if b.effective_tail_gbps and read is not None:
            q.decode_after_over_before = ratio(a.decode_tps, limit_tps(r.decode_tps, read, b.effective_tail_gbps))
    res.check(f"{tag}: window prefill (auto) >= {th.prefill_vs_resident:.0%} of resident",
              (q.prefill_after_over_resident or 0) >= th.prefill_vs_resident,
              f"{a.prefill_tps:.1f} / {r.prefill_tps:.1f} t/s = {q.prefill_after_over_resident}")
    res.check(f"{tag}: window prefill (auto) >= {th.prefill_vs_nkvo:g}x -nkvo",
              (q.prefill_after_over_nkvo or 0) >= th.prefill_vs_nkvo,
              f"{a.prefill_tps:.1f} / {n.prefill_tps} t/s = {q.prefill_after_over_nkvo}")
    how = "measured" if link.measured else link.source.split(":")[0]
    if quantized(row.kv_type):
        res.check(f"{tag}: window decode (auto) >= {th.decode_vs_link:.0%} of the link bound",
                  (q.decode_after_over_link_bound or 0) >= th.decode_vs_link,
                  f"{a.decode_tps:.2f} t/s vs bound {row.link_bound_decode_tps} t/s = "
                  f"{q.decode_after_over_link_bound} (resident {r.decode_tps:.1f} t/s, {read} MiB of tail "
                  f"per token at {link.gbps} GB/s, {how})")
    else:
        if b:
            res.check(f"{tag}: window decode (auto) >= {th.f16_decode_floor:.0%} of zero-copy (off)",
                      (q.decode_after_over_before or 0) >= th.f16_decode_floor,
                      f"{a.decode_tps:.2f} vs {b.decode_tps:.2f} t/s (tail per token {read} / "
                      f"{b.tail_read_mib_per_token} MiB) = {q.decode_after_over_before}")
        res.check(f"{tag}: window decode (auto) >= {th.f16_decode_vs_overlap:.0%} of the overlap bound",
                  (q.decode_after_over_overlap_bound or 0) >= th.f16_decode_vs_overlap,
                  f"{a.decode_tps:.2f} t/s vs overlap bound {row.overlap_bound_decode_tps} t/s = "
                  f"{q.decode_after_over_overlap_bound} (max(resident {r.decode_tps:.1f} t/s, {read} MiB of tail "
                  f"per token at {link.gbps} GB/s), {how})")


def _ubatch_sweep(ctx: GateContext, res: GateResult, model: str) -> None:
    """Window prefill at depth 16384 (f16 K/V, -kts auto, -b = the largest ubatch) per ubatch, with
    the speed run's window C at every ubatch. The compute buffer grows with the ubatch (the logits
    alone are n_ubatch x n_vocab floats: ~300 MiB per 512 tokens on the qwen2 shapes), so one
    --vram-target leaves no window at the large ubatches: each ubatch gets its own llama-bench run
    at the engine's fixed part for it (a -vt 1 probe) + C cells."""
    spec = ctx.options.ubatch_sweep
    ubs = [int(x) for x in spec.split(",") if x.strip() and x.strip() != "none"]
    if not ubs:
        return
    d = UBATCH_SWEEP_DEPTH
    row = next((r for r in res.results["rows"] if r.depth == d and r.kv_type == "f16"), None)
    if row is None:
        res.notes.append(f"ubatch sweep not run: it needs depth {d} and f16 K/V among the speed runs")
        return
    after = row.after
    if not res.check("ubatch sweep: an f16 window at depth 16384 to sweep at", bool(after and after.window)):
        return
    cells, per_cell, tensors = after.window.cells_resident, row.kv_mib_per_cell, row.kv_tensors
    n_p = max(ubs)  # one prompt of the largest ubatch, so every ubatch size is really used
    base = ["-fa", "on", "-ngl", "99", "-ctk", "f16", "-ctv", "f16", "-d", str(d), "-p", str(n_p), "-n", "0",
            "-r", str(ctx.options.reps), "-b", str(n_p), *kts_args([AFTER])]
    sweep = UbatchSweep(depth=d, n_prompt=n_p, n_batch=n_p, kv_type="f16", staging=AFTER, cells_resident=cells)
    res.results["ubatch_sweep"] = sweep
    for ub in ubs:
        args = [*base, "-ub", str(ub)]
        fixed = bench_fixed(ctx, res, model, args, f"ubatch{ub}-vt1-probe").get("CUDA0")
        pt = UbatchPoint(n_ubatch=ub, fixed_mib=None if fixed is None else fixed.mib)
        sweep.points.append(pt)
        if fixed is None:
            continue
        t = sizing.vram_target(fixed, cells * per_cell, tensors)
        p, rows, log = run_bench(ctx, res, f"ubatch{ub}-vt{t}", model, [*args, "-krm", "window", "-vt", str(t)])
        w, pp = log.window_for(d + n_p), pick(rows, "pp")
        pt.vram_target, pt.rc, pt.window = t, p.rc, w
        pt.tail_fraction = None if w is None else round(w.tail_fraction, 4)
        pt.compute_mib = log.compute_mib("CUDA0")
        pt.prefill_tps, pt.prefill_samples_ts = (None, None) if pp is None else (pp.median_ts, pp.samples_ts)
    ran = [pt for pt in sweep.points if pt.prefill_tps]
    res.check(f"ubatch sweep ran (window, f16 K/V, -kts auto, depth {d}, -ub {','.join(map(str, ubs))})",
              len(ran) == len(ubs), f"{len(ran)}/{len(ubs)} ubatches measured")


# ----------------------------------------------------------------------------- report

def markdown(results: dict[str, Any]) -> list[str]:
    """The speed report's tables (from the report's JSON): prefill and decode per depth and K/V type, then
    the ubatch sweep (an all-GPU run: speed_split.markdown)."""
    if results.get("split"):
        return split_markdown(SplitRun.from_json(results["split"]))
    rows = [SpeedRow.from_json(r) for r in results.get("rows") or []]
    if not rows:
        return []
    th = Thresholds.from_json(results.get("thresholds"))
    link = results.get("link") or {}
    off_max = results.get("off_max_depth")
    out = [f"- link rate {link.get('gbps')} GB/s: {link.get('source')}",
           f"- {results.get('tps_statistic') or TPS_STATISTIC}",
           "- before = `-kts off` (zero-copy reads of the host tail), after = `-kts auto` (the tail staged on "
           "the device once per layer and ubatch; quantized K/V always), side by side in one llama-bench "
           f"invocation at the same --vram-target; \"not run\": depth above --speed-off-max-depth {off_max}, "
           "before was not measured in this run",
           "", f"Prefill pp{results.get('n_prompt', 512)} (t/s; tail % of the pp test's context):", "",
           "| depth | KV | tail % | resident | window before | window after | -nkvo | "
           f"after / resident (>= {100 * th.prefill_vs_resident:.0f} %) | "
           f"after / -nkvo (>= {th.prefill_vs_nkvo:g}x) | before / resident | after / before |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    dec = ["", f"Decode tg{results.get('n_gen', 64)} (t/s; tail % of the tg test's context; link bound = "
               "1 / (1/resident + tail MiB per token / link rate), zero-copy's; overlap bound = "
               "1 / max(1/resident, tail MiB per token / link rate), the prefetch's):", "",
           "| depth | KV | tail % | tail MiB/token | resident | window before | window after | -nkvo | "
           f"link bound | after / bound (q8_0: >= {100 * th.decode_vs_link:.0f} %) | before / bound | "
           f"after / before (f16: >= {100 * th.f16_decode_floor:.0f} %) | overlap bound | "
           f"after / overlap (f16: >= {100 * th.f16_decode_vs_overlap:.0f} %) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b, q = r.after or Staged(), r.before, r.ratios or SpeedRatios()
        res_, nk = r.resident or Rates(), r.nkvo or Rates()

        def off(text: str) -> str:  # a before column: "not run" where the window ran without it
            return text if b else "not run" if r.window else "-"

        out.append(f"| {r.depth} | {r.kv_type} | {pct(a.prefill_tail_fraction)} | {fmt(res_.prefill_tps)} | "
                   f"{off(fmt(b and b.prefill_tps))} | {fmt(a.prefill_tps)} | {fmt(nk.prefill_tps)} | "
                   f"{fmt(q.prefill_after_over_resident, '.3f')} | {fmt(q.prefill_after_over_nkvo, '.2f')} | "
                   f"{off(fmt(q.prefill_before_over_resident, '.3f'))} | {off(fmt(q.prefill_after_over_before, '.2f'))} |")
        dec.append(f"| {r.depth} | {r.kv_type} | {pct(a.tail_fraction)} | {fmt(a.tail_read_mib_per_token)} | "
                   f"{fmt(res_.decode_tps)} | {off(fmt(b and b.decode_tps))} | {fmt(a.decode_tps)} | "
                   f"{fmt(nk.decode_tps)} | {fmt(r.link_bound_decode_tps)} | "
                   f"{fmt(q.decode_after_over_link_bound, '.3f')} | {off(fmt(q.decode_before_over_link_bound, '.3f'))} | "
                   f"{off(fmt(q.decode_after_over_before, '.3f'))} | {fmt(r.overlap_bound_decode_tps)} | "
                   f"{fmt(q.decode_after_over_overlap_bound, '.3f')} |")
    out += dec
    if results.get("ubatch_sweep"):
        sw = UbatchSweep.from_json(results["ubatch_sweep"])
        out += ["", f"Ubatch sweep: window mode, f16 K/V, -kts auto, depth {sw.depth}, pp{sw.n_prompt}, "
                    f"-b {sw.n_batch}, {sw.cells_resident} cells on the device (the speed run's window):", "",
                "| ubatch | vram target | fixed MiB (engine) | compute MiB | window (C / cells) | tail % | "
                f"pp{sw.n_prompt} t/s |", "|---|---|---|---|---|---|---|"]
        for pt in sw.points:
            win = f"{pt.window.cells_resident} / {pt.window.kv_size}" if pt.window else "- / -"
            out.append(f"| {pt.n_ubatch} | {fmt(pt.vram_target, 'd')} | {fmt(pt.fixed_mib, '.0f')} | "
                       f"{fmt(pt.compute_mib)} | {win} | {pct(pt.tail_fraction)} | {fmt(pt.prefill_tps)} |")
    return out


GATE = Gate(name=NAME, order=60, run=run, options=Options, report_rows=markdown, binaries=BINARIES, multi_gpu=True)
