"""Call 2's table: median t/s of the repetitions for each llama-bench JSON in DIR (name-kv.json), with ratios to
'before' (the SMs read the tail: GGML_CUDA_PREFETCH_COPY=sm) and to resident, and f16 decode against the overlap bound."""
import json, statistics, sys
from pathlib import Path

d = Path(sys.argv[1])
rows = {}
for f in sorted(d.glob("*.json")):
    name, kv = f.stem.rsplit("-", 1)
    try:
        data = json.loads(f.read_text())
    except ValueError:
        print(f"{f.name}: no JSON")
        continue
    rows[(name, kv)] = {("tg" if r["n_gen"] else "pp"): statistics.median(r["samples_ts"]) for r in data}
for kv in ("f16", "q8_0"):
    ref, res = rows.get(("before", kv), {}), rows.get(("resident", kv), {})
    for (name, k), m in rows.items():
        if k != kv:
            continue
        cells = []
        for t in ("tg", "pp"):
            if t in m:
                c = f"{t} {m[t]:9.1f}"
                if t in ref:
                    c += f" ({m[t] / ref[t]:.3f}x before"
                    c += f", {m[t] / res[t]:.3f} of resident)" if t in res else ")"
                cells.append(c)
        print(f"{kv:5} {name:14} " + "  ".join(cells))
