"""Pick the prefetch setting of call 2: geometric mean of f16/q8_0 decode and prefill t/s (medians of the
repetitions) against 0016's setting; print a table, then the winner's env as the last line."""
import json, math, statistics, sys
from pathlib import Path

ENV = {"p0016-normal-div4": "GGML_CUDA_PREFETCH_PRIORITY=normal GGML_CUDA_PREFETCH_SM_DIV=4",
       "high-div4": "GGML_CUDA_PREFETCH_PRIORITY=high GGML_CUDA_PREFETCH_SM_DIV=4",
       "high-div2": "GGML_CUDA_PREFETCH_PRIORITY=high GGML_CUDA_PREFETCH_SM_DIV=2",
       "high-div1": "GGML_CUDA_PREFETCH_PRIORITY=high GGML_CUDA_PREFETCH_SM_DIV=1",
       "normal-div2": "GGML_CUDA_PREFETCH_PRIORITY=normal GGML_CUDA_PREFETCH_SM_DIV=2",
       "engine": "GGML_CUDA_PREFETCH_COPY=engine"}
d = Path(sys.argv[1])


def tps(name, kv):
    try:
        rows = json.loads((d / f"{name}-{kv}.json").read_text())
    except (OSError, ValueError):
        return None
    out = {}
    for r in rows:
        out["tg" if r["n_gen"] else "pp"] = statistics.median(r["samples_ts"])
    return out


ref = {kv: tps("p0016-normal-div4", kv) for kv in ("f16", "q8_0")}
best, best_score = "p0016-normal-div4", 1.0
for name in [*ENV, "p0016-normal-div4-again", "zerocopy", "resident"]:
    m = {kv: tps(name, kv) for kv in ("f16", "q8_0")}
    ratios = [m[kv][k] / ref[kv][k] for kv in m if m[kv] and ref[kv] for k in ("tg", "pp") if k in m[kv]]
    score = math.prod(ratios) ** (1 / len(ratios)) if len(ratios) == 4 else None
    print(name, {kv: m[kv] and {k: round(v, 1) for k, v in m[kv].items()} for kv in m},
          None if score is None else round(score, 4))
    if name in ENV and score is not None and score > best_score * 1.005:
        best, best_score = name, score
print(f"best: {best} ({best_score:.4f})")
print(ENV[best])
