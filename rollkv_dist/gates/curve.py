"""curve: decode/prefill speed against the host-tail size at a fixed context and depth.

One llama-bench run per point (`-krm window -vt X -kts auto,off -v -o json`), sweeping
--vram-target down from "everything resident"; each point records, for tail staging auto
("after") and off ("before", unless --curve-staging auto), the host tail MiB of each test's own
context (window line), decode t/s and prefill t/s. Decode is plotted against the link-rate line:
time per token = resident time + tail bytes a token reads / link rate (what zero-copy reaches), the
link rate measured at the curve's own points (median effective tail GB/s of the zero-copy f16
decode, -kts off; tail.link_rate; with --curve-staging auto a decode-only -kts off probe, see
_link_probe), and
the overlap line max(resident time, tail bytes / link rate) (what the prefetch of patches
0004/0007 can reach). Checks: auto prefill >= 70 % of resident at every windowed point whose pp
context has a tail of at most 65 % of its cells; auto decode at least 90 % of the link-rate line at
every windowed point. Off and auto contexts at one --vram-target can hold different windows (the
staged copies are part of auto's compute reserve, about 4 GiB at -c 524288 on the 14B shape), so
the table gives each one's tail. `--curve-staging off` is a before curve on its own: its probe
and points run `-kts off`, so the targets leave off's windows the tails auto's run has at the same
fractions (a before at matched tails); the staging goals are auto's and are not checked there.
--curve-ubatch U runs every test with `-ub U -b max(U, 2048)` and a prompt of max(512, U) tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rollkv_dist.errors import UsageError
from rollkv_dist.models import SHAPES
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates import sizing
from rollkv_dist.gates.bench import BenchOptions, bench_fixed, pick, run_bench
from rollkv_dist.gates.context import GateContext, GateResult, ensure_random_model, preflight
from rollkv_dist.gates.rows import CurveLinkProbe, CurvePoint, CurveResident, Rates, Staged, jsonable
from rollkv_dist.gates.tail import (AFTER, BEFORE, CURVE_DECODE_TOLERANCE, CURVE_PREFILL_TAIL_MAX, TPS_STATISTIC,
                                    Thresholds, by_staging, fmt, kts_args, limit_tps, link_rate, overlap_tps,
                                    parse_stagings, pct, prefill_vs_resident_option, ratio)

NAME = "curve"
BINARIES = ("llama-bench",)
FRACTIONS = "1.0,0.9,0.75,0.6,0.5,0.4,0.3,0.2,0.1"
ENGINE_FLAGS = ("--kv-residency-mode", "--vram-target", "--kv-tail-staging")
PROBE_TAIL_MIN = 0.25  # the link probe's decode tail: at least this share of its cells where a point has it
PLOT_STYLE = {AFTER: ("o-", "after: -kts auto (staged, prefetch)"), BEFORE: ("s--", "before: -kts off (zero-copy)")}


@dataclass(frozen=True)
class Options(BenchOptions):
    curve_shape: str = option("random model shape (qwen2.5-14b-1m = the seed's model)", "qwen2-1.5b",
                              choices=sorted(SHAPES))
    curve_depth: int = option("depth (-d)", 16384)
    curve_ctx: int | None = option("every test's context (llama-bench -c N, e.g. the seed's 524288; default: the "
                                   "test's own): the points then take fractions of the KV of the cells the tests "
                                   "use, and each pins the rest of the N-cell KV", None, metavar="N")
    curve_ubatch: int | None = option("-ub N -b max(N, 2048) and a prompt of max(512, N) tokens (default: "
                                      "llama-bench's 512)", None, metavar="N")
    curve_staging: str = option("tail staging per point: before and after side by side, after, or before only "
                                "(zero-copy, its targets sized for off's own reserve)", f"{BEFORE},{AFTER}",
                                choices=(f"{BEFORE},{AFTER}", AFTER, BEFORE), metavar="off,auto|auto|off")
    curve_nkvo: bool = option("skip the -nkvo anchor run (slow on large models)", True, flag="--curve-no-nkvo")
    curve_fractions: str = option("points at the engine's fixed part + these fractions of the KV", FRACTIONS)
    curve_targets: str | None = option("extra --vram-target points (MiB, comma list)", None)
    prefill_vs_resident_pct: float = prefill_vs_resident_option()
    curve_decode_tolerance_pct: float = option("decode at least (100 - PCT) % of the link-rate line",
                                               100 * CURVE_DECODE_TOLERANCE, flag="--curve-decode-tolerance",
                                               metavar="PCT")


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    stagings = parse_stagings(o.curve_staging)  # UsageError before any run
    primary = AFTER if AFTER in stagings else BEFORE  # the staging of a point's own fields
    if not preflight(ctx, res, ctx.bin("llama-bench"), ENGINE_FLAGS + (("--ctx-size",) if o.curve_ctx else ())):
        return res
    model = str(o.model or ensure_random_model(ctx, o.curve_shape, "q8_0"))
    depth = o.curve_depth
    ub = o.curve_ubatch or 0
    th = Thresholds(prefill_vs_resident=o.prefill_vs_resident_pct / 100,
                    curve_decode_tolerance=o.curve_decode_tolerance_pct / 100)
    n_p, n_g = max(512, ub), 64
    if o.curve_ctx is not None and o.curve_ctx < depth + n_p:
        raise UsageError(f"--curve-ctx {o.curve_ctx}: the tests use depth + prompt = {depth + n_p} cells; give at "
                         "least that")
    def bench_base(n_prompt: int) -> list[str]:
        return ["-fa", "on", "-ngl", "99", "-d", str(depth), "-p", str(n_prompt), "-n", str(n_g), "-r",
                str(o.reps), *(["-ub", str(ub), "-b", str(max(ub, 2048))] if ub else []),
                *(["-c", str(o.curve_ctx)] if o.curve_ctx else [])]

    base = bench_base(n_p)
    res.results.update({"model": model, "depth": depth, "n_prompt": n_p, "n_gen": n_g, "n_ubatch": ub or None,
                        "n_ctx": o.curve_ctx,
                        "stagings": stagings, "primary_staging": primary, "thresholds": asdict(th),
                        "tps_statistic": TPS_STATISTIC, "points": []})

    p, rows, log = run_bench(ctx, res, "resident", model, [*base, "-krm", "resident"])
    tg, pp = pick(rows, "tg"), pick(rows, "pp")
    if not res.check("resident bench runs", p.rc == 0 and tg is not None and pp is not None, f"rc={p.rc}"):
        return res
    kv, per_cell = log.require_mib("kv-largest-cache"), log.kv_mib_per_cell
    res.results["resident"] = resident = CurveResident(
        **vars(Rates.of(tg, pp)), kv_mib=kv, kv_mib_per_cell=per_cell, model_mib=log.model_buffers.get("CUDA0"),
        compute_mib=log.compute_mib("CUDA0"))
    # the probe stages like the points (auto first), so its reserve counts the staged copy
    fixed = bench_fixed(ctx, res, model, [*base, *kts_args(stagings)], "window-vt1-probe", ["CUDA0"])["CUDA0"]
    res.results["fixed_mib"] = fixed.mib
    tensors = sizing.devices_of(log)[0].n_tensors
    res.results["nkvo"] = None
    if o.curve_nkvo:
        p, rows, _ = run_bench(ctx, res, "nkvo", model, [*base, "-nkvo", "1"])
        ntg, npp = pick(rows, "tg"), pick(rows, "pp")
        res.results["nkvo"] = None if ntg is None else Rates.of(ntg, npp)

    # the engine's fixed part + a fraction of the KV: the points span fully resident to all-host
    # with -c the KV is the whole context's; the points are fractions of the part the tests use
    span = kv if not o.curve_ctx else per_cell * (depth + n_p)
    fraction_of = {sizing.vram_target(fixed, float(f) * span, tensors): float(f)
                   for f in o.curve_fractions.split(",") if f.strip()}
    targets = [*fraction_of, *(int(x) for x in (o.curve_targets or "").split(",") if x.strip())]
    for t in sorted(set(targets), reverse=True):
        p, rows, log = run_bench(ctx, res, f"window-vt{t}", model,
                                 [*base, "-krm", "window", "-vt", str(t), *kts_args(stagings)])
        # llama-bench makes one context per test: decode runs in depth + n_gen cells, prefill in
        # depth + n_prompt, and the same target can leave the larger one a tail the smaller lacks
        meas = by_staging(rows, log, depth, n_p, n_g, per_cell, resident.decode_tps)
        res.results["points"].append(CurvePoint(
            **vars(meas.get(primary) or Staged()), vram_target=t, fraction=fraction_of.get(t), rc=p.rc,
            before=meas.get(BEFORE) if primary == AFTER else None))

    pts: list[CurvePoint] = res.results["points"]

    def zero_copy(x: CurvePoint) -> Staged:
        return x if primary == BEFORE else (x.before or Staged())

    samples = [(f"vt{x.vram_target}", zero_copy(x).effective_tail_gbps)
               for x in pts if (zero_copy(x).tail_read_mib_per_token or 0) > 0]
    res.results["link_probe"] = None
    if BEFORE not in stagings:
        samples = _link_probe(ctx, res, model, bench_base(0), depth, n_g, pts, span, tensors, per_cell,
                              resident.decode_tps)
    link = link_rate(samples, ctx.gpu)
    res.results["link"] = asdict(link)
    if not link.measured:
        res.notes.append(f"link rate: {link.source}")
    for x in pts:
        if x.tail_read_mib_per_token is not None:
            lim = limit_tps(resident.decode_tps, x.tail_read_mib_per_token, link.gbps)
            x.limit_decode_tps = None if lim is None else round(lim, 2)
            x.decode_over_limit = ratio(x.decode_tps, x.limit_decode_tps)
            ovl = overlap_tps(resident.decode_tps, x.tail_read_mib_per_token, link.gbps)
            x.overlap_decode_tps = None if ovl is None else round(ovl, 2)
        x.prefill_over_resident = ratio(x.prefill_tps, resident.prefill_tps)
        if x.before:
            x.before.prefill_over_resident = ratio(x.before.prefill_tps, resident.prefill_tps)

    good = [x for x in pts if x.decode_tps and x.host_tail_mib is not None]
    res.check("at least 4 window points measured", len(good) >= 4, f"{len(good)} points")
    res.check("points with a host tail > 0", any(x.host_tail_mib > 0 for x in good))
    if primary == AFTER:
        _checks(res, pts, th)
    else:
        res.notes.append("before curve (-kts off, zero-copy reads of the tail): the staging goals (prefill >= "
                         f"{th.prefill_vs_resident:.0%} of resident, decode >= {1 - th.curve_decode_tolerance:.0%} of "
                         "the link-rate line) are checks of -kts auto and were not run")
    png = plot(jsonable(res.results), ctx.work / "curve.png")
    if png:
        res.plots.append(png)
    else:
        res.notes.append("matplotlib not available: no PNG")
    return res


def _link_probe(ctx: GateContext, res: GateResult, model: str, base: list[str], depth: int, n_g: int,
                pts: list[CurvePoint], span: float, tensors: int, per_cell: float | None,
                resident_tps: float | None) -> list[tuple[str, float | None]]:
    """The link rate of a curve without before points (--curve-staging auto): a decode-only (-p 0) run
    with -kts off, whose zero-copy reads cross the link once per token. Its target is sized for off's
    own reserve (a -kts off -vt 1 probe: off holds no staged copies, so at auto's targets it keeps
    more cells, at -c 524288 every used one) at the fraction of the point with the smallest decode
    tail of at least PROBE_TAIL_MIN of the cells a token reads (else the largest tail): the time the
    tail adds to a token is then well above the noise, and the zero-copy depth fill stays short. Fills
    results['link_probe']; a run without a tail gives no sample (the nominal rate then stands in,
    labelled)."""
    tailed = [x for x in pts if x.fraction and (x.tail_read_mib_per_token or 0) > 0]
    if not tailed or not per_cell:
        res.notes.append("link probe: no point of a --curve-fractions fraction has a decode tail, so none ran")
        return []
    # the share of the cells a token reads that lie in the tail (with -c the window's own share counts
    # the unused cells too)
    enough = [x for x in tailed if x.tail_read_mib_per_token / (per_cell * (depth + n_g)) >= PROBE_TAIL_MIN]
    f = max(x.fraction for x in enough) if enough else min(x.fraction for x in tailed)
    fixed = bench_fixed(ctx, res, model, [*base, *kts_args([BEFORE])], "link-probe-vt1-probe", ["CUDA0"])["CUDA0"]
    t = sizing.vram_target(fixed, f * span, tensors)
    p, rows, log = run_bench(ctx, res, f"link-probe-vt{t}", model,
                             [*base, "-krm", "window", "-vt", str(t), *kts_args([BEFORE])])
    off = by_staging(rows, log, depth, 0, n_g, per_cell, resident_tps).get(BEFORE) or Staged()
    if not res.check("link probe (decode only, -kts off) runs", p.rc == 0 and bool(off.decode_tps),
                     f"rc={p.rc}, --vram-target {t} (fraction {f:g} for -kts off's own reserve)"):
        return []
    res.results["link_probe"] = CurveLinkProbe(**vars(off), vram_target=t, fraction=f, fixed_mib=fixed.mib)
    gbps = off.effective_tail_gbps
    if not gbps:
        res.notes.append(f"link probe at --vram-target {t}: no tail among its cells, so it measured no link rate")
    return [(f"link probe vt{t}", gbps)]


def _checks(res: GateResult, pts: list[CurvePoint], th: Thresholds) -> None:
    """The staging goals at every windowed point (auto = after)."""
    pre = [x for x in pts if (x.prefill_host_tail_mib or 0) > 0
           and x.prefill_tail_fraction is not None and x.prefill_tail_fraction <= CURVE_PREFILL_TAIL_MAX]
    low = [f"vt{x.vram_target}: {x.prefill_over_resident} (tail {100 * x.prefill_tail_fraction:.0f} %)"
           for x in pre if (x.prefill_over_resident or 0) < th.prefill_vs_resident]
    res.check(f"prefill (auto) >= {th.prefill_vs_resident:.0%} of resident at every windowed point with a "
              f"prefill tail <= {CURVE_PREFILL_TAIL_MAX:.0%}", bool(pre) and not low,
              f"{len(pre)} points; below: {'; '.join(low) or 'none'}" if pre else "no such point measured")
    dec = [x for x in pts if (x.tail_read_mib_per_token or 0) > 0]
    off = [f"vt{x.vram_target}: {x.decode_over_limit}" for x in dec
           if (x.decode_over_limit or 0) < 1 - th.curve_decode_tolerance]
    res.check(f"decode (auto) >= {1 - th.curve_decode_tolerance:.0%} of the link-rate line at every windowed point",
              bool(dec) and not off,
              f"{len(dec)} points; outside: {'; '.join(off) or 'none'}" if dec else "no windowed point measured")


def markdown(results: dict[str, Any]) -> list[str]:
    """The curve report's table (from the report's JSON): per point, after (auto) and before (off) decode
    and prefill."""
    pts = [CurvePoint.from_json(p) for p in results.get("points") or []]
    if not pts:
        return []
    link = results.get("link") or {}
    a = "after" if results.get("primary_staging", AFTER) == AFTER else "before"
    out = [f"- link rate {link.get('gbps')} GB/s: {link.get('source')}",
           f"- {results.get('tps_statistic') or TPS_STATISTIC}",
           "- before = `-kts off` (zero-copy reads of the host tail), after = `-kts auto` (staged, the next "
           "layer's copy made while this one computes); the tail a token reads and the pp tail % are of each "
           "test's own cells (after / before: the two contexts can hold different windows)",
           *([] if a == "after" else ["- this run is the before curve alone (`--curve-staging off`): its targets "
                                      "are sized for off's own compute reserve"]), "",
           f"| vram target | tail MiB/token {a} / before | decode {a} | decode before | link-line t/s | "
           f"{a} / line | overlap-line t/s | pp tail % {a} / before | prefill {a} | prefill before | "
           f"{a} / resident |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in pts:
        b = p.before or Staged()
        out.append(f"| {p.vram_target} | {fmt(p.tail_read_mib_per_token)} / {fmt(b.tail_read_mib_per_token)} | "
                   f"{fmt(p.decode_tps)} | {fmt(b.decode_tps)} | {fmt(p.limit_decode_tps)} | "
                   f"{fmt(p.decode_over_limit, '.3f')} | {fmt(p.overlap_decode_tps)} | "
                   f"{pct(p.prefill_tail_fraction)} / {pct(b.prefill_tail_fraction)} | "
                   f"{fmt(p.prefill_tps)} | {fmt(b.prefill_tps)} | {fmt(p.prefill_over_resident, '.3f')} |")
    return out


def plot(results: dict[str, Any], path: Any) -> str | None:
    """The curve's PNG from the report's JSON: decode against the tail a token reads (with the link-rate and
    overlap lines), prefill against the prefill test's tail; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    link = results.get("link") or {}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))

    def prefill_tail_pct(x: Staged) -> float | None:
        return None if x.prefill_tail_fraction is None else 100 * x.prefill_tail_fraction

    def series(ax: Any, pts: list[Any], tail: Any, tps: Any, style: str, label: str) -> None:
        xy = sorted((tail(x), tps(x)) for x in pts if tail(x) is not None and tps(x))
        if xy:
            ax.plot([a for a, _ in xy], [b for _, b in xy], style, label=label)

    pts = [CurvePoint.from_json(p) for p in results["points"]]
    before = [x.before for x in pts if x.before]
    # x: the tail a decode token reads (MiB), the prefill context's tail (% of its cells): of the cells the tests
    # use, not of the pinned KV (with --curve-ctx most of it is never read)
    decode = (lambda x: x.tail_read_mib_per_token, lambda x: x.decode_tps)
    prefill = (prefill_tail_pct, lambda x: x.prefill_tps)
    for ax, (tail, tps) in ((a1, decode), (a2, prefill)):
        series(ax, pts, tail, tps, *PLOT_STYLE[results.get("primary_staging", AFTER)])
        series(ax, before, tail, tps, *PLOT_STYLE[BEFORE])
    how = f"{link.get('gbps', '?')} GB/s, {'measured' if link.get('measured') else 'assumed'}"
    series(a1, pts, decode[0], lambda x: x.limit_decode_tps, ":", f"link-rate line, zero-copy ({how})")
    series(a1, pts, decode[0], lambda x: x.overlap_decode_tps, "-.", f"overlap line, prefetch ({how})")
    res_ = results.get("resident") or {}
    nk = results.get("nkvo") or {}
    ub = f", ubatch {results['n_ubatch']}" if results.get("n_ubatch") else ""
    for ax, key, name, n in ((a1, "decode_tps", "decode", f"tg{results['n_gen']}"),
                             (a2, "prefill_tps", "prefill", f"pp{results['n_prompt']}")):
        for ref, color, label in ((res_, "green", "resident"), (nk, "red", "-nkvo")):
            if ref.get(key):
                ax.axhline(ref[key], color=color, lw=0.8, label=label)
        if key == "prefill_tps" and res_.get(key):
            th = (results.get("thresholds") or {}).get("prefill_vs_resident")
            if th:
                ax.axhline(th * res_[key], color="green", lw=0.8, ls="--", label=f"{th:.0%} of resident (goal)")
        ax.set_xlabel("host tail a token reads (MiB)" if key == "decode_tps" else "host tail of the prefill test's cells (%)")
        ax.set_ylabel(f"{name} t/s")
        ax.set_title(f"{name} {n} @ depth {results['depth']}{ub}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


GATE = Gate(name=NAME, order=50, run=run, options=Options, report_rows=markdown, binaries=BINARIES)
