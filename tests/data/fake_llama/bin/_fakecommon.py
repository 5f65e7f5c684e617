"""Shared bits of the fake llama.cpp binaries used by the gate tests (no GPU, no model).

Sizes (MiB) are chosen per tool; the window sizer mimics the engine: C = (target - model -
compute - 256 - margin) / MiB per cell, capped at n_ctx, per GPU of CUDA_VISIBLE_DEVICES (a layer
split); the rolling-KV lines are rendered from the patches' format strings (_formats.py), the
upstream lines use the formats of the pinned tree.
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _formats import render  # noqa: E402  (the patches' own log formats)


HELP = ("usage: fake\n  -krm, --kv-residency-mode {resident,window,auto}\n  --vram-target MiB\n"
        "  --kv-compute-reserve MiB\n  -kts, --kv-tail-staging {auto,on,off}\n  --logits-out PREFIX\n"
        "  --kv-shift N\n  --state-roundtrip\n  -c, --ctx-size N\n  --rpc SERVERS\n")


def version_and_exit(argv):
    """`--version` like common/build-info.cpp (stderr): the version and commit a real build has compiled
    in, here read from the record of the prefix the program was started from (FAKE_VERSION_COMMIT:
    another build's commit)."""
    if "--version" not in argv:
        return
    info = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "..", "share", "rollkv-llamafile",
                        "build-info.txt")
    rec = {}
    if os.path.isfile(info):
        rec = dict(ln.split("=", 1) for ln in open(info).read().splitlines() if "=" in ln)
    commit = os.environ.get("FAKE_VERSION_COMMIT") or rec.get("build_commit", "unknown")
    # common/build-info.cpp at the pin: llama.cpp's version, LLAMA_BUILD_NUMBER (0 in rollkv.cmake), commit
    print("version: 0.5.0-dev (build 0, commit %s)" % commit, file=sys.stderr)
    print("built with fake cc for x86_64-linux-gnu", file=sys.stderr)
    sys.exit(0)


def help_and_exit(argv):
    version_and_exit(argv)
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


def devices():
    """The fake's GPUs: one per entry of CUDA_VISIBLE_DEVICES (unset: one)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = len([v for v in vis.split(",") if v.strip()]) if vis else 1
    return [f"CUDA{i}" for i in range(max(1, n))]


def split_layers(layers, n):
    """Layers per device of a layer split: as even as it goes, the first devices take the rest."""
    return [layers // n + (1 if i < layers % n else 0) for i in range(n)]


# the memory kinds patch 0090 names (src/llama-model.cpp, llama_model::memory_kind_name)
PLAIN = "an attention KV cache"
HYBRID_IDX = "hybrid (an attention KV cache with an indexer cache, beside recurrent state)"
RECURRENT = "recurrent state only (no attention KV cache)"
DSV4 = "DeepSeek-V4's compressed KV cache"
NO_WINDOW_KIND = "a memory type without window support"


def residency_mode(argv):
    """-krm, else the build's default: resident, or FAKE_KRM_DEFAULT (the packaged builds' is auto)."""
    return opt(argv, "-krm", "--kv-residency-mode", default=os.environ.get("FAKE_KRM_DEFAULT", "resident"))


def model_json(argv):
    """The JSON of a fake fixture model given with -m (fake test-llama-archs); {} for any other file."""
    path = opt(argv, "-m", "--model")
    try:
        with open(path) as f:
            m = json.load(f)
        return m if isinstance(m, dict) else {}
    except (TypeError, OSError, ValueError, UnicodeDecodeError):
        return {}


def model_memory(argv):
    """The memory of the model given with -m: a fake fixture model names its own ("memory" of its JSON);
    any other file is a plain attention KV cache."""
    return model_json(argv).get("memory", PLAIN)


def takes_no_window(argv):
    """Whether no cache of the model's memory takes a window: recurrent state alone, or a fixture model whose
    JSON says "no_window" (an attention memory without one)."""
    return model_memory(argv) == RECURRENT or bool(model_json(argv).get("no_window"))


def free_mib():
    """The fake GPU's free memory: FAKE_FREE_MIB (default 139000), or while a test's stand-in ballast holds the
    rest, the MiB written in the file FAKE_FREE_FILE names."""
    path = os.environ.get("FAKE_FREE_FILE")
    if path and os.path.isfile(path):
        return float(open(path).read())
    return float(os.environ.get("FAKE_FREE_MIB", "139000"))


def window_lines(argv, n_ctx, model_mib, compute_mib, mib_per_cell, margin=64.0, layers=28, granule_mib=None,
                 load_model=True, mode=None, vram_target=None, kv_type="f16", staging=None, free=None, devs=None):
    """Log lines of one context, the rolling-KV lines rendered from the patches' own formats
    (_formats.py). Every GPU of devices() holds its layers' share of the model and the KV (a layer
    split) and sizes its own window against its --vram-target (one value for all, or one per
    device; another count is the engine's error) and FAKE_FREE_MIB of free memory (default 139000):
    budget = min(free, target - model) - reserve - margin, target 0 = free memory. With granule_mib,
    C is a whole number of granules per K/V tensor and the window line's MiB are rounded up to
    granules per tensor, as the engine's VMM segments are.

    Returns (lines, c, per_device): c = the cells of the first device's window (None when the
    context failed), per_device = [(device, C, layers)]. mode, vram_target: this context's (default:
    from argv); staging: log the tail staging line; devs: the devices (default: devices())."""
    out = []
    mode = mode or residency_mode(argv)
    memory = model_memory(argv)
    if mode == "auto" and os.environ.get("FAKE_WINDOW_REFUSED"):  # the engine: auto stays resident, says why
        out.append(render("residency_requirement", "llama_init_from_model", "there is no GPU device"))
        mode = "resident"
    elif mode in ("auto", "window") and takes_no_window(argv):  # patch 0090: the memory takes no window
        attn = memory != RECURRENT
        if mode == "window" and attn:
            out.append("llama_init_from_model: failed to initialize the context: --kv-residency-mode window: this "
                       f"model's memory is {memory}, and none of its caches took the window in this configuration (a "
                       "line above says why): use --kv-residency-mode auto (resident here) or resident")
            return out, None, None
        out.append(render("residency_resident", "kv_residency_resolve", mode, memory,
                          "which takes no window yet" if attn else "so there is nothing to window"))
        mode = "resident"
    elif mode == "auto":  # the engine: auto sizes a window, which is FULLY RESIDENT where the KV fits
        out.append(render("residency_window", "kv_residency_resolve", memory))
        mode = "window"
    # FAKE_FA_OFF_IGNORED=1: an engine that windows a transposed V as if it were by cells (no V line)
    fa_off = ((opt(argv, "-fa", "--flash-attn") == "off" or bool(model_json(argv).get("fa_forced_off")))
              and not os.environ.get("FAKE_FA_OFF_IGNORED"))
    devs = devs or devices()
    if mode == "window" and os.environ.get("FAKE_WINDOW_DEVICES"):  # the window's context spans more devices
        devs = [f"CUDA{i}" for i in range(int(os.environ["FAKE_WINDOW_DEVICES"]))]
    multi = len(devs) > 1
    lay = split_layers(layers, len(devs))
    kv_mib = n_ctx * mib_per_cell
    free_total = free_mib() if free is None else free
    if load_model:
        for d, ly in zip(devs, lay):
            out.append("load_tensors: %12s model buffer size = %8.2f MiB" % (d, model_mib * ly / layers))
        out.append("load_tensors: offloaded %d/%d layers to GPU" % (layers + 1, layers + 1))
    out.append("llama_context: n_ctx                 = %u" % n_ctx)
    fixed = opt(argv, "--kv-compute-reserve")
    per_device = [(d, n_ctx, ly) for d, ly in zip(devs, lay)]
    two_pass = False
    if mode == "window" and os.environ.get("FAKE_WINDOW_REFUSED"):
        out.append(render("refuse_gpu", "llama_init_from_model"))
        return out, None, None
    if mode == "window":
        spec = str(vram_target) if vram_target is not None else opt(argv, "--vram-target", "-vt", default="0") or "0"
        targets = [float(x) for x in spec.split(",")]
        if len(targets) not in (1, len(devs)):
            out.append(render("vram_target_count", "llama_init_from_model", len(targets), len(devs), ", ".join(devs)))
            out.append("llama_init_from_model: failed to initialize the context")
            return out, None, None
        targets = targets * len(devs) if len(targets) == 1 else targets
        if staging:
            out.append(render("staging", "llama_context", staging))
        if fixed:
            out.append(render("fixed_reserve", "llama_context", float(fixed)))
        reserves = [float(fixed) if fixed else compute_mib + 256 for _ in devs]

        def budget(i):
            model_d = model_mib * lay[i] / layers
            free = free_total - model_d
            b = free - reserves[i] - margin
            if targets[i] > 0:
                b = min(b, targets[i] - model_d - reserves[i] - margin)
            return b, free, model_d

        fits = [budget(i)[0] >= kv_mib * lay[i] / layers for i in range(len(devs))]
        if not fixed and not all(fits):
            two_pass = True
            for d in devs:
                out.append(render("pass1", "llama_context", d, compute_mib, 12.5))
                out.append(render("pass2_sizes", "llama_context", compute_mib + 256, compute_mib, 0.0, 256))
        elif not fixed:
            out.append(render("single_pass", "llama_context", compute_mib + 256.0))
        per_device = []
        for i, d in enumerate(devs):
            b, free, model_d = budget(i)
            tensors = 2 * lay[i]
            pc = mib_per_cell * lay[i] / layers  # MiB per cell of this device's layers
            out.append(render("budget", "llama_kv_residency_alloc", d, int(free), int(targets[i]), int(model_d), 0,
                              int(reserves[i]), int(margin), int(b)))
            v_whole = 0.0  # patch 0093: with -fa off the transposed V stays whole on the device, K takes the window
            if fa_off and not fits[i] and b >= 0:
                v_whole = pc * n_ctx / 2
                out.append(render("v_on_device", "llama_kv_residency_alloc", d, int(v_whole)))
                pc, tensors = pc / 2, lay[i]
            row = pc / tensors
            kb = b - v_whole  # what K's device prefix may use
            suffix = (" on ", d) if multi else ("", "")

            def seg_mib(cells, tensors=tensors, pc=pc, row=row):  # each tensor's segment rounded up to granules
                if not granule_mib:
                    return cells * pc
                return tensors * granule_mib * math.ceil(cells * row / granule_mib)

            if fits[i]:
                c = n_ctx
                out.append(render("window_full", "operator()", n_ctx, n_ctx * pc, *suffix))
            else:
                if b < 0:
                    out.append("llama_init_from_model: failed to initialize the context: "
                               + render("no_window", d, int(free), int(targets[i]), int(model_d), int(reserves[i]),
                                        int(margin)))
                    return out, None, None
                if not granule_mib:
                    c = int(kb / pc)
                else:  # the engine's sizer: each tensor may lose a granule to rounding, C rounds up to whole granules
                    usable = kb - tensors * granule_mib
                    n = 0 if usable <= 0 else min(n_ctx - 1, int(usable / pc))
                    c = min(n_ctx, int(seg_mib(n) / tensors / row))
                if c <= 0 and not granule_mib:
                    out.append("llama_init_from_model: failed to initialize the context: "
                               + render("no_window", d, int(free), int(targets[i]), int(model_d), int(reserves[i]),
                                        int(margin)))
                    return out, None, None
                if c >= n_ctx:
                    c = n_ctx
                    out.append(render("window_full", "operator()", n_ctx, n_ctx * pc, *suffix))
                else:
                    host = seg_mib(n_ctx) - seg_mib(c) if granule_mib else seg_mib(n_ctx - c)
                    out.append(render("window", "llama_kv_residency_alloc", c, n_ctx, seg_mib(c) + v_whole, host,
                                      *suffix))
                    # patch 0101: the tail is pinned as cells come into use, or at boot
                    eager = os.environ.get("LLAMA_KV_HOST_ON_DEMAND") == "0"
                    out.append(render("host_tail", "llama_kv_residency_alloc", host, host if eager else 0.0,
                                      " (at boot)" if eager else " (pinned as cells come into use; "
                                      "LLAMA_KV_HOST_ON_DEMAND=0 pins it at boot)"))
            per_device.append((d, c, lay[i]))
    for d, ly in zip(devs, lay):
        out.append("llama_kv_cache: %10s KV buffer size = %8.2f MiB" % (d, kv_mib * ly / layers))
    out.append("llama_kv_cache: size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB"
               % (kv_mib, n_ctx, layers, 1, 1, kv_type, kv_mib / 2, kv_type, kv_mib / 2))
    # FAKE_PASS2_COMPUTE_EXTRA_MIB: pass 2 allocates more than pass 1 measured (the f16 shortfall 0097 fixed)
    extra = float(os.environ.get("FAKE_PASS2_COMPUTE_EXTRA_MIB", "0")) if two_pass else 0.0
    for d in devs:
        out.append("sched_reserve: %10s compute buffer size = %8.2f MiB" % (d, compute_mib + extra))
    if two_pass:
        out.append(render("pass2_done", "llama_context", 40.0))
    return out, per_device[0][1], per_device


def log(lines):
    """Print log lines to stderr; the lines of FAKE_EXTRA_LOG are appended to the first batch a
    program logs (tests: lines the parser must reject or read per device)."""
    extra = os.environ.pop("FAKE_EXTRA_LOG", "")
    for ln in list(lines) + extra.splitlines():
        print(ln, file=sys.stderr, flush=True)
