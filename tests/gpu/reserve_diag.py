"""Device script (not collected by pytest): the compute buffer allocated after pass 2 against pass 1's measurement
(issue 26/28: f16 K/V staged for the prefetch outgrew it, reports/2026-12-07-h100-d/f16-reserve-shortfall.json),
before and after 0097's fix (the graph built again after the scratch split), in one build.

    python3 tests/gpu/reserve_diag.py models --build PREFIX --llama-tree SRC --work DIR [--cases ...]
    python3 tests/gpu/reserve_diag.py run    --build PREFIX --work DIR [--cases ...]

The build is the series with tests/gpu/reserve_diag.diff applied: an allocation trace (GGML_GALLOCR_TRACE_MIB=N:
each allocation and free of at least N MiB, and the scheduler's input copies) and LLAMA_DIAG_SPLIT_TWICE=1, which
reserves the graph the scratch split rewired, as the series did before the fix ("before"). Cases:
  tiny-1m    the tiny shape, -c 1048576, a window holding about half of the cells (a --vram-target 1 probe gives
             the fixed part of the budget), traced
  15b-131k   the Qwen2-1.5B shape, -c 131072, likewise
  14b-1m     the 14B-1M shape (q8_0 weights, f16 K/V), -c 1048576 at the default --vram-target: the boot that
             failed with "failed to allocate compute pp buffers" on the H100
  14b-noc    the same with no -c (after only): auto keeps the training context (0101)
Each run answers one short request; WORK/NAME.log keeps the log, WORK/reserve-diag.json the summary.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_on_demand import M14, serve  # noqa: E402

MODELS = {"tiny": ("tiny-f16.gguf", "tiny", "f16"), "15b": ("qwen2-1.5b-f16.gguf", "qwen2-1.5b", "f16"),
          "14b": (M14, "qwen2.5-14b-1m", "q8_0")}
# case: model, -c (None: not given), K+V bytes per cell over all layers for a half window (None: default target),
# traced, runs
CASES = {
    "tiny-1m": ("tiny", 1048576, 2 * 2 * 32 * 2, True, ("before", "after")),
    "15b-131k": ("15b", 131072, 28 * 2 * 256 * 2, True, ("before", "after")),
    "14b-1m": ("14b", 1048576, None, False, ("before", "after")),
    "14b-noc": ("14b", None, None, False, ("after",)),
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
    ap.add_argument("step", choices=("models", "run"))
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
        for key in dict.fromkeys(CASES[c][0] for c in cases):
            fname, shape, q = MODELS[key]
            out = a.work / fname
            if not out.exists():
                subprocess.run([sys.executable, "-m", "rollkv_dist", "model", "random", "-o", str(out), "--shape", shape,
                                "--qtype", q, "--llama-tree", str(a.llama_tree), "--quiet"], check=True)
        return 0

    summary_path = a.work / "reserve-diag.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    body = {"prompt": [1000 + 7 * i for i in range(64)], "n_predict": 8, "temperature": 0, "n_probs": 4,
            "cache_prompt": False, "return_tokens": True}
    for c in cases:
        key, ctx, cell_bytes, traced, labels = CASES[c]
        model = a.work / MODELS[key][0]
        base = [server, "-m", str(model), *(["-c", str(ctx)] if ctx else []), "-fa", "on", "-ngl", "99"]
        target = None
        if cell_bytes is not None:
            target = target_for_half(server, model, ctx, cell_bytes, a.work, c)
            base += ["-np", "1", "-krm", "window", "--vram-target", str(target)]
        runs = {}
        for label in labels:
            env = {"GGML_GALLOCR_TRACE_MIB": a.trace_mib} if traced else {}
            if label == "before":
                env["LLAMA_DIAG_SPLIT_TWICE"] = "1"
            res = serve(f"{c}-{label}", base, a.work, [body], env=env)
            runs[label] = {k: res.get(k) for k in ("command", "env", "booted", "boot_seconds", "pass1", "compute",
                                                    "window", "reserved", "alloc_failed", "n_ctx", "budget")}
            runs[label]["tokens"] = [x.get("tokens") for x in res.get("answers", [])]
            runs[label]["errors"] = [x.get("error") for x in res.get("answers", []) if x.get("error")]
        summary[c] = {"vram_target": target, "runs": runs}
        summary_path.write_text(json.dumps(summary, indent=1))
    print(json.dumps({c: {k: {x: v.get(x) for x in ("booted", "pass1", "compute", "alloc_failed", "n_ctx")}
                          for k, v in s["runs"].items()} for c, s in summary.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
