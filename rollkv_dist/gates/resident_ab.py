"""resident-ab: resident mode of the series build against an unpatched upstream build of the pin.

Window mode is opt-in; a user who never asks for it must get upstream's speed. Both builds run
the same llama-bench command (no rolling-KV flag at all: the default is resident) on the same
GPU, in rounds that alternate which build goes first, so clock and temperature drift falls on
both. Every round runs all depths with `-r reps`; the per-repetition samples of all rounds are
pooled per build and test.

A test is within noise when |mean(series) - mean(upstream)| <= max(2 * sigma_diff, tol * upstream)
with sigma_diff = sqrt(s_a^2 / n_a + s_b^2 / n_b) (about a 95 % interval of the difference) and
tol the build-to-build floor (default 2 %): code layout alone moves a build by a percent or so,
and so does GPU clock drift between rounds (the H200 runs of 2026-11-29 saw the same test at
-1.75 % and +2.15 % in two runs), so a gap that small is not a regression the gate should call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollkv_dist.gates.base import UPSTREAM_BUILD, Gate, option
from rollkv_dist.gates.bench import SpeedModelOptions, run_bench
from rollkv_dist.gates.context import (GateContext, GateResult, ensure_random_model, has_flags, preflight, read_build_info)
from rollkv_dist.gates.rows import AbRow, Pooled

NAME = "resident-ab"
BINARIES = ("llama-bench",)  # of --build (and of --upstream-build when given)
ENGINE_FLAGS = ("--kv-residency-mode", "--vram-target")
AB_DEPTHS = "0,16384,65536"
AB_ROUNDS = 2
AB_TOLERANCE_PCT = 2.0


def compare(test: str, depth: int, a: list[float], b: list[float], tol_pct: float) -> AbRow:
    """Series samples a against upstream samples b of one test and depth: difference, its noise band and the
    verdict."""
    pa, pb = Pooled.of(a), Pooled.of(b)
    diff = pa.mean - pb.mean
    sigma = (pa.stdev ** 2 / pa.n + pb.stdev ** 2 / pb.n) ** 0.5
    band = max(2 * sigma, tol_pct / 100 * pb.mean)
    return AbRow(test=test, depth=depth, series=pa, upstream=pb, diff_tps=diff, diff_pct=100 * diff / pb.mean,
                 noise_band_tps=band, sigma_diff_tps=sigma, within_noise=abs(diff) <= band)


@dataclass(frozen=True)
class Options(SpeedModelOptions):
    ab_depths: str = option("depths (comma list)", AB_DEPTHS)
    ab_rounds: int = option("rounds, alternating which build runs first", AB_ROUNDS)
    ab_tolerance_pct: float = option("build-to-build floor of the noise band (%)", AB_TOLERANCE_PCT,
                                     flag="--ab-tolerance", metavar="PCT")


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    upstream = ctx.upstream_build
    if upstream is None:
        res.verdict = "skip"
        res.notes.append("no upstream build: pass --upstream-build PREFIX (`rollkv source DIR --without` every "
                         "patch of the series, then `rollkv build`; `nox -s gpu_gates` does this itself)")
        return res
    series_bench, upstream_bench = ctx.bin("llama-bench"), ctx.bin("llama-bench", upstream)
    if not preflight(ctx, res, series_bench, ENGINE_FLAGS):
        return res
    has_engine, _ = has_flags(upstream_bench, ENGINE_FLAGS, ctx.child_env())
    if not res.check("upstream llama-bench has no rolling-KV flags (an unpatched build)", not has_engine,
                     f"{upstream_bench} --help lists {' '.join(ENGINE_FLAGS)}"):
        return res
    up_info = read_build_info(upstream)
    if up_info is not None and not res.check("upstream build applied no patch", not up_info.get("series"),
                                             f"series: {up_info.get('series')}"):
        return res
    model = str(o.model or ensure_random_model(ctx, o.speed_shape, "q8_0"))
    depths, rounds, tol = o.ab_depths, o.ab_rounds, o.ab_tolerance_pct
    args = ["-fa", "on", "-ngl", "99", "-d", depths, "-p", "512", "-n", "64", "-r", str(o.reps)]
    res.results.update({"model": model, "depths": depths, "rounds": rounds, "tolerance_pct": tol,
                        "upstream_build": str(upstream), "upstream_build_info": up_info, "args": args,
                        "rows": []})
    samples: dict[tuple[str, str, int], list[float]] = {}
    builds = {"series": ctx.build, "upstream": upstream}
    for r in range(rounds):
        order = ("series", "upstream") if r % 2 == 0 else ("upstream", "series")
        for name in order:
            p, rows, _ = run_bench(ctx, res, f"{name}-round{r}", model, args, build=builds[name])
            if not res.check(f"round {r}: {name} llama-bench runs", p.rc == 0 and bool(rows), f"rc={p.rc}"):
                return res
            for row in rows:
                samples.setdefault((name, row.kind, row.n_depth), []).extend(row.samples_ts or [row.avg_ts])
    for kind, depth in sorted({(k, d) for _, k, d in samples}, key=lambda x: (x[1], x[0])):
        a, b = samples.get(("series", kind, depth)), samples.get(("upstream", kind, depth))
        if not res.check(f"{kind} @ d{depth}: both builds measured", bool(a and b)):
            continue
        c = compare(kind, depth, a, b, tol)
        res.results["rows"].append(c)
        res.check(f"{kind} @ d{depth}: series within noise of upstream", c.within_noise,
                  f"{c.series.mean:.1f} vs {c.upstream.mean:.1f} t/s ({c.diff_pct:+.2f} %, "
                  f"band {c.noise_band_tps:.1f} t/s)")
    return res


def table(rows: list[AbRow]) -> str:
    out = ["| test | depth | series t/s (n, sd) | upstream t/s (n, sd) | diff | noise band | within noise |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r.series, r.upstream
        out.append(f"| {r.test} | {r.depth} | {a.mean:,.1f} ({a.n}, {a.stdev:.1f}) | "
                   f"{b.mean:,.1f} ({b.n}, {b.stdev:.1f}) | {r.diff_pct:+.2f} % | "
                   f"{r.noise_band_tps:.1f} t/s | {'yes' if r.within_noise else 'NO'} |")
    return "\n".join(out)


def report_rows(r: dict[str, Any]) -> list[str]:
    """The report's table (from its JSON)."""
    if not r.get("rows"):
        return []
    return [f"- upstream build: `{r.get('upstream_build')}`; llama-bench {' '.join(r.get('args') or [])}, "
            f"{r.get('rounds')} rounds", "", table([AbRow.from_json(x) for x in r["rows"]])]


GATE = Gate(name=NAME, order=70, run=run, options=Options, report_rows=report_rows, binaries=BINARIES,
            needs=(UPSTREAM_BUILD,))
