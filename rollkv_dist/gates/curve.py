"""curve: decode/prefill speed against the host-tail size at a fixed context and depth.

One llama-bench run per point (`-krm window -vt X -v -o json`), sweeping --vram-target down from
"everything resident"; each point records (host tail MiB from the window line, decode t/s,
prefill t/s). Plotted against the PCIe limit: decode time per token = resident time + tail bytes
read per token / 51 GB/s (the measured zero-copy read rate of the host segment on the H200).
"""

from __future__ import annotations

from typing import Any

from .common import (PCIE_TAIL_GBPS, GateContext, GateResult, MiB, ensure_random_model, pick, preflight,
                     run_bench)

NAME = "curve"
BINARIES = ("llama-bench",)
FRACTIONS = (1.0, 0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)


def limit_tps(resident_tps: float, tail_read_mib: float, gbps: float = PCIE_TAIL_GBPS) -> float:
    """Decode t/s at the PCIe limit: 1 / (1/resident + tail bytes / bandwidth)."""
    return 1.0 / (1.0 / resident_tps + tail_read_mib * MiB / (gbps * 1e9))


def tail_read_mib(window: dict[str, Any], depth: int, n_gen: int, mib_per_cell: float) -> float:
    """Tail MiB a decoded token reads on average: the used cells beyond C times the exact KV bytes
    per cell (from the `llama_kv_cache: size` line; the window line's MiB are rounded up to 2 MiB
    granules per tensor). Cells past the depth are empty and the attention kernels skip them."""
    used = max(0, min(window["kv_size"], depth + n_gen // 2) - window["cells_resident"])
    return used * mib_per_cell


def engine_fixed_mib(ctx: GateContext, res: GateResult, model: str, base: list[str]) -> float | None:
    """The device MiB the sizer keeps before any KV cell (model + measured compute reserve + margin),
    as the engine itself logs it when a 1 MiB --vram-target leaves no room for a window; the
    curve's targets are this plus a fraction of the KV, so they span fully resident to all-host."""
    _, _, log = run_bench(ctx, res, "window-vt1-probe", model, [*base, "-krm", "window", "-vt", "1"])
    nw = log.no_window
    return None if nw is None else float(nw["model"] + nw["compute_reserve"] + nw["margin"])


def run(ctx: GateContext, res: GateResult) -> GateResult:
    if not preflight(ctx, res, ctx.bin("llama-bench"), ("--kv-residency-mode", "--vram-target")):
        return res
    model = str(ctx.opt("model") or ensure_random_model(ctx, ctx.opt("curve_shape", "qwen2-1.5b"), "q8_0"))
    depth = int(ctx.opt("curve_depth", 16384))
    n_p, n_g = 512, 64
    base = ["-fa", "on", "-ngl", "99", "-d", str(depth), "-p", str(n_p), "-n", str(n_g), "-r",
            str(ctx.opt("reps", 3))]
    res.results.update({"model": model, "depth": depth, "n_prompt": n_p, "n_gen": n_g, "points": []})

    p, rows, log = run_bench(ctx, res, "resident", model, [*base, "-krm", "resident"])
    tg, pp = pick(rows, "tg"), pick(rows, "pp")
    if not res.check("resident bench runs", p.rc == 0 and tg is not None and pp is not None, f"rc={p.rc}"):
        return res
    kv, per_cell = log.require_mib("kv-largest-cache"), log.kv_mib_per_cell
    fixed = engine_fixed_mib(ctx, res, model, base)
    if fixed is None:  # the engine did not say: resident buffers + the sizer's safety and margin (256 each)
        fixed = log.require_mib("model") + log.require_mib("compute") + 512
    res.results["fixed_mib"] = fixed
    res.results["resident"] = {"decode_tps": tg.avg_ts, "prefill_tps": pp.avg_ts, "kv_mib": kv,
                               "kv_mib_per_cell": per_cell,
                               "model_mib": log.model_buffers.get("CUDA0"), "compute_mib": log.compute_mib("CUDA0")}
    p, rows, _ = run_bench(ctx, res, "nkvo", model, [*base, "-nkvo", "1"])
    ntg, npp = pick(rows, "tg"), pick(rows, "pp")
    res.results["nkvo"] = None if ntg is None else {"decode_tps": ntg.avg_ts, "prefill_tps": npp and npp.avg_ts}

    targets = [int(fixed + f * kv) for f in FRACTIONS]
    targets += [int(x) for x in str(ctx.opt("curve_targets", "")).split(",") if x.strip()]
    for t in sorted(set(targets), reverse=True):
        p, rows, log = run_bench(ctx, res, f"window-vt{t}", model, [*base, "-krm", "window", "-vt", str(t)])
        # llama-bench makes one context per test: decode runs in depth + n_gen cells, prefill in
        # depth + n_prompt, and the same target can leave the larger one a tail the smaller lacks
        w, wp = log.window_for(depth + n_g), log.window_for(depth + n_p)
        tg, pp = pick(rows, "tg"), pick(rows, "pp")
        pt: dict[str, Any] = {"vram_target": t, "rc": p.rc,
                              "window": None if w is None else dict(w.__dict__),
                              "host_tail_mib": None if w is None else w.host_tail_mib,
                              "prefill_window": None if wp is None else dict(wp.__dict__),
                              "prefill_host_tail_mib": None if wp is None else wp.host_tail_mib,
                              "decode_tps": None if tg is None else tg.avg_ts,
                              "prefill_tps": None if pp is None else pp.avg_ts}
        if w is not None and per_cell:
            pt["tail_read_mib_per_token"] = round(tail_read_mib(pt["window"], depth, n_g, per_cell), 2)
            pt["limit_decode_tps"] = round(limit_tps(res.results["resident"]["decode_tps"],
                                                     pt["tail_read_mib_per_token"]), 2)
        res.results["points"].append(pt)
    good = [x for x in res.results["points"] if x["decode_tps"] and x["host_tail_mib"] is not None]
    res.check("at least 4 window points measured", len(good) >= 4, f"{len(good)} points")
    res.check("points with a host tail > 0", any(x["host_tail_mib"] > 0 for x in good))
    png = plot(res.results, ctx.work / "curve.png")
    if png:
        res.plots.append(png)
    else:
        res.notes.append("matplotlib not available: no PNG")
    return res


def plot(results: dict[str, Any], path: Any) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pts = sorted((x for x in results["points"] if x.get("decode_tps") and x.get("host_tail_mib") is not None),
                 key=lambda x: x["host_tail_mib"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [x["host_tail_mib"] for x in pts]
    a1.plot(xs, [x["decode_tps"] for x in pts], "o-", label="window (measured)")
    lim = [(x["host_tail_mib"], x["limit_decode_tps"]) for x in pts if x.get("limit_decode_tps")]
    if lim:
        a1.plot([a for a, _ in lim], [b for _, b in lim], "--", label=f"PCIe limit ({PCIE_TAIL_GBPS:g} GB/s)")
    # prefill against its own context's tail (JSON from before that was recorded: the decode one's)
    pre = [(x.get("prefill_host_tail_mib", x["host_tail_mib"]), x["prefill_tps"]) for x in pts
           if x.get("prefill_tps")]
    pre = sorted(p for p in pre if p[0] is not None)
    a2.plot([a for a, _ in pre], [b for _, b in pre], "o-", color="purple", label="window (measured)")
    res_ = results.get("resident") or {}
    nk = results.get("nkvo") or {}
    for ax, key, name, n in ((a1, "decode_tps", "decode", f"tg{results['n_gen']}"),
                             (a2, "prefill_tps", "prefill", f"pp{results['n_prompt']}")):
        for ref, color, label in ((res_, "green", "resident"), (nk, "red", "-nkvo")):
            if ref.get(key):
                ax.axhline(ref[key], color=color, lw=0.8, label=label)
        ax.set_xlabel(f"host tail of the {name} test's context (MiB)")
        ax.set_ylabel(f"{name} t/s")
        ax.set_title(f"{name} {n} @ depth {results['depth']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
