"""rpc: llama.cpp's RPC backend on the GPU under test, over loopback, with a host tail on each node.

Two ggml-rpc-servers on 127.0.0.1 (each in its own process group, its log under the gate's work folder, stopped
at the end) serve the GPU under test as two nodes; the client splits the model's layers over them (`--rpc
A,B -dev RPC0,RPC1`), and a local run on the same GPU is the reference. Random qwen2-1.5B-shape Q8_0 model, a
prompt of about 13 000 tokens, `llama-logits-dump`. Checks:

- resident over the two nodes gives the local resident run's logits bit for bit and the same greedy tokens
  (the same kernels on the same GPU; the activations cross the socket unchanged);
- window mode with a --vram-target per node that keeps `--rpc-keep` of that node's KV on its device: every
  node that holds KV has a host tail (a window buffer on the server's GPU, patch 0102, whose tail is pinned in
  the server host's memory and checked against it, 0103), the prompt reaches into each tail, and the logits
  and greedy tokens equal the local resident run's and resident's over the same nodes; each server logs the
  window buffer it allocated;
- auto at the same targets takes the same windows, with the same logits;
- fault: over two fresh nodes with the windows above, node 0's rpc-server is killed while the client
  evaluates the prompt (ubatches of 8); the client stops within a minute naming the node and the command that
  got no answer (patch 0100), never hangs.

Each node's target comes from the engine's own numbers: a `--vram-target 1` probe stops at the first node the
engine sizes, with its fixed part (model, compute reserve, margin), a second probe at the other (sizing.py).
Without a GPU (the tests) the servers' CPU devices stand in for one (GGML_RPC_TEST_WINDOW_STAND_IN, 0102).
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
from rollkv_dist.gates import logparse, sizing
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates.context import (LOG_ARGS, GateContext, GateResult, ensure_random_model, model_option,
                                       preflight, run_timeout_option, shape_option)
from rollkv_dist.gates.llama_server import free_port
from rollkv_dist.gates.process import run_logged
from rollkv_dist.gates.resident_parity import _compare_checks, make_prompt

NAME = "rpc"
BINARIES = ("llama-logits-dump", "ggml-rpc-server")
NODES = 2
DEVICES = ",".join(f"RPC{i}" for i in range(NODES))  # the client's names of the --rpc servers' devices
LISTEN_TIMEOUT_S = 60.0
FAULT_LIMIT_S = 60.0  # the client stops this soon after its node is killed, or the gate calls it a hang
FAULT_UBATCH = 8  # small ubatches: the prompt takes long enough to kill the node in the middle of it
STAND_IN = {"GGML_RPC_TEST_WINDOW_STAND_IN": "1"}  # no GPU: a server's CPU device serves window buffers
NAMED = re.compile(r"RPC server 127\.0\.0\.1:(\d+) stopped answering \((\w+)\)[^\n]*")
AUTO_RESIDENT = re.compile(r"kv residency: auto -> resident on RPC\d+: [^\n]*")
REFUSED = re.compile(r"[^\n]*(?:does not fit the device budget of|no device memory left for the KV window on) "
                     r"RPC\d+[^\n]*")
# a KV buffer of the client names the server's device and its endpoint (the port tells the node)
SERVER_WINDOW = re.compile(r"rpc-server: window buffer on \S+: (\d+) MiB, of them (\d+) MiB in device memory and "
                           r"(\d+) MiB host tail")


@dataclass(frozen=True)
class Options:
    model: str | None = model_option()
    rpc_shape: str = shape_option("qwen2-1.5b")
    rpc_words: int = option("words of the prompt (~1.1 tokens each)", 12000)
    rpc_ctx: int = option("context (-c) of every run", 32768)
    rpc_keep: float = option("fraction of each node's KV that its --vram-target keeps on the device (the rest is "
                             "its host tail)", 0.2)
    rpc_tensor_split: str = option("-ts of the runs over the nodes (empty: llama.cpp's split)", "")
    rpc_cache_type: str = option("K/V type of every run (-ctk/-ctv): q8_0 is staged on the nodes whenever a ubatch "
                                 "reads their tails", "f16", choices=("f16", "q8_0"))
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


def _kv_type(o: Options) -> list[str]:
    """The K/V type flags of every run of the gate (the fault run's too)."""
    return ["-ctk", o.rpc_cache_type, "-ctv", o.rpc_cache_type]


def kv_mib_by_endpoint(log: logparse.LlamaLog) -> dict[str, float]:
    """KV MiB per RPC node, keyed by its HOST:PORT. An RPC buffer type is named after the server's own device and
    its endpoint (`RPC0[127.0.0.1:PORT]`), so two nodes' buffers can both read RPC0: the endpoint tells them apart."""
    out: dict[str, float] = {}
    for name, mib in log.kv_buffers.items():
        dev, _, rest = name.partition("[")
        if dev.startswith("RPC") and rest.endswith("]"):
            out[rest[:-1]] = out.get(rest[:-1], 0.0) + mib
    return out


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    dump, server_bin = ctx.bin("llama-logits-dump"), ctx.bin("ggml-rpc-server")
    if not preflight(ctx, res, dump, ("--logits-out", "--rpc", "--kv-residency-mode")):
        return res
    model = str(o.model or ensure_random_model(ctx, o.rpc_shape, "q8_0"))
    prompt = ctx.work / "prompt.txt"
    prompt.write_text(make_prompt(o.rpc_words))
    res.results.update({"model": model, "devices": DEVICES, "keep": o.rpc_keep, "runs": {}})
    env = ctx.child_env()
    logs: dict[str, logparse.LlamaLog] = {}  # each run's log, parsed once
    split = ["-ts", o.rpc_tensor_split] if o.rpc_tensor_split else []
    kv_type = _kv_type(o)
    res.results["cache_type"] = o.rpc_cache_type

    def dump_run(name: str, endpoints: list[str], dev: str, extra: list[str]) -> dict[str, Any]:
        # --rpc before -dev: the RPC devices exist once --rpc is read
        cmd = [dump, "-m", model, "-f", prompt, "-n", "16", "-c", str(o.rpc_ctx), "-fa", "on", "-ngl", "99", *kv_type,
               *(["--rpc", ",".join(endpoints)] if endpoints else []), "-dev", dev, *(split if endpoints else []),
               *extra, *LOG_ARGS, "--logits-out", ctx.work / name]
        p = run_logged(cmd, ctx.work / name, o.run_timeout, env=env, result=res)
        lg = logs[name] = logparse.parse_log(p.log, name)
        r = {"rc": p.rc, "timed_out": p.timed_out, "seconds": round(p.seconds, 1),
             "said": [m.group(0) for pat in (AUTO_RESIDENT, REFUSED) for m in pat.finditer(p.log)],
             # llama_perf's lines: what the run cost per token, prompt and greedy tokens
             "prefill_tps": (lg.prompt_eval or {}).get("tokens_per_second"),
             "decode_tps": (lg.eval or {}).get("tokens_per_second")}
        res.results["runs"][name] = r
        return r

    local = dump_run("local-resident", [], _local_device(ctx), ["-krm", "resident"])
    if not res.check("local resident run", local["rc"] == 0, f"rc={local['rc']}"):
        return res
    node_env = env if ctx.gpu is not None else {**env, **STAND_IN}
    server_logs = [ctx.work / f"rpc-server-{i}.log" for i in range(NODES)]
    with RpcServer(server_bin, server_logs[0], node_env, res) as a, RpcServer(server_bin, server_logs[1], node_env,
                                                                              res) as b:
        endpoints = [a.endpoint, b.endpoint]
        remote = dump_run("rpc-resident", endpoints, DEVICES, ["-krm", "resident"])
        if res.check("resident over the RPC nodes runs", remote["rc"] == 0, f"rc={remote['rc']}"):
            _compare_checks(res, "resident over RPC vs local", ctx.work / "local-resident", ctx.work / "rpc-resident",
                            remote)
            targets = _tail_targets(res, dump_run, logs, endpoints, o.rpc_keep)
            if targets is not None:
                for mode in ("window", "auto"):
                    r = dump_run(f"rpc-{mode}", endpoints, DEVICES, ["-krm", mode, "--vram-target", targets])
                    _tail_checks(ctx, res, mode, r, logs[f"rpc-{mode}"])
    res.results["server_windows"] = [[m.group(0) for m in SERVER_WINDOW.finditer(p.read_text(errors="replace"))]
                                     for p in server_logs if p.exists()]
    if "rpc-window" in res.results["runs"]:
        res.check("each node's rpc-server allocated window buffers with a host tail",
                  all(any(int(m[3]) > 0 for m in map(SERVER_WINDOW.match, lines) if m)
                      for lines in res.results["server_windows"]),
                  "; ".join(f"node {i}: {lines[-1] if lines else 'no window buffer line'}"
                            for i, lines in enumerate(res.results["server_windows"])))
    _fault(ctx, res, dump, server_bin, model, prompt, env, node_env, split, res.results.get("vram_target"))
    return res


def _tail_targets(res: GateResult, dump_run: Any, logs: dict[str, logparse.LlamaLog], endpoints: list[str],
                  keep: float) -> str | None:
    """The --vram-target list that keeps `keep` of each node's KV on its device: each node's fixed part from a
    probe that stops at it (`no device memory left for the KV window on RPCi`, the others at 1 MiB or sized
    already), its KV and K/V tensors from the resident run. A node without KV gets 0 (its free memory)."""
    by_endpoint = kv_mib_by_endpoint(logs["rpc-resident"])
    kv = [by_endpoint.get(ep, 0.0) for ep in endpoints]
    caches = logs["rpc-resident"].kv_caches
    layers = max(c[2] for c in caches) if caches else 0
    total = sum(kv) or 1.0
    res.results["node_kv_mib"] = kv
    if not res.check("the resident run over the RPC nodes logs their KV buffers",
                     sum(1 for x in kv if x > 0) >= 1 and layers > 0, f"KV MiB per node {kv}, layers {layers}"):
        return None
    targets = ["1" if x > 0 else "0" for x in kv]
    fixed: dict[str, dict[str, float]] = {}
    # the engine sizes the nodes in its own order (its buffer types sorted by name): each probe names the node it
    # stopped at
    for i in range(sum(1 for x in kv if x > 0)):
        name = f"rpc-probe-{i}"
        probe = dump_run(name, endpoints, DEVICES, ["-krm", "window", "--vram-target", ",".join(targets)])
        nw = logs[name].no_window
        node = int(nw["device"][3:]) if nw is not None and nw["device"][3:].isdigit() else -1
        if not res.check(f"probe {i}: window mode stops at an RPC node not sized yet, with its fixed part",
                         probe["rc"] not in (0, None) and 0 <= node < len(kv) and targets[node] == "1",
                         f"rc={probe['rc']}, line={nw}, targets so far {','.join(targets)}"):
            return None
        part = sizing.Fixed(nw["device"], nw["model"], 0.0, nw["compute_reserve"], nw["margin"], "no-window line")
        fixed[part.device] = {"model": part.model, "compute_reserve": part.compute_reserve, "margin": part.margin}
        targets[node] = str(sizing.vram_target(part, keep * kv[node], round(2 * layers * kv[node] / total)))
    res.results["fixed_mib"] = fixed
    res.results["vram_target"] = ",".join(targets)
    return res.results["vram_target"]


def _tail_checks(ctx: GateContext, res: GateResult, mode: str, run: dict[str, Any], log: logparse.LlamaLog) -> None:
    """A run over the nodes at the tail targets: a host tail on every node with KV, reached by the prompt, and
    the logits of the local resident run and of resident over the same nodes."""
    if not res.check(f"{mode} over the RPC nodes with host tails runs", run["rc"] == 0,
                     f"rc={run['rc']}; " + "; ".join(run["said"])):
        return
    nodes = {w.device: w for w in log.windows if w.device and w.device.startswith("RPC")}
    run["windows"] = {d: {"cells_resident": w.cells_resident, "kv_size": w.kv_size, "host_tail_mib": w.host_tail_mib}
                      for d, w in sorted(nodes.items())}
    want = [f"RPC{i}" for i, x in enumerate(res.results.get("node_kv_mib", [])) if x > 0]
    cmp = _compare_checks(res, f"{mode} over RPC with host tails vs local resident", ctx.work / "local-resident",
                          ctx.work / f"rpc-{mode}", run)
    run["vs_rpc_resident"] = {}
    _compare_checks(res, f"{mode} over RPC with host tails vs resident over the same nodes", ctx.work / "rpc-resident",
                    ctx.work / f"rpc-{mode}", run["vs_rpc_resident"])
    n_prompt = int(cmp["n_prompt"][1] or 0)
    res.check(f"{mode}: a host tail on every RPC node that holds KV ({len(want)}), reached by the prompt "
              f"({n_prompt} tokens)",
              bool(want) and all(d in nodes and not nodes[d].fully_resident and nodes[d].cells_resident < n_prompt
                                 for d in want),
              "; ".join(f"{d}: {w.cells_resident} / {w.kv_size} cells on the device" for d, w in sorted(nodes.items()))
              or "no window line")


def _local_device(ctx: GateContext) -> str:
    """The local reference run's device: the GPU under test is the child's first CUDA device."""
    return "CUDA0" if ctx.gpu is not None else "none"


def _fault(ctx: GateContext, res: GateResult, dump: Path, server_bin: Path, model: str, prompt: Path,
           env: dict[str, str], node_env: dict[str, str], split: list[str], targets: str | None) -> None:
    """Two fresh nodes, the windows of the tail targets where they were found (resident KV otherwise); node 0 is
    killed a second into the prompt, and the client must stop within FAULT_LIMIT_S naming it."""
    o = ctx.options
    out: dict[str, Any] = {"killed": False, "rc": None, "stopped_after_s": None, "named": None,
                           "mode": "window" if targets else "resident"}
    res.results["fault"] = out
    log_path = ctx.work / "rpc-fault.log"
    residency = ["-krm", "window", "--vram-target", targets] if targets else ["-krm", "resident"]
    with RpcServer(server_bin, ctx.work / "rpc-server-fault-0.log", node_env, res) as node, \
            RpcServer(server_bin, ctx.work / "rpc-server-fault-1.log", node_env, res) as other:
        cmd = [str(x) for x in (dump, "-m", model, "-f", prompt, "-n", "16", "-c", o.rpc_ctx, "-fa", "on", "-ngl",
                                "99", *_kv_type(o), "--rpc", f"{node.endpoint},{other.endpoint}", "-dev", DEVICES,
                                *split,
                                *residency, "-b", FAULT_UBATCH, "-ub", FAULT_UBATCH, "--logits-out",
                                ctx.work / "rpc-fault")]
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
    out = [f"Nodes `{results.get('devices')}` (two rpc-servers on the GPU under test, loopback); "
           f"`{results.get('model')}`; --vram-target `{results.get('vram_target', '-')}` (keeps "
           f"{results.get('keep')} of each node's KV on its device).", "",
           "| run | rc | seconds | prefill t/s | decode t/s | windows (cells on the device / cells) | max abs diff | "
           "greedy tokens identical | what it said |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        cmp = r.get("compare") or {}
        said = "; ".join(r.get("said") or []).replace("|", "\\|")[:200]
        win = ", ".join(f"{d} {w['cells_resident']} / {w['kv_size']}" for d, w in (r.get("windows") or {}).items())
        out.append(f"| {name} | {r.get('rc')} | {r.get('seconds')} | {r.get('prefill_tps') or '-'} | "
                   f"{r.get('decode_tps') or '-'} | {win or '-'} | {cmp.get('max_abs_diff', '-')} | "
                   f"{cmp.get('tokens_equal', '-')} | {said or '-'} |")
    for i, lines in enumerate(results.get("server_windows") or []):
        out += ["", f"Node {i}: `{lines[-1]}`" if lines else f"Node {i}: no window buffer"]
    f = results.get("fault")
    if f:
        out += ["", f"Fault ({f.get('mode')} KV over two nodes): node 0 killed during the prompt: {f.get('killed')}; "
                    f"client rc {f.get('rc')} after {f.get('stopped_after_s')} s; "
                    f"`{f.get('named') or 'no line naming the node'}`"]
    return out


GATE = Gate(name=NAME, order=85, run=run, options=Options, report_rows=report_rows, binaries=BINARIES)
