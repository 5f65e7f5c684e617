"""boot-beyond: a context whose KV exceeds the free memory of every GPU under test together boots
in window mode, with a host tail on each device, and decodes.

Random Qwen2.5-14B-1M-shape Q8_0 model (the one boot-repro writes), f16 K/V, a context of the
smallest power of two whose KV is at least 1.2 x the GPUs' total memory (`--beyond-ctx` sets it):
2 097 152 cells (384 GiB) on two 141 GiB H200s, 1 048 576 (192 GiB) on one.
`llama-server -m M -c N -fa on --kv-residency-mode window -ctk f16 -ctv f16 -np 1 --kv-unified -lv 4`
without --vram-target (each device's budget is its free memory), every GPU under test visible: in
the all-GPU run (`--split-gpus`) the model is split by layers and every device sizes its own
window. The host tail is pinned as cells come into use (patch 0101), so the host's memory bounds
the cells a prompt can reach, not the boot. Only with LLAMA_KV_HOST_ON_DEMAND=0 (the tail pinned
at boot) does the gate skip, saying so, when the host's MemAvailable is below what the GPUs cannot
hold (the KV minus their free memory) + 10 %.

Checks: the server boots with n_ctx as asked; the KV (`llama_kv_cache: size`) exceeds the free
memory of the GPUs together (NVML, before the run); one window line with a host tail and one
budget line per GPU; the tail is pinned on demand: after the short completion less than 1 GiB of
it is pinned; a completion decodes (t/s > 0). The report keeps each device's window, compute
reserve and tail, and the tail reserved and pinned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollkv_dist.doctor import host_memory
from rollkv_dist.gates import logparse, sizing
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates.context import (LOG_ARGS, GateContext, GateResult, MiB, boot_timeout_option, ensure_random_model, model_option, n_predict_option, preflight)
from rollkv_dist.gates.llama_server import LlamaServer
from rollkv_dist.models import SHAPES

NAME = "boot-beyond"
BINARIES = ("llama-server",)
SHAPE = "qwen2.5-14b-1m"
OVER = 1.2  # the KV is at least this multiple of the GPUs' total memory
HOST_SLACK = 1.1
PINNED_AFTER_SHORT_MIB = 1024  # the tail pinned after a short completion, at most (one step of 0101 is <= 1 GiB)


@dataclass(frozen=True)
class Options:
    model: str | None = model_option()
    beyond_ctx: int | None = option("context (-c; default: the smallest power of two whose f16 KV is >= 1.2 x the "
                                    "GPUs' total memory)", None, metavar="N")
    boot_timeout: float = boot_timeout_option(1800.0)
    n_predict: int = n_predict_option()


def beyond_ctx(total_mib: float, mib_per_cell: float) -> int:
    """The smallest power of two of cells whose KV is at least OVER x total_mib."""
    return 2 ** math.ceil(math.log2(OVER * total_mib / mib_per_cell))


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    server = ctx.bin("llama-server")
    gpus = ctx.under_test
    per_cell = SHAPES[SHAPE].kv_bytes_per_cell(2.0) / MiB
    total = sum(g.memory_total for g in gpus) / MiB
    free = sum(g.memory_free for g in gpus) / MiB
    n_ctx = o.beyond_ctx or beyond_ctx(total, per_cell)
    kv = n_ctx * per_cell
    host = host_memory().get("available_mib")
    need = (kv - free) * HOST_SLACK
    res.results.update({"gpus": [g.uuid for g in gpus], "gpu_total_mib": round(total), "gpu_free_mib": round(free),
                        "n_ctx": n_ctx, "kv_mib_expected": kv, "host_available_mib": host,
                        "host_needed_mib": round(need)})
    eager = ctx.child_env().get("LLAMA_KV_HOST_ON_DEMAND") == "0"
    if eager and host is not None and host < need:
        res.verdict = "skip"
        res.notes.append(f"with LLAMA_KV_HOST_ON_DEMAND=0 the host tail of {n_ctx} cells is pinned at boot and needs "
                         f"about {need:.0f} MiB of host memory (the {kv:.0f} MiB KV beyond the GPUs' {free:.0f} MiB "
                         f"free, + 10 %); the host has {host} MiB available: unset it (the tail is then pinned as "
                         f"cells come into use), pass --beyond-ctx for a smaller context or run on a larger host")
        return res
    if not preflight(ctx, res, server, ("--kv-residency-mode",)):
        return res
    model = str(o.model or ensure_random_model(ctx, SHAPE, "q8_0"))
    args = ["-m", model, "-c", str(n_ctx), "-fa", "on", "--kv-residency-mode", "window", "-ctk", "f16", "-ctv", "f16",
            "-np", "1", "--kv-unified", *LOG_ARGS]
    srv = LlamaServer(server, args, ctx.work / "server.log", env=ctx.child_env(), boot_timeout=o.boot_timeout,
                      result=res)
    completion: dict[str, Any] = {}
    with srv:
        if srv.booted:
            content, t = logparse.parse_completion(srv.completion("The quick brown fox jumps over the lazy dog.",
                                                                  n_predict=o.n_predict))
            completion = {"content": content[:200], "timings": None if t is None else t.__dict__}
    log = srv.parsed()
    recs = sizing.device_records(log)
    kv_logged = log.kv_mib_largest_cache
    reserved = sum(t["reserved_mib"] for t in log.host_tails)
    pinned = sum(t["pinned_mib"] for t in log.host_tails) + sum(g["mib"] for g in log.host_tail_grows)
    res.results.update({"model": model, "booted": srv.booted, "exit_code": srv.exit_code,
                        "boot_seconds": None if srv.boot_seconds is None else round(srv.boot_seconds, 1),
                        "kv_mib": kv_logged, "devices": recs, "completion": completion,
                        "host_tail_reserved_mib": reserved, "host_tail_pinned_mib": pinned})
    if not res.check("the server boots", srv.booted, f"exit={srv.exit_code}; log {srv.log_path}"):
        return res
    res.check(f"n_ctx is {n_ctx}", log.n_ctx == n_ctx, f"n_ctx={log.n_ctx}")
    res.check("the KV exceeds the free memory of the GPUs together", kv_logged is not None and kv_logged > free,
              f"KV {kv_logged} MiB, free {free:.0f} MiB on {len(gpus)} GPU(s)")
    res.check(f"a window with a host tail on every GPU ({len(gpus)})",
              len(recs) == len(gpus) and all(not r["fully_resident"] for r in recs),
              "; ".join(f"{r['device']}: {r['cells_resident']} / {r['kv_size']}" for r in recs) or "no window line")
    res.check("one budget line per GPU", len({b["device"] for b in log.budgets}) == len(gpus),
              f"budget lines for {sorted({b['device'] for b in log.budgets})}")
    if not eager:
        res.check(f"the host tail is pinned on demand (< {PINNED_AFTER_SHORT_MIB} MiB pinned after a short completion)",
                  bool(log.host_tails) and all(t["on_demand"] for t in log.host_tails)
                  and pinned < PINNED_AFTER_SHORT_MIB,
                  f"{reserved:.0f} MiB reserved, {pinned:.0f} MiB pinned ({len(log.host_tails)} tails)")
    t = completion.get("timings") or {}
    res.check("a completion decodes (t/s > 0)", t.get("predicted_n", 0) > 0 and t.get("predicted_per_second", 0) > 0,
              f"timings={t}")
    return res


def report_rows(r: dict[str, Any]) -> list[str]:
    out = [f"- {r.get('n_ctx')} cells, KV {r.get('kv_mib')} MiB against {r.get('gpu_free_mib')} MiB free on "
           f"{len(r.get('gpus') or [])} GPU(s) ({r.get('gpu_total_mib')} MiB in all); healthy after "
           f"{r.get('boot_seconds')} s"]
    if r.get("host_tail_reserved_mib") is not None:
        out.append(f"- host tail {r['host_tail_reserved_mib']:.0f} MiB reserved, {r.get('host_tail_pinned_mib', 0):.0f} "
                   "MiB pinned after the completion")
    if r.get("devices"):
        out += ["", *sizing.device_table(r["devices"])]
    return out


GATE = Gate(name=NAME, order=25, run=run, options=Options, report_rows=report_rows, binaries=BINARIES,
            multi_gpu=True)
