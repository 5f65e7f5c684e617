"""Every fixture model, llama-logits-dump with the packaged default (no flag) and with -krm resident -fa on:
rc, the residency line and the context error, one TSV row per model (before/after table of issue 25)."""
import re, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
prefix, models, prompt, out, work = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
work.mkdir(parents=True, exist_ok=True)
dump = prefix / "bin" / "llama-logits-dump"
def one(m):
    row = [m.stem]
    for tag, extra in (("default", []), ("resident", ["-krm", "resident", "-fa", "on"])):
        lp = work / f"{m.stem}-{tag}.log"
        with open(lp, "w") as f:
            p = subprocess.run([str(dump), "-m", str(m), "-f", prompt, "-n", "8", "-c", "8192", *extra,
                                "--logits-out", str(work / f"{m.stem}-{tag}")], stdout=f, stderr=subprocess.STDOUT,
                               timeout=300)
        text = lp.read_text(errors="replace")
        res = re.findall(r"kv residency: [^\n]*", text)
        err = re.findall(r"failed to initialize the context: [^\n]*", text)
        row += [str(p.returncode), (res[-1] if res else "-")[:160], (err[-1] if err else "-")[:200]]
    return row
ms = sorted(models.glob("*.gguf"))
with ThreadPoolExecutor(12) as pool:
    rows = list(pool.map(one, ms))
out.write_text("model\tdefault_rc\tdefault_residency\tdefault_error\tresident_rc\tresident_residency\tresident_error\n"
               + "".join("\t".join(r) + "\n" for r in rows))
bad = [r[0] for r in rows if r[1] != "0" and r[4] == "0"]
up = [r[0] for r in rows if r[4] != "0"]
print(f"{out.name}: {len(rows)} models; default fails where resident runs: {len(bad)} {bad}; resident fails: {len(up)} {up}")
