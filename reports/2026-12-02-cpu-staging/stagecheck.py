import subprocess, sys, os, json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import numpy as np
models = sorted(Path("/tmp/archs").glob("*.gguf"))
dump = "/tmp/qb/bin/llama-logits-dump"
out = Path("/tmp/stage"); out.mkdir(exist_ok=True)
def run(m, staged):
    pre = out / (m.stem + ("-st" if staged else ""))
    env = dict(os.environ, **({"LLAMA_KV_STAGE_EVERY_CELL": "1"} if staged else {}))
    p = subprocess.run([dump, "-m", str(m), "-f", "/tmp/prompt.txt", "-n", "4", "-c", "8192", "-fa", "on", "-krm", "resident", "--logits-out", str(pre)], env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, pre
def one(m):
    r1, a = run(m, False)
    if r1 != 0: return (m.stem, "resident-fail")
    r2, b = run(m, True)
    if r2 != 0: return (m.stem, "staged-fail")
    x = np.fromfile(str(a)+".f32", np.float32); y = np.fromfile(str(b)+".f32", np.float32)
    return (m.stem, "ok" if x.shape == y.shape and (x == y).all() else f"DIFF {np.abs(x-y).max()}")
with ThreadPoolExecutor(2) as ex:
    res = list(ex.map(one, models))
bad = [r for r in res if r[1] != "ok"]
print(len(res), "models;", bad)
