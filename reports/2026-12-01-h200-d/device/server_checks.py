#!/usr/bin/env python3
"""Device script (not part of the package): llama-server checks of auto mode and of the default log lines.

usage: server_checks.py LLAMA_SERVER OUT_JSON NAME TIMEOUT_S [server args...]
Starts llama-server with the given args (no -lv: the default verbosity), waits for /health (or for the
process to exit), asks one short greedy completion, stops the server (process group), and writes what
it saw: boot seconds, exit code, the rolling-KV lines of the log, the completion text and timings.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

binary, out_json, name, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
args = sys.argv[5:]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
log_path = out_json.replace(".json", ".log")
cmd = [binary, *args, "--host", "127.0.0.1", "--port", str(port)]
t0 = time.time()
with open(log_path, "w") as lf:
    p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
res = {"name": name, "cmd": cmd, "booted": False}
try:
    while time.time() - t0 < timeout:
        if p.poll() is not None:
            res["exit_code"] = p.returncode
            break
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    res["booted"] = True
                    break
        except Exception:
            pass
        time.sleep(0.5)
    res["seconds_to_health_or_exit"] = round(time.time() - t0, 1)
    if res["booted"]:
        body = json.dumps({"prompt": "The capital of France is", "n_predict": 8, "temperature": 0,
                           "top_k": 1, "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            c = json.loads(r.read())
        res["completion"] = {"content": c.get("content"), "tokens_predicted": c.get("tokens_predicted"),
                             "timings": c.get("timings")}
finally:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
    except Exception:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except Exception:
            pass
res["total_seconds"] = round(time.time() - t0, 1)
text = open(log_path, errors="replace").read()
keys = ("position window", "window budget", "kv compute reserve", "kv tail staging", "kv residency", "window buffer",
        "fitting the layers", "n_ctx ", "error", "failed", "memory breakdown", "CUDA_Host", "pinning", "out of memory", "memory_breakdown", "host memory", "draft")
res["lines"] = [ln for ln in text.splitlines() if any(k in ln for k in keys)][:120]
json.dump(res, open(out_json, "w"), indent=2)
print(f"{name}: booted={res['booted']} exit={res.get('exit_code')} t={res['seconds_to_health_or_exit']} s "
      f"completion={res.get('completion', {}).get('content')!r}")
for ln in res["lines"][:14]:
    print("   ", ln[:220])
