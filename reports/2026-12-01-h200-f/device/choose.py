"""Call 4's choice: geometric mean of f16/q8_0 decode and prefill t/s (medians of the repetitions, each setting's
two runs pooled where it has two) against 'before' (0016's copies: every cell on the side stream, 1/4 of the SMs);
print a table, then the winner's environment as the last line."""
import json, math, statistics, sys
from pathlib import Path

ENV = {"before": "GGML_CUDA_PREFETCH_DEVICE_CELLS=side GGML_CUDA_PREFETCH_SM_DIV=4",
       "stream4": "GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_SM_DIV=4",
       "stream8": "GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_SM_DIV=8",
       "stream16": "GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_SM_DIV=16",
       "side8": "GGML_CUDA_PREFETCH_DEVICE_CELLS=side GGML_CUDA_PREFETCH_SM_DIV=8"}
d = Path(sys.argv[1])


def tps(name, kv):
    samples = {}
    for f in (d / f"{name}-{kv}.json", d / f"{name}-again-{kv}.json"):
        try:
            rows = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for r in rows:
            samples.setdefault("tg" if r["n_gen"] else "pp", []).extend(r["samples_ts"][1:])  # the first is warm-up
    return {k: statistics.median(v) for k, v in samples.items()}


ref = {kv: tps("before", kv) for kv in ("f16", "q8_0")}
best, best_score = "before", 1.0
for name in ENV:
    m = {kv: tps(name, kv) for kv in ("f16", "q8_0")}
    ratios = {f"{kv} {k}": m[kv][k] / ref[kv][k] for kv in m for k in ("tg", "pp") if k in m[kv] and k in ref[kv]}
    score = math.prod(ratios.values()) ** (1 / len(ratios)) if len(ratios) == 4 else None
    print(f"{name:9}", {kv: {k: round(v, 1) for k, v in m[kv].items()} for kv in m},
          {k: round(v, 3) for k, v in ratios.items()}, None if score is None else round(score, 4))
    if score is not None and score > best_score * 1.005:
        best, best_score = name, score
print(f"best: {best} ({best_score:.4f})")
print(ENV[best])
