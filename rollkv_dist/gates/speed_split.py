"""speed's all-GPU run: decode with a host tail on every GPU (one process, layer split).

Per depth (f16 K/V, `-kts off`: the tail read zero-copy, once per token, the reading whose rate is
the link's; auto stages f16 decode where the layers prefetch, patch 0007), llama-bench with every
GPU under test visible:
- resident: the decode t/s of the split model, and each device's share of the KV;
- window: one `-vt T` for every device (llama-bench takes one target per test), T searched so the
  decode context keeps 50-65 % of its cells in the host tail on every device; each device's window,
  reserve and tail are recorded; the tail bytes a token reads (per device: the used cells beyond its
  C times its layers' bytes per cell) over the extra time per token is the effective link rate of
  the GPUs together;
- each GPU alone (CUDA_VISIBLE_DEVICES = that GPU): resident, then window with the same total tail
  bytes as the GPUs together, which gives that GPU's own effective link rate and the one-GPU decode
  with the same total tail.

Checks: the runs run; every device holds a tail; each GPU alone reads the same total tail (to 10 %)
and its link rate is measured; decode with both tails reaches the decode goal (default 85 %) of
the bound the GPUs' own link rates give (a layer split runs the devices one after the other:
time per token = resident + the sum over devices of tail bytes / that device's rate). Whether the
links add up (each H200 has its own PCIe x16: together >= 90 % of the sum of the single rates) is
reported, not judged: a layer split reads one device's tail at a time.
"""

from __future__ import annotations

import statistics
from typing import Any

from rollkv_dist import gpu as gpu_mod
from rollkv_dist.gates import sizing
from rollkv_dist.gates.context import GateContext, GateResult, MiB
from rollkv_dist.gates.bench import bench_fixed, pick, run_bench
from rollkv_dist.gates.rows import AloneRun, SplitRow, SplitRun
from rollkv_dist.gates.sizing import search_vram_target, window_outcome
from rollkv_dist.gates.tail import BEFORE, Thresholds, fmt, kts_args, ratio, tail_bandwidth_gbps

TAIL_LO, TAIL_HI = 0.5, 0.65
N_GEN = 64
ADD_UP = 0.9  # the links add up when together they reach this share of the sum of the single rates
SAME_TAIL = 0.10  # a GPU alone reads the GPUs' total tail to this share


def run_split(ctx: GateContext, res: GateResult, model: str, depths: list[int], kv_types: list[str],
              th: Thresholds, reps: int) -> None:
    """The all-GPU speed run; fills res.results['split']."""
    out = SplitRun(gpus=[g.uuid for g in ctx.under_test], kv_type="f16", staging=BEFORE, n_gen=N_GEN,
                   add_up_share=ADD_UP)
    res.results["split"] = out
    if kv_types != ["f16"]:
        res.notes.append(f"all-GPU run: decode with f16 K/V only (its tail is read zero-copy, so the link rates are "
                         f"measured); --kv-types {','.join(kv_types)} applies to the per-GPU runs")
    for d in depths:
        row = SplitRow(depth=d)
        out.rows.append(row)
        _depth(ctx, res, row, model, d, th, reps)


def _depth(ctx: GateContext, res: GateResult, row: SplitRow, model: str, d: int, th: Thresholds,
           reps: int) -> None:
    tag = f"d{d} all GPUs"
    base = ["-fa", "on", "-ngl", "99", "-ctk", "f16", "-ctv", "f16", "-d", str(d), "-p", "0", "-n", str(N_GEN),
            "-r", str(reps)]
    p, rows, log = run_bench(ctx, res, f"split-resident-d{d}", model, [*base, "-krm", "resident"])
    tg = pick(rows, "tg")
    if not res.check(f"{tag}: resident bench runs (layer split)", tg is not None, f"rc={p.rc}"):
        return
    devs = sizing.devices_of(log)
    per_cell = log.kv_mib_per_cell or 0.0
    kv_total = sum(x.kv_mib for x in devs)
    pc = {x.device: per_cell * x.kv_mib / kv_total for x in devs}  # MiB per cell of each device's layers
    row.resident_tps, row.kv_mib = tg.median_ts, {x.device: x.kv_mib for x in devs}
    fixed = bench_fixed(ctx, res, model, [*base, *kts_args([BEFORE])], f"split-d{d}-vt1-probe",
                        [x.device for x in devs])
    # llama-bench gives every device the same target: search it in KV MiB kept per device
    base_mib = statistics.fmean(fixed[x.device].mib + x.n_tensors * sizing.GRANULE_MIB for x in devs)
    per_dev_kv = kv_total / len(devs)
    mid = (TAIL_LO + TAIL_HI) / 2
    found: dict[int, Any] = {}

    def attempt(t: int) -> tuple[bool, Any]:
        vt = max(1, int(base_mib + t))
        p2, rows2, log2 = run_bench(ctx, res, f"split-window-d{d}-vt{vt}", model,
                                    [*base, "-krm", "window", "-vt", str(vt), *kts_args([BEFORE])])
        found[t] = (vt, rows2, log2)
        return window_outcome(log2, p2.rc == 0 and bool(rows2), n_cells=d + N_GEN)

    t, _ = search_vram_target(attempt, (1 - mid) * per_dev_kv, per_dev_kv, lo=TAIL_LO, hi=TAIL_HI, tries=6)
    if t is None:
        res.check(f"{tag}: window bench with a host tail of {TAIL_LO:.0%}-{TAIL_HI:.0%} of the cells", False,
                  f"attempts: {[v[0] for v in found.values()]}")
        return
    vt, rows_t, log_t = found[t]
    wtg = pick(rows_t, "tg")
    recs = sizing.device_records(log_t, d + N_GEN)
    used = min(int(recs[0]["kv_size"]), d + N_GEN // 2) if recs else 0
    reads = {r["device"]: max(0, used - int(r["cells_resident"])) * pc[str(r["device"])] for r in recs}
    total = sum(reads.values())
    row.vram_target, row.window_tps, row.devices = vt, None if wtg is None else wtg.median_ts, recs
    row.tail_read_mib_per_token = {k: round(v, 2) for k, v in reads.items()}
    row.tail_read_total_mib = round(total, 2)
    if not res.check(f"{tag}: a host tail on every GPU ({len(devs)})",
                     wtg is not None and len(recs) == len(devs) and all(not r["fully_resident"] for r in recs),
                     "; ".join(f"{r['device']}: {r['cells_resident']} / {r['kv_size']}" for r in recs)):
        return
    agg = tail_bandwidth_gbps(total, wtg.median_ts, tg.median_ts)
    row.effective_gbps = None if agg is None else round(agg, 2)
    row.one_gpu = [_alone(ctx, res, model, base, d, i, g, total, used, reps) for i, g in enumerate(ctx.under_test)]
    rates = {f"CUDA{i}": one.effective_gbps for i, one in enumerate(row.one_gpu)}
    row.per_device_gbps = rates
    if all(rates.values()) and agg:
        s = sum(rates.values())
        row.sum_gbps, row.together_over_sum, row.links_add_up = round(s, 2), ratio(agg, s), agg >= ADD_UP * s
        bound = 1.0 / (1.0 / tg.median_ts + sum(reads[k] * MiB / (rates[k] * 1e9) for k in reads))
        row.bound_tps, row.window_over_bound = round(bound, 2), ratio(wtg.median_ts, bound)
        res.check(f"{tag}: decode with a tail on every GPU >= {th.decode_vs_link:.0%} of the bound of their own link "
                  f"rates", (row.window_over_bound or 0) >= th.decode_vs_link,
                  f"{wtg.median_ts:.2f} t/s vs {bound:.2f} t/s (resident {tg.median_ts:.1f} t/s; per token "
                  + ", ".join(f"{k} {reads[k]:.1f} MiB at {rates[k]} GB/s" for k in reads) + ")")
        res.notes.append(f"{tag}: the links {'add up' if row.links_add_up else 'do not add up'}: {agg:.1f} GB/s "
                         f"together against {s:.1f} GB/s for the GPUs one by one ({row.together_over_sum}); a layer "
                         "split reads one device's tail at a time")
    row.window_over_one_gpu = ratio(wtg.median_ts, row.one_gpu[0].window_tps)


def _alone(ctx: GateContext, res: GateResult, model: str, base: list[str], d: int, i: int,
           g: gpu_mod.GPUInfo, total_read: float, used: int, reps: int) -> AloneRun:
    """GPU g alone: resident, then window with the same total tail bytes; its effective link rate."""
    env = gpu_mod.child_env(g, ctx.env)
    tag = f"d{d} GPU {g.index} alone"
    out = AloneRun(gpu=g.uuid, index=g.index)
    p, rows, log = run_bench(ctx, res, f"gpu{g.index}-resident-d{d}", model, [*base, "-krm", "resident"], env=env)
    tg = pick(rows, "tg")
    if not res.check(f"{tag}: resident bench runs", tg is not None, f"rc={p.rc}"):
        return out
    per_cell = log.kv_mib_per_cell or 0.0
    tensors = sizing.devices_of(log)[0].n_tensors
    fixed = bench_fixed(ctx, res, model, [*base, *kts_args([BEFORE])], f"gpu{g.index}-d{d}-vt1-probe", ["CUDA0"],
                        env=env)["CUDA0"]
    keep = max(0.0, used * per_cell - total_read)  # the device part that leaves the same tail bytes
    vt = sizing.vram_target(fixed, keep, tensors)
    p, rows, log = run_bench(ctx, res, f"gpu{g.index}-window-d{d}-vt{vt}", model,
                             [*base, "-krm", "window", "-vt", str(vt), *kts_args([BEFORE])], env=env)
    wtg, w = pick(rows, "tg"), log.window_for(d + N_GEN)
    read = 0.0 if w is None else max(0, used - w.cells_resident) * per_cell
    bw = None if wtg is None else tail_bandwidth_gbps(read, wtg.median_ts, tg.median_ts)
    out.resident_tps, out.vram_target, out.window = tg.median_ts, vt, w
    out.window_tps = None if wtg is None else wtg.median_ts
    out.tail_read_mib_per_token, out.effective_gbps = round(read, 2), None if bw is None else round(bw, 2)
    res.check(f"{tag}: the same total tail as the GPUs together (to {SAME_TAIL:.0%})",
              wtg is not None and abs(read - total_read) <= SAME_TAIL * total_read,
              f"{read:.1f} MiB per token alone vs {total_read:.1f} MiB together")
    res.check(f"{tag}: its effective link rate is measured", bw is not None, f"window {out.window_tps} t/s")
    return out


def markdown(split: SplitRun) -> list[str]:
    """The all-GPU run's tables: per depth the decode with a tail on every GPU against each GPU alone,
    then each device's window, reserve and tail."""
    out = [f"All GPUs in one process (layer split), f16 K/V, -kts {split.staging}, tg{split.n_gen}; "
           "the same total tail on one GPU for comparison:", "",
           "| depth | resident t/s | tails on every GPU t/s | tail MiB/token | together GB/s | each GPU alone GB/s | "
           f"together / sum (add up >= {split.add_up_share:.0%}) | bound t/s | together / bound | "
           "one GPU, same tail t/s | together / one GPU |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in split.rows:
        one = r.one_gpu[0] if r.one_gpu else None
        each = " / ".join(fmt(v) for v in (r.per_device_gbps or {}).values())
        out.append(f"| {r.depth} | {fmt(r.resident_tps)} | {fmt(r.window_tps)} | "
                   f"{fmt(r.tail_read_total_mib)} | {fmt(r.effective_gbps)} | {each or '-'} | "
                   f"{fmt(r.together_over_sum, '.3f')} | {fmt(r.bound_tps)} | "
                   f"{fmt(r.window_over_bound, '.3f')} | {fmt(one and one.window_tps)} | "
                   f"{fmt(r.window_over_one_gpu, '.3f')} |")
    for r in split.rows:
        if r.devices:
            out += ["", f"depth {r.depth}, -vt {r.vram_target}:", "", *sizing.device_table(r.devices)]
    return out
