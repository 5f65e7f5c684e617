#!/usr/bin/env python3
"""Tail-staging probe on one GPU (device script, not part of the package).

For each KV type: llama-bench resident, window (--kv-tail-staging off,auto,on in one run) at a
--vram-target that leaves about 55 % of the decode context's cells in the host tail, and -nkvo;
depth and model from the command line. The fixed part of the budget (model + compute reserve +
margin) is what the engine itself logs for a `-vt 1` probe. Writes every log and a JSON summary
to OUT.

usage: stage_probe.py LLAMA_BENCH MODEL DEPTH OUT [KV_TYPES] [UBATCH_SWEEP]
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("ROLLKV_REPO", "."))
from rollkv_dist.gates import logparse  # noqa: E402

bench, model, depth, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
kv_types = (sys.argv[5] if len(sys.argv) > 5 else "f16,q8_0").split(",")
ub_sweep = len(sys.argv) > 6 and sys.argv[6] == "ub"
out.mkdir(parents=True, exist_ok=True)
n_p, n_g, reps = 512, 64, os.environ.get("REPS", "2")
summary = {"depth": depth, "model": model, "runs": []}


def run(label, args, timeout=900):
    cmd = [bench, "-m", model, "-o", "json", "-v", "-fa", "on", "-ngl", "99", *args]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    (out / f"{label}.json").write_text(p.stdout)
    (out / f"{label}.err").write_text(p.stderr)
    rows = json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip() else []
    log = logparse.parse_log(p.stderr)
    print(f"[{time.time() - t0:6.1f} s] {label}: rc={p.returncode} {' '.join(cmd[1:])}", flush=True)
    summary["runs"].append({"label": label, "cmd": cmd, "rc": p.returncode, "seconds": time.time() - t0,
                            "rows": [{k: r.get(k) for k in ("n_prompt", "n_gen", "n_depth", "n_ubatch", "type_k",
                                                             "kv_residency_mode", "vram_target", "kv_tail_staging",
                                                             "no_kv_offload", "avg_ts", "stddev_ts")} for r in rows],
                            "windows": [w.__dict__ for w in log.windows]})
    return p, rows, log


def ts(rows, kind, kts=None, ub=None):
    for r in rows:
        if (r["n_gen"] > 0) == (kind == "tg") and (kts is None or r.get("kv_tail_staging") == kts) \
                and (ub is None or r.get("n_ubatch") == ub):
            return r["avg_ts"]
    return None


table = []
for kv in kv_types:
    base = ["-d", str(depth), "-p", str(n_p), "-n", str(n_g), "-r", reps, "-ctk", kv, "-ctv", kv]
    _, rrows, rlog = run(f"{kv}-resident", [*base, "-krm", "resident"])
    per_cell = rlog.kv_mib_per_cell
    _, _, plog = run(f"{kv}-vt1-probe", [*base, "-krm", "window", "-vt", "1", "-r", "1"])
    nw = plog.no_window
    fixed = nw["model"] + nw["compute_reserve"] + nw["margin"]
    n_dec = -(-(depth + n_g) // 256) * 256
    layers = rlog.kv_caches[0][2] if rlog.kv_caches else 28
    vt = int(fixed + 2 * 2 * layers + 0.45 * n_dec * per_cell) + 1
    for attempt in range(3):
        _, wrows, wlog = run(f"{kv}-window-vt{vt}", [*base, "-krm", "window", "-vt", str(vt), "-kts", "off,auto,on"])
        w = wlog.window_for(depth + n_g)
        tf = None if w is None or w.fully_resident else 1 - w.cells_resident / w.kv_size
        if tf is not None and 0.5 <= tf <= 0.65:
            break
        vt = int(vt + ((tf if tf is not None else 0.0) - 0.575) * n_dec * per_cell)
    _, nrows, _ = run(f"{kv}-nkvo", [*base, "-nkvo", "1"])
    row = {"kv": kv, "vram_target": vt, "tail_fraction_decode_ctx": tf, "mib_per_cell": per_cell,
           "resident": (ts(rrows, "pp"), ts(rrows, "tg")), "nkvo": (ts(nrows, "pp"), ts(nrows, "tg"))}
    for k in ("off", "auto", "on"):
        row[k] = (ts(wrows, "pp", k), ts(wrows, "tg", k))
    table.append(row)
    if ub_sweep and kv == "f16":
        _, urows, _ = run(f"{kv}-window-ub-sweep", ["-d", str(depth), "-p", str(n_p), "-n", "0", "-r", reps,
                                                    "-ctk", kv, "-ctv", kv, "-krm", "window", "-vt", str(vt),
                                                    "-b", "4096", "-ub", "512,1024,2048,4096", "-kts", "auto"])
        summary["ub_sweep"] = [(r["n_ubatch"], r["avg_ts"]) for r in urows]

summary["table"] = table
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(f"\ndepth {depth}: pp512 / tg64 t/s")
for r in table:
    print(f"{r['kv']:5} tail {r['tail_fraction_decode_ctx']} vt {r['vram_target']}: resident {r['resident']} "
          f"off {r['off']} auto {r['auto']} on {r['on']} nkvo {r['nkvo']}")
if "ub_sweep" in summary:
    print("ub sweep (f16, auto):", summary["ub_sweep"])
