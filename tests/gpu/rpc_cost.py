"""Device script (not run by CI), issue 29: what a host tail over RPC costs per token, on one GPU.

Two ggml-rpc-servers on loopback serve the GPU as two nodes. For each layout, one resident run and one window
run that keeps `--keep` of every device's KV on that device (the rest is its host tail), with llama-logits-dump
(a prompt of `--words` words, `-n` greedy tokens), `--reps` times each, and the window once more with tail staging
off (`-kts off`: over RPC, staging runs on the server, where the graph runs; the difference says it does):

  local   the GPU itself (-dev CUDA0)
  rpc2    both nodes (-dev RPC0,RPC1 -ts 1,1)
  mixed   the local GPU and one node (-dev CUDA0,RPC0 -ts 1,1): how users mix machines

Every device's --vram-target comes from the engine's own numbers (rollkv_dist.gates.sizing): probes at
`--vram-target 1` stop at each device in turn with its fixed part. Logits and greedy tokens of every run are
compared with the local resident run. Prefill and decode ms per token come from llama_perf's lines; the RPC cost
per token is a layout's window run less the local window run at the same kept fraction.

    python3 tests/gpu/rpc_cost.py --build PREFIX --model M.gguf --work DIR [--ctx 65536] [--keep 0.25]
        [--extra "-ctk q8_0 -ctv q8_0"] [--layouts local,rpc2,mixed] [--reps 2] > summary.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rollkv_dist.gates import logparse, sizing  # noqa: E402
from rollkv_dist.gates.context import LOG_ARGS  # noqa: E402
from rollkv_dist.gates.process import run_logged  # noqa: E402
from rollkv_dist.gates.resident_parity import compare, make_prompt  # noqa: E402
from rollkv_dist.gates.rpc import RpcServer, kv_mib_by_endpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--words", type=int, default=14000)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--extra", default="")
    ap.add_argument("--layouts", default="local,rpc2,mixed")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--local-dev", default="CUDA0", help="the local device (-dev); a CPU check: none")
    ap.add_argument("--window-variants", default="kts-off=-kts off",
                    help="more window runs at the same --vram-target: NAME=FLAGS, separated by ';'")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    dump, server_bin = a.build / "bin" / "llama-logits-dump", a.build / "bin" / "ggml-rpc-server"
    prompt = a.work / "prompt.txt"
    prompt.write_text(make_prompt(a.words))
    out: dict = {"model": a.model, "ctx": a.ctx, "keep": a.keep, "extra": a.extra, "n": a.n, "runs": {},
                 "layouts": {}}
    rec = SimpleNamespace(commands=[], logs=[])
    env = dict(os.environ)

    def run(name: str, args: list[str]) -> tuple[int, logparse.LlamaLog, dict]:
        cmd = [str(dump), "-m", a.model, "-f", str(prompt), "-n", str(a.n), "-c", str(a.ctx), "-fa", "on", "-ngl",
               "99", *shlex.split(a.extra), *args, *LOG_ARGS, "--logits-out", str(a.work / name)]
        p = run_logged(cmd, a.work / name, a.timeout, env=env)
        rc = p.rc
        lg = logparse.parse_log(p.log, name)
        r = {"cmd": shlex.join(cmd), "rc": rc, "seconds": round(p.seconds, 1),
             "prompt_eval": lg.prompt_eval, "eval": lg.eval,
             "windows": [asdict(w) for w in lg.windows],
             "budgets": lg.budgets, "kv_buffers": lg.kv_buffers}
        ref = a.work / "local-resident-1"
        if rc == 0 and (a.work / f"{name}.json").exists() and (ref.with_suffix(".json")).exists():
            c = compare(ref, a.work / name)
            r["vs_local_resident"] = {k: c.get(k) for k in ("max_abs_diff", "n_diff", "first_diff_row", "tokens_equal")}
            r["vs_local_resident"]["n_prompt"] = c["n_prompt"][1]
            # the dump's row 0 is the prompt's last logits, row i the i-th generated token's: a window run tests its
            # host tail only where the prompt and the tokens reach past the cells on some device
            if lg.windows:
                r["tail_read"] = (c["n_prompt"][1] or 0) + a.n > min(w.cells_resident for w in lg.windows)
        out["runs"][name] = r
        print(json.dumps({name: {k: r[k] for k in ("rc", "seconds", "prompt_eval", "eval")} |
                          {"vs": r.get("vs_local_resident"), "windows": r["windows"]}}, default=str), file=sys.stderr,
              flush=True)
        return rc, lg, r

    with RpcServer(server_bin, a.work / "rpc-server-0.log", env, rec) as s0, \
            RpcServer(server_bin, a.work / "rpc-server-1.log", env, rec) as s1:
        layouts = {"local": ["-dev", a.local_dev],
                   "rpc2": ["--rpc", f"{s0.endpoint},{s1.endpoint}", "-dev", "RPC0,RPC1", "-ts", "1,1"],
                   "mixed": ["--rpc", s0.endpoint, "-dev", f"{a.local_dev},RPC0", "-ts", "1,1"]}
        out["servers"] = rec.commands
        for lay in a.layouts.split(","):
            base = layouts[lay]
            res = [run(f"{lay}-resident-{i + 1}", [*base, "-krm", "resident"]) for i in range(a.reps)]
            rc, lg, _ = res[0]
            if rc != 0:
                out["layouts"][lay] = {"error": "resident run failed"}
                continue
            devs = base[base.index("-dev") + 1].split(",")
            endpoints = base[base.index("--rpc") + 1].split(",") if "--rpc" in base else []
            by_endpoint = kv_mib_by_endpoint(lg)  # an RPC node's KV by its place in --rpc: RPCi on the client
            kv = {f"RPC{i}": by_endpoint[ep] for i, ep in enumerate(endpoints) if ep in by_endpoint}
            kv.update({b: m for b, m in lg.kv_buffers.items() if b in devs})  # the local device
            layers = max(c[2] for c in lg.kv_caches) if lg.kv_caches else 0
            total = sum(kv.values()) or 1.0
            targets = {d: 1 if kv.get(d, 0.0) > 0 else 0 for d in devs}  # 0: a device without KV, its free memory
            fixed: dict[str, float] = {}
            for i in range(sum(1 for d in devs if targets[d])):
                prc, plg, _ = run(f"{lay}-probe-{i}", [*base, "-krm", "window", "--vram-target",
                                                       ",".join(str(targets[d]) for d in devs)])
                nw = plg.no_window
                if nw is None or targets.get(nw["device"]) != 1:
                    break
                f = sizing.Fixed(nw["device"], nw["model"], 0.0, nw["compute_reserve"], nw["margin"], "no-window")
                fixed[f.device] = f.mib
                n_t = round(2 * layers * kv.get(f.device, 0.0) / total)
                targets[f.device] = sizing.vram_target(f, a.keep * kv.get(f.device, 0.0), n_t)
            if len(fixed) != sum(1 for d in devs if kv.get(d, 0.0) > 0):
                out["layouts"][lay] = {"error": f"probes sized {sorted(fixed)} of {devs}", "targets": targets}
                continue
            vt = ",".join(str(targets[d]) for d in devs)
            wins = [run(f"{lay}-window-{i + 1}", [*base, "-krm", "window", "--vram-target", vt])
                    for i in range(a.reps)]
            # e.g. tail staging off (zero-copy reads of the tail): staging runs where the graph runs, on the server
            variants = {}
            for spec in filter(None, a.window_variants.split(";")):
                vname, _, flags = spec.partition("=")
                variants[vname] = run(f"{lay}-window-{vname}", [*base, "-krm", "window", "--vram-target", vt,
                                                                *shlex.split(flags)])
            off = [variants["kts-off"]] if "kts-off" in variants else []

            def ms(rs: list, key: str) -> list:
                return [round(r[2][key]["ms"] / r[2][key]["n"], 5) for r in rs if r[0] == 0 and r[2].get(key)]

            out["layouts"][lay] = {
                "devices": devs, "kv_mib": kv, "fixed_mib": fixed, "vram_target": vt,
                # the KV against every device's budget together (a device at 0 has its free memory: not counted)
                "kv_above_the_targets_together": sum(kv.values()) > sum(targets.values()) and all(targets.values()),
                "windows": out["runs"][f"{lay}-window-1"]["windows"],
                "resident_prefill_ms_per_token": ms(res, "prompt_eval"), "resident_decode_ms_per_token": ms(res, "eval"),
                "window_prefill_ms_per_token": ms(wins, "prompt_eval"), "window_decode_ms_per_token": ms(wins, "eval"),
                "kts_off_prefill_ms_per_token": ms(off, "prompt_eval"), "kts_off_decode_ms_per_token": ms(off, "eval"),
                "all_equal_local_resident": all(
                    (r[2].get("vs_local_resident") or {}).get("max_abs_diff") == 0.0
                    and (r[2].get("vs_local_resident") or {}).get("tokens_equal")
                    for r in [*res, *wins, *variants.values()])}
    loc = out["layouts"].get("local", {})
    for lay, v in out["layouts"].items():
        if lay == "local" or "error" in v or "error" in loc:
            continue
        v["cost_vs_local_ms_per_token"] = {
            k: round(min(v[k]) - min(loc[k]), 4) for k in
            ("resident_prefill_ms_per_token", "resident_decode_ms_per_token", "window_prefill_ms_per_token",
             "window_decode_ms_per_token", "kts_off_prefill_ms_per_token", "kts_off_decode_ms_per_token")
            if v.get(k) and loc.get(k)}
    json.dump(out, sys.stdout, indent=1, default=str)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
