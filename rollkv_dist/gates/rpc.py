"""rpc: llama.cpp's RPC backend on the GPU under test, over loopback.

A ggml-rpc-server on 127.0.0.1 (its own process group, its log under the gate's work folder, stopped at the end)
serves the GPU under test; the client loads the model on that RPC device alone (`--rpc 127.0.0.1:PORT -dev
RPC0`), and a local run on the same GPU is the reference. Random qwen2-1.5B-shape Q8_0 model, a prompt of
about 6600 tokens, `llama-logits-dump`. Checks:

- resident over RPC gives the local resident run's logits bit for bit and the same greedy tokens (the same
  kernels on the same GPU; the activations cross the socket unchanged);
- auto over RPC with a --vram-target of 1 MiB (a KV far above the device's budget) keeps the KV whole on the RPC
  device and says so (an RPC device cannot hold a host tail: patch 0099), with resident-over-RPC's logits;
- window over RPC with that target is refused, saying what to change;
- fault: the rpc-server is killed while the client evaluates the prompt (ubatches of 8); the client stops
  within a minute naming the node and the command that got no answer (patch 0100), never hangs.

A window with a host tail on an RPC node needs the server-side window buffers of the RPC issue; until then
this gate proves what the series does over RPC today.
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollkv_dist import proc as proc_mod
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates.context import (LOG_ARGS, GateContext, GateResult, ensure_random_model, model_option,
                                       preflight, run_timeout_option, shape_option)
from rollkv_dist.gates.llama_server import free_port
from rollkv_dist.gates.process import run_logged
from rollkv_dist.gates.resident_parity import _compare_checks, make_prompt

NAME = "rpc"
BINARIES = ("llama-logits-dump", "ggml-rpc-server")
DEVICE = "RPC0"  # the client's name of the first --rpc server's first device
LISTEN_TIMEOUT_S = 60.0
FAULT_LIMIT_S = 60.0  # the client stops this soon after its node is killed, or the gate calls it a hang
FAULT_UBATCH = 8  # small ubatches: the prompt takes long enough to kill the node in the middle of it
NAMED = re.compile(r"RPC server 127\.0\.0\.1:(\d+) stopped answering \((\w+)\)[^\n]*")
AUTO_RESIDENT = re.compile(rf"kv residency: auto -> resident on {DEVICE}: [^\n]*")
REFUSED = re.compile(rf"[^\n]*does not fit the device budget of {DEVICE}[^\n]*")


@dataclass(frozen=True)
class Options:
    model: str | None = model_option()
    rpc_shape: str = shape_option("qwen2-1.5b")
    rpc_words: int = option("words of the prompt (~1.1 tokens each)", 6000)
    rpc_ctx: int = option("context (-c) of every run", 65536)
    run_timeout: float = run_timeout_option()


class RpcServer:
    """ggml-rpc-server on a free loopback port in its own process group, as a context manager: listening
    within LISTEN_TIMEOUT_S or a RuntimeError with its log's end; stopped as a group on exit."""

    def __init__(self, binary: Path, log_path: Path, env: dict[str, str], result: GateResult):
        self.port = free_port()
        self.cmd = [str(binary), "-H", "127.0.0.1", "-p", str(self.port)]
        self.log_path, self.env, self.result = log_path, env, result
        self.proc: subprocess.Popen[Any] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> RpcServer:
        self.result.commands.append(shlex.join(self.cmd))
        self.result.logs.append(str(self.log_path))
        with open(self.log_path, "w") as log:
            self.proc = proc_mod.popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=self.env)
        t0 = time.monotonic()
        while time.monotonic() - t0 < LISTEN_TIMEOUT_S:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"ggml-rpc-server did not listen on {self.endpoint} within {LISTEN_TIMEOUT_S:.0f} s "
                           f"(rc {self.proc.returncode}): {self.log_path.read_text(errors='replace')[-1500:]}")

    def kill(self) -> None:
        """The node dies (SIGKILL to its group): no goodbye to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            proc_mod.kill_group(self.proc)

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    dump, server_bin = ctx.bin("llama-logits-dump"), ctx.bin("ggml-rpc-server")
    if not preflight(ctx, res, dump, ("--logits-out", "--rpc", "--kv-residency-mode")):
        return res
    model = str(o.model or ensure_random_model(ctx, o.rpc_shape, "q8_0"))
    prompt = ctx.work / "prompt.txt"
    prompt.write_text(make_prompt(o.rpc_words))
    res.results.update({"model": model, "device": DEVICE, "runs": {}})
    env = ctx.child_env()

    def dump_run(name: str, endpoint: str | None, dev: str, extra: list[str]) -> dict[str, Any]:
        # --rpc before -dev: the RPC devices exist once --rpc is read
        cmd = [dump, "-m", model, "-f", prompt, "-n", "16", "-c", str(o.rpc_ctx), "-fa", "on", "-ngl", "99",
               *(["--rpc", endpoint] if endpoint else []), "-dev", dev, *extra, *LOG_ARGS,
               "--logits-out", ctx.work / name]
        p = run_logged(cmd, ctx.work / name, o.run_timeout, env=env, result=res)
        said = p.log
        r = {"rc": p.rc, "timed_out": p.timed_out, "seconds": round(p.seconds, 1),
             "said": [m.group(0) for pat in (AUTO_RESIDENT, REFUSED) for m in pat.finditer(said)]}
        res.results["runs"][name] = r
        return r

    local = dump_run("local-resident", None, _local_device(ctx), ["-krm", "resident"])
    if not res.check("local resident run", local["rc"] == 0, f"rc={local['rc']}"):
        return res
    with RpcServer(server_bin, ctx.work / "rpc-server.log", env, res) as node:
        remote = dump_run("rpc-resident", node.endpoint, DEVICE, ["-krm", "resident"])
        auto = dump_run("rpc-auto", node.endpoint, DEVICE, ["-krm", "auto", "--vram-target", "1"])
        window = dump_run("rpc-window", node.endpoint, DEVICE, ["-krm", "window", "--vram-target", "1"])
    if res.check("resident over RPC runs", remote["rc"] == 0, f"rc={remote['rc']}"):
        _compare_checks(res, "resident over RPC vs local", ctx.work / "local-resident", ctx.work / "rpc-resident",
                        remote)
    if (res.check("auto over RPC, --vram-target 1, runs", auto["rc"] == 0, f"rc={auto['rc']}")
            and res.check("auto over RPC keeps the KV whole on the RPC device and says why (0099)",
                          any(AUTO_RESIDENT.match(s) for s in auto["said"]), "; ".join(auto["said"]) or "no line")):
        _compare_checks(res, "auto over RPC vs resident over RPC", ctx.work / "rpc-resident", ctx.work / "rpc-auto",
                        auto)
    res.check("window over RPC with a KV above the budget is refused, saying what to change",
              window["rc"] not in (0, None) and any("raise --vram-target" in s for s in window["said"]),
              f"rc={window['rc']}; " + ("; ".join(window["said"]) or "no refusal line"))
    _fault(ctx, res, dump, server_bin, model, prompt, env)
    return res


def _local_device(ctx: GateContext) -> str:
    """The local reference run's device: the GPU under test is the child's first CUDA device."""
    return "CUDA0" if ctx.gpu is not None else "none"


def _fault(ctx: GateContext, res: GateResult, dump: Path, server_bin: Path, model: str, prompt: Path,
           env: dict[str, str]) -> None:
    """Kill the node a second into the prompt; the client must stop within FAULT_LIMIT_S naming it."""
    o = ctx.options
    out: dict[str, Any] = {"killed": False, "rc": None, "stopped_after_s": None, "named": None}
    res.results["fault"] = out
    log_path = ctx.work / "rpc-fault.log"
    with RpcServer(server_bin, ctx.work / "rpc-server-fault.log", env, res) as node:
        cmd = [str(x) for x in (dump, "-m", model, "-f", prompt, "-n", "16", "-c", o.rpc_ctx, "-fa", "on", "-ngl",
                                "99", "--rpc", node.endpoint, "-dev", DEVICE, "-b", FAULT_UBATCH, "-ub", FAULT_UBATCH,
                                "--logits-out", ctx.work / "rpc-fault")]
        res.commands.append(shlex.join(cmd))
        res.logs.append(str(log_path))
        lines: list[str] = []
        with proc_mod.running(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=env, text=True) as client:
            t0 = time.monotonic()
            for line in client.stdout:
                lines.append(line)
                if "logits-dump: prompt " in line:  # the context is up; the prompt's ubatches start
                    time.sleep(1.0)
                    node.kill()
                    t0, out["killed"] = time.monotonic(), True
                    break
            try:
                rest = client.communicate(timeout=FAULT_LIMIT_S)[0]
                out["rc"], out["stopped_after_s"] = client.returncode, round(time.monotonic() - t0, 2)
            except subprocess.TimeoutExpired:
                rest = ""
                out["rc"] = "hung"
    said = "".join(lines) + (rest or "")
    log_path.write_text(said)
    m = NAMED.search(said)
    out["named"] = m.group(0) if m else None
    finished = "prompt evaluated" in said
    if not res.check("fault: the node was killed during the prompt", out["killed"] and not finished,
                     "the client printed no prompt line" if not out["killed"] else
                     "the prompt finished first" if finished else ""):
        return
    res.check(f"fault: the client stops within {FAULT_LIMIT_S:.0f} s of its node's death, with an error",
              out["rc"] not in (0, None, "hung"), f"rc={out['rc']}, after {out['stopped_after_s']} s")
    res.check("fault: the client names the node that stopped answering (0100)",
              m is not None and m.group(1) == str(node.port), out["named"] or "no line naming it")


def report_rows(results: dict[str, Any]) -> list[str]:
    runs = results.get("runs") or {}
    if not runs:
        return []
    out = [f"Device `{results.get('device')}` over loopback; `{results.get('model')}`.", "",
           "| run | rc | seconds | max abs diff | greedy tokens identical | what it said |", "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        cmp = r.get("compare") or {}
        said = "; ".join(r.get("said") or []).replace("|", "\\|")[:200]
        out.append(f"| {name} | {r.get('rc')} | {r.get('seconds')} | {cmp.get('max_abs_diff', '-')} | "
                   f"{cmp.get('tokens_equal', '-')} | {said or '-'} |")
    f = results.get("fault")
    if f:
        out += ["", f"Fault: node killed during the prompt: {f.get('killed')}; client rc {f.get('rc')} after "
                    f"{f.get('stopped_after_s')} s; `{f.get('named') or 'no line naming the node'}`"]
    return out


GATE = Gate(name=NAME, order=85, run=run, options=Options, report_rows=report_rows, binaries=BINARIES)
