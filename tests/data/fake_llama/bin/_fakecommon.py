"""Shared bits of the fake llama.cpp binaries used by the gate tests (no GPU, no model).

Sizes (MiB) are chosen per tool; the window sizer mimics the engine: C = (target - model -
compute - 256 - margin) / MiB per cell, capped at n_ctx; the log lines use the formats of
the pinned tree and docs/ENGINE-INTERFACE.md.
"""
import math
import os
import sys


HELP = ("usage: fake\n  -krm, --kv-residency-mode {resident,window}\n  --vram-target MiB\n"
        "  --kv-compute-reserve MiB\n  -kts, --kv-tail-staging {auto,on,off}\n  --logits-out PREFIX\n"
        "  --kv-shift N\n  --state-roundtrip\n")


def help_and_exit(argv):
    if "--help" in argv or "-h" in argv:
        if os.environ.get("FAKE_NO_ENGINE_FLAGS"):
            print("usage: fake (upstream, no rolling KV)")
        else:
            print(HELP)
        sys.exit(0)


def opt(argv, *names, default=None):
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            return argv[i + 1]
    return default


def window_lines(argv, n_ctx, model_mib, compute_mib, mib_per_cell, margin=64.0, layers=28, granule_mib=None,
                 load_model=True, mode=None, vram_target=None, kv_type="f16", staging=None):
    """Log lines of one context; with granule_mib, C is a whole number of granules per K/V tensor and
    the window line's MiB are rounded up to granules per tensor, as the engine's VMM segments are.
    mode, vram_target: this context's (default: from argv); staging: log the tail staging line."""
    out = []
    tensors = 2 * layers
    row = mib_per_cell / tensors  # MiB per cell of one K/V tensor

    def seg_mib(cells):  # the segments of all tensors holding `cells` cells, each rounded up to granules
        if not granule_mib:
            return cells * mib_per_cell
        return tensors * granule_mib * math.ceil(cells * row / granule_mib)

    mode = mode or opt(argv, "-krm", "--kv-residency-mode", default="resident")
    kv_mib = n_ctx * mib_per_cell
    if load_model:
        out.append("load_tensors: %12s model buffer size = %8.2f MiB" % ("CUDA0", model_mib))
        out.append("load_tensors: offloaded %d/%d layers to GPU" % (layers + 1, layers + 1))
    out.append("llama_context: n_ctx                 = %u" % n_ctx)
    fixed = opt(argv, "--kv-compute-reserve")
    two_pass = False
    if mode == "window" and os.environ.get("FAKE_WINDOW_REFUSED"):
        out.append("llama_init_from_model: --kv-residency-mode window needs a GPU backend, but this build or model "
                   "has no GPU device (use a CUDA build, or --kv-residency-mode resident)")
        return out, None
    if mode == "window":
        vt = float(vram_target if vram_target is not None else opt(argv, "--vram-target", "-vt", default="0") or 0)
        if staging:
            out.append("llama_context: kv tail staging = %s" % staging)
        if fixed:
            out.append("llama_context: kv compute reserve: fixed %.2f MiB (--kv-compute-reserve)" % float(fixed))
        reserve = float(fixed) if fixed else compute_mib + 256
        budget = vt - model_mib - reserve - margin
        if not granule_mib:
            c = int(budget / mib_per_cell)
        elif budget >= kv_mib:
            c = n_ctx
        else:  # the engine's sizer: each tensor may lose a granule to rounding, C rounds up to whole granules
            usable = budget - tensors * granule_mib
            n = 0 if usable <= 0 else min(n_ctx - 1, int(usable / mib_per_cell))
            c = min(n_ctx, int(seg_mib(n) / tensors / row))
        if c >= n_ctx:
            if not fixed:
                out.append("llama_context: kv compute reserve: single pass (full KV fits the budget)")
            out.append("llama_kv_cache: position window = FULLY RESIDENT (%d cells, device %.2f MiB)" % (n_ctx, kv_mib))
        else:
            if budget < 0 or (c <= 0 and not granule_mib):
                out.append("llama_init_from_model: failed to initialize the context: window mode: no device memory "
                           "left for the KV window on CUDA0 (free 139000 MiB, vram target %d MiB, model %d MiB, "
                           "compute reserve %d MiB, margin %d MiB): raise --vram-target, free device memory or "
                           "offload fewer layers" % (vt, model_mib, reserve, margin))
                return out, None
            if not fixed:
                two_pass = True
                out.append("llama_context: kv compute reserve: pass 1 measured CUDA0 compute buffer = %.2f MiB (12.5 ms)" % compute_mib)
                out.append("llama_context: kv compute reserve: pass 2 sizes the window with reserve = %.2f MiB (measured %.2f + safety 256)" % (compute_mib + 256, compute_mib))
            out.append("llama_kv_cache: position window = %d / %d cells resident (device %.2f MiB, host tail %.2f MiB)"
                       % (c, n_ctx, seg_mib(c), seg_mib(n_ctx) - seg_mib(c) if granule_mib else seg_mib(n_ctx - c)))
    else:
        c = n_ctx
    out.append("llama_kv_cache: %10s KV buffer size = %8.2f MiB" % ("CUDA0", kv_mib))
    out.append("llama_kv_cache: size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB"
               % (kv_mib, n_ctx, layers, 1, 1, kv_type, kv_mib / 2, kv_type, kv_mib / 2))
    out.append("sched_reserve: %10s compute buffer size = %8.2f MiB" % ("CUDA0", compute_mib))
    if two_pass:
        out.append("llama_context: kv compute reserve: pass 2 done (40.0 ms)")
    return out, c


def log(lines):
    """Print log lines to stderr; the lines of FAKE_EXTRA_LOG are appended to the first batch a
    program logs (tests: lines the parser must reject or read per device)."""
    extra = os.environ.pop("FAKE_EXTRA_LOG", "")
    for ln in list(lines) + extra.splitlines():
        print(ln, file=sys.stderr, flush=True)
