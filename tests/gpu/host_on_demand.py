"""Device script (not collected by pytest): host memory on demand (issue 28, patch 0101) on one GPU, each case
against eager pinning (LLAMA_KV_HOST_ON_DEMAND=0) of the same build in the same lease.

    python3 tests/gpu/host_on_demand.py inputs --build PREFIX --llama-tree SRC --work DIR
    python3 tests/gpu/host_on_demand.py boot   --build PREFIX --work DIR
    python3 tests/gpu/host_on_demand.py speed  --build PREFIX --work DIR
    python3 tests/gpu/host_on_demand.py fault  --build PREFIX --work DIR
    python3 tests/gpu/host_on_demand.py huge   --build PREFIX --work DIR

inputs  the Qwen2.5-14B-1M shape (q8_0 weights) and the Qwen2-1.5B shape (f16), random weights.
boot    llama-server -m 14B -c 1048576 (and with no -c, which auto fits to the GPU) until /health answers, on demand and
        eager, f16 KV where the eager tail fits the host (else q8_0 KV for the eager pair); one 5 000-token request
        each. Records the boot seconds, the `kv host tail` lines and the host memory used (MemAvailable before and
        after boot).
speed   the 1.5B shape, -c 131072, a --vram-target that leaves about 40 000 cells on the device, one request of a
        100 000-token prompt (more than half of the used cells in the host tail), n_predict 32 with top-4
        probabilities: resident, eager, on demand, on demand, eager. Prefill and decode t/s from the server's
        timings; every window answer's tokens and probabilities against resident's.
fault   the same server on demand with LLAMA_KV_HOST_PIN_CAP_MIB below what the 100 000-token prompt needs: that
        request fails with the message, a short request after it succeeds, /health answers.
huge    the 1.5B shape at -c 16777216 (-ub 64): boots on demand (its tail is larger than the host), a short request
        succeeds.
diag    the 14B shape at -c 524288, f16 K/V: pass 1's measured compute buffer against the one allocated after pass 2,
        the tail pinned on demand and at boot, and with tail staging off.
Each case writes WORK/NAME.log and WORK/NAME.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_scratch import parse as parse_patterns  # noqa: E402

M14, M15 = "qwen2.5-14b-1m-q8_0.gguf", "qwen2-1.5b-f16.gguf"
SPEED_CTX, SPEED_PROMPT, SPEED_DEVICE_CELLS = 131072, 100000, 40000
KV_CELL_F16_15B = 28 * 2 * 256 * 2  # bytes per cell: 28 layers, K and V, 2 KV heads x 128, f16

PATTERNS = {
    "reserved": re.compile(r"kv host tail: ([0-9.]+) MiB reserved, ([0-9.]+) MiB pinned"),
    "grow": re.compile(r"kv host tail: pinned (\d+) MiB more on (\S+), cells up to (\d+) of (\d+) backed: (\d+) of (\d+) "
                       r"MiB pinned \((\d+) ms\)"),
    "window": re.compile(r"position window = (\d+) / (\d+) cells resident \(device ([0-9.]+) MiB, host tail ([0-9.]+) MiB\)"),
    "window_full": re.compile(r"position window = FULLY RESIDENT"),
    "budget": re.compile(r"(\S+): free (\d+) MiB, vram target (\d+) MiB, model (\d+) MiB, other KV (\d+) MiB, "
                         r"compute reserve (\d+) MiB, margin (\d+) MiB -> window budget (-?\d+) MiB"),
    "tail_error": re.compile(r"the KV host tail on [^\n]*"),
    "pass1": re.compile(r"pass 1 measured (\S+) compute buffer = ([0-9.]+) MiB"),
    "compute": re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB"),
    "alloc_failed": re.compile(r"allocating ([0-9.]+) MiB on device \d+: cudaMalloc failed"),
    "n_ctx": re.compile(r"llama_context: n_ctx += (\d+)"),
    "cuda_buffer": re.compile(r"window buffer: ([0-9.]+) MiB device \+ ([0-9.]+) MiB (pinned host|host reserved)"),
}


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return -1


def mem_total_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return -1


def serve(name: str, args: list[str], work: Path, bodies: list[dict], env: dict | None = None) -> dict:
    """llama-server with args and env; each body to /completion in turn; boot seconds and host memory recorded."""
    from rollkv_dist.gates.llama_server import LlamaServer

    full_env = {**os.environ, **(env or {})}
    before = mem_available_mib()
    t = time.time()
    answers: list = []
    srv = LlamaServer(Path(args[0]), [*args[1:], "-lv", "4"], work / f"{name}.log", env=full_env, boot_timeout=600,
                      request_timeout=600)
    after_boot = None
    health_after = None
    with srv:
        booted = srv.booted
        after_boot = mem_available_mib()
        for body in bodies if booted else []:
            try:
                answers.append(srv.post("/completion", body))
            except Exception as e:  # the request's failure is the result
                answers.append({"error": f"{type(e).__name__}: {e}"})
        if booted:
            try:
                health_after = srv.get("/health")
            except Exception as e:
                health_after = {"error": f"{type(e).__name__}: {e}"}
        after_requests = mem_available_mib()
    text = (work / f"{name}.log").read_text(errors="replace")
    res = {"name": name, "command": " ".join(srv.cmd), "env": env or {}, "booted": booted,
           "boot_seconds": srv.boot_seconds, "rc": srv.exit_code, "seconds": round(time.time() - t, 1),
           "mem_available_mib": {"before": before, "after_boot": after_boot, "after_requests": after_requests},
           "health_after": health_after, "answers": answers, **parse_patterns(text, PATTERNS)}
    (work / f"{name}.json").write_text(json.dumps(res, indent=1))
    brief = [{"error": a.get("error"), "n": len(a.get("tokens") or []),
              "timings": {k: (a.get("timings") or {}).get(k) for k in ("prompt_n", "prompt_per_second",
                                                                       "predicted_per_second")}} for a in answers]
    print(json.dumps({"name": name, "booted": booted, "boot_seconds": res["boot_seconds"],
                      "mem": res["mem_available_mib"], "answers": brief, "health_after": health_after,
                      **{k: res[k] for k in ("reserved", "window", "tail_error", "pass1", "compute", "alloc_failed",
                                             "n_ctx") if k in res},
                      "grows": len(res.get("grow", []))}), flush=True)
    return res


def prompt(n: int, seed: int = 0) -> list[int]:
    return [1000 + (7919 * i + seed) % 50000 for i in range(n)]


def same_answer(a: dict, b: dict) -> bool:
    return (a.get("tokens") == b.get("tokens") and a.get("tokens") is not None
            and a.get("completion_probabilities") == b.get("completion_probabilities"))


def speed_target(build: Path, work: Path, model: Path) -> int:
    """A --vram-target that leaves about SPEED_DEVICE_CELLS cells on the device, from the budget line of a
    `--vram-target 1` probe of the same server command (model, compute reserve, margin), plus a granule of each of
    the 56 K/V tensors that the sizer sets aside for rounding."""
    from rollkv_dist.gates.llama_server import LlamaServer

    args = ["-m", str(model), "-c", str(SPEED_CTX), "-np", "1", "-fa", "on", "-ngl", "99", "-krm", "window",
            "--vram-target", "1", "-lv", "4"]
    with LlamaServer(build / "bin" / "llama-server", args, work / "probe.log", boot_timeout=300) as probe:
        budgets = probe.parsed().budgets
    if probe.booted or not budgets:
        raise SystemExit("probe: no budget line in\n" + probe.log()[-3000:])
    fixed = 1 - int(budgets[-1]["budget"])
    return int(fixed + SPEED_DEVICE_CELLS * KV_CELL_F16_15B // 2**20 + 56 * 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=("inputs", "boot", "speed", "fault", "huge", "diag"))
    ap.add_argument("--build", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--llama-tree", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    server = str(a.build / "bin" / "llama-server")
    m14, m15 = a.work / M14, a.work / M15

    if a.step == "inputs":
        for out, shape, q in ((m14, "qwen2.5-14b-1m", "q8_0"), (m15, "qwen2-1.5b", "f16")):
            if not out.exists():
                subprocess.run([sys.executable, "-m", "rollkv_dist", "model", "random", "-o", str(out), "--shape", shape,
                                "--qtype", q, "--llama-tree", str(a.llama_tree), "--quiet"], check=True)
        return 0

    if a.step == "boot":
        body = {"prompt": prompt(5000), "n_predict": 8, "temperature": 0, "cache_prompt": False}
        base = [server, "-m", str(m14), "-fa", "on", "-ngl", "99"]
        total = mem_total_mib()
        # the 14B shape's f16 KV is 192 KiB a cell: at 1M cells the eager tail is the KV less the device's share
        gpu_mib = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i",
                                      "0"], capture_output=True, text=True).stdout.split()[0])
        eager_f16_tail_mib = 196608 - (gpu_mib - 16000)
        kv = [] if eager_f16_tail_mib < 0.8 * total else ["-ctk", "q8_0", "-ctv", "q8_0"]
        print(json.dumps({"host_total_mib": total, "gpu_mib": gpu_mib, "eager_f16_tail_mib_est": eager_f16_tail_mib,
                          "eager_kv": kv or "f16"}), flush=True)
        serve("boot-ondemand-c1m", [*base, "-c", "1048576"], a.work, [body])
        serve("boot-ondemand-noc", base, a.work, [body])
        serve("boot-ondemand-c1m-kv", [*base, "-c", "1048576", *kv], a.work, [body])
        serve("boot-eager-c1m-kv", [*base, "-c", "1048576", *kv], a.work, [body], env={"LLAMA_KV_HOST_ON_DEMAND": "0"})
        return 0

    if a.step == "diag":
        # the pass-1 measurement against the compute buffer allocated after pass 2, f16 K/V, tail pinned at boot and
        # on demand (the reserve does not depend on how the tail is pinned)
        base = [server, "-m", str(m14), "-c", "524288", "-fa", "on", "-ngl", "99"]
        serve("diag-f16-c512k-ondemand", base, a.work, [])
        serve("diag-f16-c512k-eager", base, a.work, [], env={"LLAMA_KV_HOST_ON_DEMAND": "0"})
        serve("diag-f16-c512k-ondemand-kts-off", [*base, "-kts", "off"], a.work, [])
        return 0

    if a.step == "speed":
        target = speed_target(a.build, a.work, m15)
        body = {"prompt": prompt(SPEED_PROMPT), "n_predict": 32, "temperature": 0, "n_probs": 4, "return_tokens": True,
                "cache_prompt": False}
        base = [server, "-m", str(m15), "-c", str(SPEED_CTX), "-np", "1", "-fa", "on", "-ngl", "99"]
        res = {"resident": serve("speed-resident", [*base, "-krm", "resident"], a.work, [body])}
        for name, env in (("eager-1", {"LLAMA_KV_HOST_ON_DEMAND": "0"}), ("ondemand-1", {}), ("ondemand-2", {}),
                          ("eager-2", {"LLAMA_KV_HOST_ON_DEMAND": "0"})):
            res[name] = serve(f"speed-{name}", [*base, "-krm", "window", "--vram-target", str(target)], a.work, [body],
                              env=env)
        ref = res["resident"]["answers"][0]
        summary = {"vram_target": target, "runs": {}}
        for name, r in res.items():
            ans = r["answers"][0] if r["answers"] else {}
            t = ans.get("timings") or {}
            summary["runs"][name] = {"prefill_tps": t.get("prompt_per_second"), "decode_tps": t.get("predicted_per_second"),
                                     "window": r.get("window"), "grows": len(r.get("grow", [])),
                                     "reserved": r.get("reserved"), "equal_to_resident": same_answer(ans, ref)}
        (a.work / "speed-summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary), flush=True)
        return 0

    if a.step == "fault":
        target = speed_target(a.build, a.work, m15)
        long = {"prompt": prompt(SPEED_PROMPT), "n_predict": 4, "temperature": 0, "cache_prompt": False}
        short = {"prompt": prompt(200, 1), "n_predict": 8, "temperature": 0, "cache_prompt": False}
        base = [server, "-m", str(m15), "-c", str(SPEED_CTX), "-np", "1", "-fa", "on", "-ngl", "99", "-krm", "window",
                "--vram-target", str(target)]
        # about a third of what the long prompt's tail needs: the cap is hit in the middle of the prompt
        cap = (SPEED_PROMPT - SPEED_DEVICE_CELLS) * KV_CELL_F16_15B // 2**20 // 3
        serve("fault-cap", base, a.work, [long, short, short], env={"LLAMA_KV_HOST_PIN_CAP_MIB": str(cap)})
        return 0

    # huge: a context past host RAM
    short = {"prompt": prompt(2000), "n_predict": 8, "temperature": 0, "cache_prompt": False}
    # -ub 64 and no tail staging: a compute buffer that leaves the window most of the GPU at 16M cells
    serve("huge-c16m", [server, "-m", str(m15), "-c", "16777216", "-np", "1", "-ub", "64", "-kts", "off", "-fa", "on",
                        "-ngl", "99"], a.work, [short])
    return 0


if __name__ == "__main__":
    sys.exit(main())
