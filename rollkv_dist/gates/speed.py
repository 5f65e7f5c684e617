"""speed: llama-bench at depths 0, 16384, 65536 for resident, window (tail >= 50%) and -nkvo.

Effective tail bandwidth = tail bytes read per token / (window per-token time - resident
per-token time); decode ratio = window t/s / -nkvo t/s (the gap this project closes).
"""

from __future__ import annotations

from typing import Any

from . import logparse
from .common import (GateContext, GateResult, MiB, ensure_random_model, pick, preflight, run_bench,
                     search_vram_target, target_estimate, window_outcome)
from .curve import tail_read_mib

NAME = "speed"
BINARIES = ("llama-bench",)
GRANULE_MIB = 2  # CUDA VMM granularity of the window's segments (ENGINE.md)
TAIL_LO, TAIL_HI = 0.5, 0.65  # host-tail share of the decode context's cells for the window run


def tail_bandwidth_gbps(tail_read_mib_: float, window_tps: float, resident_tps: float) -> float | None:
    dt = 1.0 / window_tps - 1.0 / resident_tps
    if tail_read_mib_ <= 0 or dt <= 0:
        return None
    return tail_read_mib_ * MiB / dt / 1e9


def run(ctx: GateContext, res: GateResult) -> GateResult:
    if not preflight(ctx, res, ctx.bin("llama-bench"), ("--kv-residency-mode", "--vram-target")):
        return res
    model = str(ctx.opt("model") or ensure_random_model(ctx, ctx.opt("speed_shape", "qwen2-1.5b"), "q8_0"))
    depths = [int(x) for x in str(ctx.opt("speed_depths", "0,16384,65536")).split(",")]
    n_p, n_g = 512, 64
    res.results.update({"model": model, "rows": []})
    for d in depths:
        base = ["-fa", "on", "-ngl", "99", "-d", str(d), "-p", str(n_p), "-n", str(n_g), "-r", str(ctx.opt("reps", 3))]
        row: dict[str, Any] = {"depth": d}
        res.results["rows"].append(row)
        p, rows, log = run_bench(ctx, res, f"resident-d{d}", model, [*base, "-krm", "resident"])
        tg, pp = pick(rows, "tg"), pick(rows, "pp")
        if not res.check(f"d{d}: resident bench runs", tg is not None and pp is not None, f"rc={p.rc}"):
            continue
        row["resident"] = {"decode_tps": tg.avg_ts, "prefill_tps": pp.avg_ts}
        kv = log.require_mib("kv-largest-cache")
        layers = log.kv_caches[0][2] if log.kv_caches else 0
        per_tensor_mib = kv / (2 * layers) if layers else None
        row["kv_mib"], row["kv_mib_per_tensor"] = kv, per_tensor_mib
        row["kv_mib_per_cell"] = log.kv_mib_per_cell
        if per_tensor_mib is not None and per_tensor_mib < 2 * GRANULE_MIB:
            # a device segment is at least one 2 MiB granule per K/V tensor: no tail is possible
            res.notes.append(f"d{d}: window not applicable: {per_tensor_mib:.2f} MiB per K/V tensor is below "
                             f"two {GRANULE_MIB} MiB granules, so the whole KV stays on the device")
            row["window"] = None
        else:
            _window(ctx, res, row, model, base, d, n_g, kv, log, tg)
        p, rows, _ = run_bench(ctx, res, f"nkvo-d{d}", model, [*base, "-nkvo", "1"])
        ntg, npp = pick(rows, "tg"), pick(rows, "pp")
        if res.check(f"d{d}: -nkvo bench runs", ntg is not None, f"rc={p.rc}"):
            row["nkvo"] = {"decode_tps": ntg.avg_ts, "prefill_tps": npp.avg_ts if npp else None}
            if (row.get("window") or {}).get("decode_tps"):
                row["decode_ratio_window_over_nkvo"] = round(row["window"]["decode_tps"] / ntg.avg_ts, 2)
    return res


def _window(ctx: GateContext, res: GateResult, row: dict[str, Any], model: str, base: list[str], d: int,
            n_g: int, kv: float, log: logparse.LlamaLog, tg: Any) -> None:
    """Window run at depth d with 50-65 % of the decode context's cells in the host tail; fills
    row['window']."""
    mid = (TAIL_LO + TAIL_HI) / 2
    est = target_estimate(log, kv, 1 - mid)
    found: dict[str, Any] = {}

    def attempt(t: int) -> tuple[bool, logparse.Window | None, int | None]:
        p2, rows2, log2 = run_bench(ctx, res, f"window-d{d}-vt{t}", model, [*base, "-krm", "window", "-vt", str(t)])
        found["rows"] = rows2
        # decode runs in the depth + n_gen context
        return window_outcome(log2, p2.rc == 0 and bool(rows2), kv, mid, n_cells=d + n_g)

    t, w = search_vram_target(attempt, est, kv, lo=TAIL_LO, hi=TAIL_HI, tries=6)
    wtg, wpp = pick(found.get("rows", []), "tg"), pick(found.get("rows", []), "pp")
    if not res.check(f"d{d}: window bench with a host tail of {TAIL_LO:.0%}-{TAIL_HI:.0%} of the cells",
                     t is not None and wtg is not None,
                     f"window={None if w is None else w.__dict__}"):
        return
    wd = dict(w.__dict__)
    row["window"] = {"vram_target": t, "window": wd, "tail_fraction": round(w.tail_fraction, 4),
                     "decode_tps": wtg.avg_ts, "prefill_tps": wpp.avg_ts if wpp else None}
    if not res.check(f"d{d}: KV bytes per cell logged (llama_kv_cache: size)", bool(row["kv_mib_per_cell"])):
        return
    read = tail_read_mib(wd, d, n_g, row["kv_mib_per_cell"])
    row["tail_read_mib_per_token"] = round(read, 2)
    bw = tail_bandwidth_gbps(read, wtg.avg_ts, tg.avg_ts)
    row["effective_tail_gbps"] = None if bw is None else round(bw, 1)


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| depth | resident tg t/s | window tg t/s | -nkvo tg t/s | window/-nkvo | tail % | tail read MiB/tok | "
           "eff. tail GB/s | resident pp | window pp | -nkvo pp |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def g(r: dict[str, Any], k: str, f: str) -> str:
        v = (r.get(k) or {}).get(f)
        return "-" if v is None else f"{v:,.1f}"

    for r in rows:
        tf = (r.get("window") or {}).get("tail_fraction")
        out.append(f"| {r['depth']} | {g(r, 'resident', 'decode_tps')} | {g(r, 'window', 'decode_tps')} | "
                   f"{g(r, 'nkvo', 'decode_tps')} | {r.get('decode_ratio_window_over_nkvo', '-')} | "
                   f"{'-' if tf is None else f'{100 * tf:.0f}'} | {r.get('tail_read_mib_per_token', '-')} | "
                   f"{r.get('effective_tail_gbps') or '-'} | {g(r, 'resident', 'prefill_tps')} | "
                   f"{g(r, 'window', 'prefill_tps')} | {g(r, 'nkvo', 'prefill_tps')} |")
    return "\n".join(out)
