"""Device script (not collected by pytest): the device budget under a ballast (issue 26), on one GPU: the window's
headroom against ggml-cuda's pool before and after patches 0097 (reports/2026-12-04-h200-budget/), a
quantized K-shift before and after 0098, and a draft model beside the main one.

    python3 tests/gpu/budget_scratch.py inputs --build PREFIX --llama-tree SRC --work DIR
    python3 tests/gpu/budget_scratch.py probe  --build PREFIX --work DIR
    python3 tests/gpu/budget_scratch.py demo   --build PREFIX --work DIR --label before|after
    python3 tests/gpu/budget_scratch.py bounds --build PREFIX --work DIR
    python3 tests/gpu/budget_scratch.py kshift --build PREFIX --work DIR --label before|after [--free] [--small-compute]
    python3 tests/gpu/budget_scratch.py draft  --build PREFIX --work DIR

inputs  writes the models (qwen2-1.5b shape, f16 and q8_0; f16's tied embedding makes the logits a cuBLAS f16 GEMM
        whose f16 output, 151936 x 4096 x 2 B = 1187 MiB, comes from the pool) and a text.
probe   runs llama-perplexity once
        with a small --vram-target to read the model, the CUDA context and the measured compute buffer, and chooses
        the ballast: the free memory that leaves the KV window room for 300 MiB once the scratch is counted.
demo    llama-perplexity -c 65536 -b 4096 -ub 4096 -krm auto at the packaged default --vram-target (the free memory),
        with that ballast: the build either finishes (ppl printed, pool high-water mark below its bound) or aborts.
bounds  single-pass runs of other shapes and ubatches: each run's scratch line (the bound) beside the pool's
        high-water mark at exit (patch 0097).
kshift  llama-server -c 1048576 -ctk q8_0 at the packaged default --vram-target with a ballast that leaves
        KSHIFT_FREE_MIB free (a host tail of about 12 GiB), four slots capped at 4096 cells: one prompt of 4094 tokens
        makes its slot shift its context, and the shift rotates every cell's K through f32 copies (2 GiB at once
        before patch 0098). The answer, the `kv shift:` lines and any failure are recorded. --free: no ballast and
        -krm resident (the answers of before and after compared bit for bit). --small-compute: `-ub 128 -kts off`,
        a compute buffer without staged copies, smaller than the whole layer's two f32 copies (2 x 1 GiB): the
        shape of reports/2026-12-01-h200-c/04-kshift/, where the shift could not get its memory; with the server's
        defaults the copies fit its compute buffer and the shift runs before 0098 too (reports/2026-12-07-h100/).
draft   llama-server with a draft model (-md, the q8_0 model drafting for the f16 one) at the packaged default
        --vram-target with a ballast that leaves DRAFT_FREE_MIB: both contexts take windows within the free memory
        (patch 0096), and one answer is drafted and verified.
Each writes WORK/NAME.log and WORK/NAME.json (command, rc, seconds, the parsed lines).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rollkv_dist.ballast import Ballast  # noqa: E402

CTX = 65536
UB = 4096
EXPECTED_SCRATCH_MIB = 151936 * UB * 2 / 2**20 + 1536 * UB * 2 / 2**20 + 32  # logits f16 + src1 f16 + cuBLAS workspace
WINDOW_ROOM_MIB = 300
KSHIFT_CTX, KSHIFT_SLOT, KSHIFT_FREE_MIB = 1048576, 4096, 12000
DRAFT_CTX, DRAFT_FREE_MIB = 65536, 8000

PATTERNS = {
    "budget": re.compile(r"(\S+): free (\d+) MiB, vram target (\d+) MiB, model (\d+) MiB, other KV (\d+) MiB, "
                         r"compute reserve (\d+) MiB, margin (\d+) MiB -> window budget (-?\d+) MiB"),
    "pass1": re.compile(r"pass 1 measured (\S+) compute buffer = ([0-9.]+) MiB"),
    "scratch": re.compile(r"(\S+) scratch outside the compute buffers = ([0-9.]+) MiB \(pool ([0-9.]+) MiB, kept "
                          r"workspaces ([0-9.]+) MiB\)"),
    "window": re.compile(r"position window = (\d+) / (\d+) cells resident \(device ([0-9.]+) MiB, host tail ([0-9.]+) MiB\)"),
    "window_full": re.compile(r"position window = FULLY RESIDENT"),
    "high_water": re.compile(r"(\S+) pool high-water mark: ([0-9.]+) MiB"),
    "compute": re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB"),
    "ppl": re.compile(r"Final estimate: PPL = ([0-9.]+)"),
    "oom": re.compile(r"(out of memory|CUDA error[^\n]*)"),
    "short": re.compile(r"single pass short: [^\n]*"),
    "kv_shift": re.compile(r"kv shift: (\S+) K of (\d+) cells shifted in chunks of (\d+) cells, their f32 copies "
                           r"within the (\S+) compute buffer \(([0-9.]+) MiB\)"),
    "shift_failed": re.compile(r"failed to (?:allocate compute graph for|compute) K-shift[^\n]*"),
    "context_shift": re.compile(r"slot context shift, n_keep = (\d+), n_left = (\d+), n_discard = (\d+)"),
    "decode_error": re.compile(r"(failed to decode[^\n]*|llama_decode[^\n]*fail[^\n]*)"),
}


def parse(text: str, patterns: dict[str, re.Pattern] = PATTERNS) -> dict:
    """Every match of each pattern in text, by pattern name (tests/gpu/host_on_demand.py passes its own)."""
    out: dict = {}
    for name, pat in patterns.items():
        found = [m.groups() if m.groups() else (m.group(0),) for m in pat.finditer(text)]
        if found:
            out[name] = found
    return out


def run(name: str, cmd: list[str], work: Path, env: dict | None = None, timeout: float = 300) -> dict:
    t = time.time()
    with open(work / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = (work / f"{name}.log").read_text(errors="replace")
    res = {"name": name, "command": " ".join(cmd), "rc": rc, "seconds": round(time.time() - t, 1), **parse(text)}
    (work / f"{name}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in res if k in ("name", "rc", "seconds", "scratch", "high_water", "window",
                                                       "ppl", "oom", "short", "pass1", "budget")}), flush=True)
    return res


def serve(name: str, args: list[str], work: Path, requests_: list[dict]) -> dict:
    """llama-server with args; each request body goes to /completion in turn; the log parsed as run() does."""
    from rollkv_dist.gates.llama_server import LlamaServer

    t = time.time()
    answers: list = []
    srv = LlamaServer(Path(args[0]), [*args[1:], "-lv", "4"], work / f"{name}.log", boot_timeout=300,
                      request_timeout=180)
    with srv:
        booted = srv.booted
        for body in requests_ if booted else []:
            try:
                answers.append(srv.post("/completion", body))
            except Exception as e:  # the request's failure is the result
                answers.append({"error": f"{type(e).__name__}: {e}"})
    text = (work / f"{name}.log").read_text(errors="replace")
    res = {"name": name, "command": " ".join(srv.cmd), "booted": booted, "boot_seconds": srv.boot_seconds,
           "rc": srv.exit_code, "seconds": round(time.time() - t, 1), "answers": answers, **parse(text)}
    (work / f"{name}.json").write_text(json.dumps(res, indent=1))
    brief = [{k: a.get(k) for k in ("truncated", "tokens", "error")} | {"timings": {
        k: (a.get("timings") or {}).get(k) for k in ("prompt_n", "predicted_n", "draft_n", "draft_n_accepted")}}
        for a in answers]
    print(json.dumps({"name": name, "booted": booted, "seconds": res["seconds"], "answers": brief,
                      **{k: res[k] for k in res if k in ("kv_shift", "shift_failed", "context_shift", "decode_error",
                                                          "window", "budget", "oom")}}), flush=True)
    return res


def ppl_cmd(build: Path, model: Path, text: Path, ctx: int, ub: int, extra: list[str]) -> list[str]:
    return [str(build / "bin" / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ub),
            "-ub", str(ub), "-fa", "on", "-ngl", "99", "--chunks", "1", "-krm", "auto", "-lv", "4", *extra]


def write_inputs(llama_tree: Path, work: Path) -> None:
    for q in ("f16", "q8_0"):
        out = work / f"qwen2-1.5b-{q}.gguf"
        if not out.exists():
            subprocess.run([sys.executable, "-m", "rollkv_dist", "model", "random", "-o", str(out), "--shape",
                            "qwen2-1.5b", "--qtype", q, "--llama-tree", str(llama_tree), "--quiet"], check=True)
    words = [w for w in ("time year people way day man thing woman life child world school state family student "
                         "group country problem hand part place case week company system program question work "
                         "government number night point home water room mother area money story fact month lot "
                         "right study book eye job word business issue side kind head house service friend father "
                         "power hour game line end member law car city community name president team minute idea "
                         "kid body information back parent face others level office door health person art war "
                         "history party result change morning reason research girl guy moment air teacher force").split()]
    rng = random.Random(0)
    (work / "text.txt").write_text(" ".join(rng.choice(words) for _ in range(3 * CTX)) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=("inputs", "probe", "demo", "bounds", "kshift", "draft"))
    ap.add_argument("--free", action="store_true", help="kshift: no ballast, -krm resident")
    ap.add_argument("--small-compute", action="store_true", help="kshift: -ub 128 -kts off (no staged copies)")
    ap.add_argument("--build", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--llama-tree", type=Path)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    f16, text = a.work / "qwen2-1.5b-f16.gguf", a.work / "text.txt"

    if a.step == "inputs":
        write_inputs(a.llama_tree, a.work)
        return 0

    if a.step == "probe":
        probe_free = 30000
        with Ballast(probe_free):
            r = run("probe", ppl_cmd(a.build, f16, text, CTX, UB, ["--vram-target", "8000"]), a.work)
        dev, free, _t, model, _kv, reserve, margin, _b = r["budget"][0]
        measured = float(r["pass1"][0][1])
        # what the process takes before the window is sized (its CUDA context and the weights): the free memory it
        # sees is the ballast's less this; the default budget is that free memory less the reserve and the margin
        taken = probe_free - int(free)
        leave = taken + measured + 256 + int(margin) + EXPECTED_SCRATCH_MIB + WINDOW_ROOM_MIB
        plan = {"device": dev, "probe_leave_free_mib": probe_free, "free_seen_mib": int(free), "taken_mib": taken,
                "model_mib": int(model), "measured_compute_mib": measured, "margin_mib": int(margin),
                "expected_scratch_mib": round(EXPECTED_SCRATCH_MIB, 1), "window_room_mib": WINDOW_ROOM_MIB,
                "leave_free_mib": int(leave)}
        (a.work / "plan.json").write_text(json.dumps(plan, indent=1))
        print(json.dumps(plan), flush=True)
        return 0

    if a.step == "demo":
        plan = json.loads((a.work / "plan.json").read_text())
        with Ballast(plan["leave_free_mib"]):
            r = run(f"demo-{a.label}", ppl_cmd(a.build, f16, text, CTX, UB, []), a.work)
        return 0 if r["rc"] == 0 else 1

    q8 = a.work / "qwen2-1.5b-q8_0.gguf"
    server = str(a.build / "bin" / "llama-server")
    if a.step == "kshift":
        # the slot's prompt leaves 2 cells of its 4096: the shift comes in the answer's first tokens
        prompt = [1000 + (7 * i) % 50000 for i in range(KSHIFT_SLOT - 2)]
        body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "n_probs": 4, "return_tokens": True,
                "cache_prompt": False}
        args = [server, "-m", str(q8), "-c", str(KSHIFT_CTX), "--kv-unified-per-slot", str(KSHIFT_SLOT),
                "--context-shift", "-ctk", "q8_0", "-ctv", "f16", "-fa", "on", "-ngl", "99"]
        name = f"kshift-{a.label}"
        if a.small_compute:
            args, name = [*args, "-ub", "128", "-kts", "off"], name + "-small-compute"
        if a.free:
            r = serve(f"{name}-free", [*args, "-krm", "resident"], a.work, [body])
        else:
            with Ballast(KSHIFT_FREE_MIB):
                r = serve(name, args, a.work, [body])
        return 0 if r["booted"] and r["answers"] and "error" not in r["answers"][0] else 1

    if a.step == "draft":
        words = text.read_text().split()[:1500]
        body = {"prompt": " ".join(words), "n_predict": 32, "temperature": 0, "cache_prompt": False}
        args = [server, "-m", str(f16), "-md", str(q8), "--spec-type", "draft-simple", "--spec-draft-n-max", "8",
                "-c", str(DRAFT_CTX), "-fa", "on", "-ngl", "99"]
        with Ballast(DRAFT_FREE_MIB):
            r = serve("draft", args, a.work, [body])
        return 0 if r["booted"] and r["answers"] and "error" not in r["answers"][0] else 1

    # bounds: single pass (the KV fits), so only the check after the reserve logs the scratch
    for name, model, ub in (("f16-ub512", f16, 512), ("f16-ub4096", f16, 4096), ("q8_0-ub512", q8, 512),
                            ("q8_0-ub4096", q8, 4096)):
        run(f"bounds-{name}", ppl_cmd(a.build, model, text, 16384, ub, []), a.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
