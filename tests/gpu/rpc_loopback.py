"""Device script (not collected by pytest): llama.cpp's RPC backend on one GPU over loopback (issue 29), with
the series' programs. A ggml-rpc-server on 127.0.0.1 serves the GPU; the client loads the model on that RPC
device only (`-dev RPC0`) against the same GPU used locally (`-dev CUDA0`):

- parity: `-krm auto` over RPC with a --vram-target below the KV (patch 0099: an RPC device cannot hold a host
  tail, so auto keeps the KV whole and says why) gives resident's logits over RPC bit for bit; both are compared
  with the local resident run too;
- window: `-krm window` over RPC with that target is refused with what to change;
- fault: the rpc-server is killed during a prompt (ubatches of 8); the client stops within FAULT_LIMIT_S
  naming the node (patch 0100), never hangs.

    python3 tests/gpu/rpc_loopback.py --build PREFIX --model GGUF --work DIR

Writes DIR/rpc.json (commands, exit codes, seconds, the lines checked, max |logit difference|).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

FAULT_LIMIT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(build: Path, work: Path, name: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    srv = subprocess.Popen([str(build / "bin" / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port)],
                           stdout=open(work / f"{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return srv, port
        except OSError:
            if srv.poll() is not None:
                raise SystemExit(f"ggml-rpc-server exited: {(work / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.1)
    raise SystemExit("ggml-rpc-server did not listen within 60 s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--local-dev", default="CUDA0", help="the local device of the reference run (none: the CPU, a dry run)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = "the of and river mountain window garden engine signal pattern market harbor letter winter".split()
    prompt = a.work / "prompt.txt"
    prompt.write_text(" ".join(rng.choice(words) for _ in range(6000)))
    dump = str(a.build / "bin" / "llama-logits-dump")
    out: dict = {"runs": {}}

    def run(name: str, dev: str, mode: str, port: int | None, extra: list[str] = ()) -> dict:
        # --rpc before -dev: the RPC devices exist once --rpc is read
        cmd = [dump, "-m", str(a.model), "-f", str(prompt), "-n", "16", "-c", "65536", "-fa", "on", "-ngl", "99",
               *(["--rpc", f"127.0.0.1:{port}"] if port else []), "-dev", dev, "-krm", mode,
               "--logits-out", str(a.work / name), *extra]
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        (a.work / f"{name}.log").write_text(p.stdout + p.stderr)
        said = p.stdout + p.stderr
        r = {"cmd": " ".join(cmd), "rc": p.returncode, "seconds": round(time.monotonic() - t0, 1),
             "lines": [ln for ln in said.splitlines() if re.search(r"kv residency|position window|does not fit", ln)]}
        out["runs"][name] = r
        print(name, r["rc"], r["seconds"], flush=True)
        return r

    run("local-resident", a.local_dev, "resident", None)
    srv, port = start_server(a.build, a.work, "rpc-server")
    try:
        run("rpc-resident", "RPC0", "resident", port)
        auto = run("rpc-auto-vt1", "RPC0", "auto", port, ["--vram-target", "1"])
        window = run("rpc-window-vt1", "RPC0", "window", port, ["--vram-target", "1"])
    finally:
        srv.kill()
        srv.wait()
    def diff(ref: str, name: str) -> float | str | None:
        if out["runs"][ref]["rc"] != 0 or out["runs"][name]["rc"] != 0:
            return None
        x = np.fromfile(a.work / f"{ref}.f32", dtype=np.float32)
        y = np.fromfile(a.work / f"{name}.f32", dtype=np.float32)
        return float(np.abs(x - y).max()) if x.shape == y.shape else f"shapes {x.shape} {y.shape}"

    # auto against resident on the same RPC device (0099's claim), and both against the local device (the same
    # kernels on a GPU; a CPU server's backend lays out weights differently from the local CPU's)
    out["auto_vs_rpc_resident"] = diff("rpc-resident", "rpc-auto-vt1")
    for name in ("rpc-resident", "rpc-auto-vt1"):
        out["runs"][name]["max_abs_diff_vs_local"] = diff("local-resident", name)
    out["auto_says_resident"] = any("auto -> resident on RPC0" in ln for ln in auto["lines"])
    out["window_refused"] = window["rc"] != 0

    # fault: kill the node during a prompt
    srv, port = start_server(a.build, a.work, "rpc-server-fault")
    cmd = [dump, "-m", str(a.model), "-f", str(prompt), "-n", "16", "-c", "65536", "-fa", "on", "-ngl", "99",
           "--rpc", f"127.0.0.1:{port}", "-dev", "RPC0", "-b", "8", "-ub", "8", "--logits-out", str(a.work / "fault")]
    cli = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, killed_at = [], None
    for line in cli.stdout:
        seen.append(line)
        if "logits-dump: prompt " in line and "tokens" in line:
            time.sleep(1.0)
            srv.kill()
            killed_at = time.monotonic()
            break
    try:
        rest = cli.communicate(timeout=FAULT_LIMIT_S)[0]
        rc = cli.returncode
    except subprocess.TimeoutExpired:
        cli.kill()
        rest, rc = cli.communicate()[0], "hung"
    said = "".join(seen) + (rest or "")
    (a.work / "fault.log").write_text(said)
    named = re.search(r"RPC server 127\.0\.0\.1:\d+ stopped answering \(\w+\)[^\n]*", said)
    out["fault"] = {"cmd": " ".join(cmd), "rc": rc, "killed": killed_at is not None,
                    "stopped_after_s": None if killed_at is None else round(time.monotonic() - killed_at, 2),
                    "named": named.group(0) if named else None}
    (a.work / "rpc.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}), flush=True)
    ok = (out["auto_vs_rpc_resident"] == 0.0 and out["auto_says_resident"]
          and out["window_refused"] and named is not None and rc not in (0, "hung"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
