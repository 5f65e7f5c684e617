"""Device script (not collected by pytest): where the compute buffer allocated after pass 2 outgrows pass 1's
measurement (issue 26/28: f16 K/V staged for the prefetch, reports/2026-12-07-h100-d/f16-reserve-shortfall.json).

    python3 tests/gpu/reserve_diag.py models --build PREFIX --llama-tree SRC --work DIR
    python3 tests/gpu/reserve_diag.py trace  --build PREFIX --work DIR [--cases tiny-1m,15b-131k]

The build is the product tree with tests/gpu/reserve_diag.diff applied (an allocation trace, GGML_GALLOCR_TRACE_MIB,
the scheduler's input copies, and LLAMA_DIAG_REBUILD=1: graph_reserve builds its graph again after the scratch split
instead of reserving the graph that split rewired) or, for the check of a fix, the series alone (the trace lines are
then absent). Each case: a `--vram-target 1` probe for the fixed part of the budget, then a window holding about half
of the cells, booted with the trace, and again with LLAMA_DIAG_REBUILD=1. Pass 1's measurement against the compute
buffer allocated after pass 2 is in each case's JSON (pass1, compute); WORK/NAME.log keeps the trace.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_on_demand import serve  # noqa: E402

# model file, shape, weights, context, K+V bytes per cell over all layers (f16)
CASES = {
    "tiny-1m": ("tiny-f16.gguf", "tiny", "f16", 1048576, 2 * 2 * 32 * 2),
    "15b-131k": ("qwen2-1.5b-f16.gguf", "qwen2-1.5b", "f16", 131072, 28 * 2 * 256 * 2),
}


def target_for_half(server: str, model: Path, ctx: int, cell_bytes: int, work: Path, name: str) -> int:
    """A --vram-target whose window holds about half of the cells: the probe's fixed part plus half the KV plus a
    2 MiB granule per K/V tensor for the sizer's rounding."""
    probe = serve(f"{name}-probe", [server, "-m", str(model), "-c", str(ctx), "-np", "1", "-fa", "on", "-ngl", "99",
                                    "-krm", "window", "--vram-target", "1"], work, [])
    if not probe.get("budget"):
        raise SystemExit(f"{name}: no budget line in the probe's log ({work / (name + '-probe.log')})")
    fixed = 1 - int(probe["budget"][-1][-1])
    return fixed + (ctx // 2) * cell_bytes // 2**20 + 64


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=("models", "trace"))
    ap.add_argument("--build", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--llama-tree", type=Path)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--trace-mib", default="32")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    server = str(a.build / "bin" / "llama-server")
    cases = [c for c in a.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c}: one of {', '.join(CASES)}")

    if a.step == "models":
        for c in cases:
            fname, shape, q = CASES[c][:3]
            out = a.work / fname
            if not out.exists():
                subprocess.run([sys.executable, "-m", "rollkv_dist", "model", "random", "-o", str(out), "--shape", shape,
                                "--qtype", q, "--llama-tree", str(a.llama_tree), "--quiet"], check=True)
        return 0

    summary = {}
    for c in cases:
        fname, _, _, ctx, cell_bytes = CASES[c]
        model = a.work / fname
        target = target_for_half(server, model, ctx, cell_bytes, a.work, c)
        base = [server, "-m", str(model), "-c", str(ctx), "-np", "1", "-fa", "on", "-ngl", "99", "-krm", "window",
                "--vram-target", str(target)]
        body = {"prompt": [1000 + 7 * i for i in range(64)], "n_predict": 8, "temperature": 0, "n_probs": 4,
                "cache_prompt": False, "return_tokens": True}
        runs = {}
        for label, env in (("trace", {"GGML_GALLOCR_TRACE_MIB": a.trace_mib}),
                           ("rebuild", {"GGML_GALLOCR_TRACE_MIB": a.trace_mib, "LLAMA_DIAG_REBUILD": "1"})):
            res = serve(f"{c}-{label}", base, a.work, [body], env=env)
            runs[label] = {k: res.get(k) for k in ("booted", "pass1", "compute", "window", "alloc_failed", "command",
                                                    "env")}
            runs[label]["tokens"] = [x.get("tokens") for x in res.get("answers", [])]
        summary[c] = {"vram_target": target, "runs": runs}
    (a.work / "reserve-diag.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
