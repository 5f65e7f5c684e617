"""boot-repro: the seed's configuration on an emulated smaller card.

Random Qwen2.5-14B-1M-shape Q8_0 model, `llama-server -c 524288 -b 4096 -ub 4096 -fa on
--kv-residency-mode window --vram-target 88000 -ctk f16 -ctv f16 -np 1 --kv-unified` (default
`--fit` left on; n_ctx read back from the log proves it did not shrink the context), with a
ballast holding device memory so that only `--emulate-vram` MiB stay free.

Cases:
- baseline (series without 0089): must fail in graph_reserve (fixed 1536 MiB reserve is too small
  at ubatch 4096);
- full: boots, window line with a host tail, two-pass lines, a completion decodes (t/s > 0);
  the measured compute buffer is recorded beside the seed's 3 800 045 568 B;
- resident-fit: -c 32768 in window mode: FULLY RESIDENT and "single pass";
- default-ubatch: default -b/-ub at -c 524288: the measured reserve gives a larger window than
  `--kv-compute-reserve 1536`.

Free memory: with --vram-target 88000 the window is sized to 88000 MiB; the baseline then needs
about 88000 - 1536 + measured compute (~4984 MiB at ubatch 4096) on the device, the full build
about 88000 + a few hundred MiB. The default emulated free memory (90000 MiB) lies between the
two, so the repro discriminates; a real 96 GB card has ~97 GB free (pass --emulate-vram 97000
to see what it does there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollkv_dist.gates import logparse
from rollkv_dist.gates.base import BASELINE_BUILD, Gate, option
from rollkv_dist.gates.common import (LOG_ARGS, SEED_COMPUTE_BYTES, GateContext, GateResult, LlamaServer, MiB,
                                      boot_timeout_option, ensure_random_model, model_option, preflight)

NAME = "boot-repro"
BINARIES = ("llama-server",)  # of --build (and of --baseline-build when given)
DEFAULT_EMULATE_MIB = 90000
N_CTX = 524288


def server_args(model: str, n_ctx: int = N_CTX, vram_target: int = 88000, ubatch: int | None = 4096,
                extra: list[str] | None = None) -> list[str]:
    a = ["-m", model, "-c", str(n_ctx)]
    if ubatch:
        a += ["-b", str(ubatch), "-ub", str(ubatch)]
    a += ["-fa", "on", "--kv-residency-mode", "window", "--vram-target", str(vram_target),
          "-ctk", "f16", "-ctv", "f16", "-np", "1", "--kv-unified", *LOG_ARGS]
    return a + (extra or [])


def _summary(log: logparse.LlamaLog) -> dict[str, Any]:
    w = log.window
    r = log.reserve
    return {
        "n_ctx": log.n_ctx, "n_batch": log.n_batch, "n_ubatch": log.n_ubatch,
        "offloaded_layers": log.offloaded_layers,
        "window": None if w is None else {**w.__dict__, "tail_fraction": round(w.tail_fraction, 4)},
        "windows": [x.__dict__ for x in log.windows],
        "compute_buffers_mib": log.compute_buffers,
        "model_buffers_mib": log.model_buffers, "kv_buffers_mib": log.kv_buffers,
        "reserve": r.__dict__, "graph_reserve_failed": log.graph_reserve_failed,
        "context_failed": log.context_failed, "oom_lines": log.oom_lines[:5],
    }


def _boot(ctx: GateContext, res: GateResult, label: str, binary: Any, args: list[str],
          complete: bool = False) -> tuple[LlamaServer, logparse.LlamaLog, dict[str, Any]]:
    srv = LlamaServer(binary, args, ctx.work / f"{label}.log", env=ctx.child_env(),
                      boot_timeout=ctx.options.boot_timeout, result=res)
    out: dict[str, Any] = {}
    with srv:
        out["booted"] = srv.booted
        out["boot_seconds"] = None if srv.boot_seconds is None else round(srv.boot_seconds, 2)
        if srv.booted and complete:
            from rollkv_dist.gates.logparse import parse_completion

            resp = srv.completion("The quick brown fox jumps over the lazy dog. Once upon a time",
                                  n_predict=ctx.options.n_predict)
            content, t = parse_completion(resp)
            out["completion"] = {"content": content[:200], "timings": None if t is None else t.__dict__}
    out["exit_code"] = srv.exit_code
    log = srv.parsed()
    out.update(_summary(log))
    return srv, log, out


@dataclass(frozen=True)
class Options:
    emulate_vram: int | None = option("free device memory the ballast leaves (MiB)", DEFAULT_EMULATE_MIB,
                                      metavar="MiB")
    vram_target: int | None = option("--vram-target of the seed's command (MiB)", 88000, metavar="MiB")
    model: str | None = model_option()
    boot_timeout: float = boot_timeout_option(600.0)
    n_predict: int = option("tokens the completion decodes", 64)


def run(ctx: GateContext) -> GateResult:
    from rollkv_dist.ballast import Ballast

    res, o = ctx.res, ctx.options
    emulate = int(o.emulate_vram)
    target = int(o.vram_target)
    # the binaries first: the model is 15 GiB and takes minutes to write
    server = ctx.bin("llama-server")
    baseline_server = None if ctx.baseline_build is None else ctx.bin("llama-server", ctx.baseline_build)
    if not preflight(ctx, res, server, ("--kv-residency-mode", "--vram-target", "--kv-compute-reserve")):
        return res
    model = str(o.model or ensure_random_model(ctx, "qwen2.5-14b-1m", "q8_0"))
    res.results["model"] = model
    res.results["emulate_vram_mib"] = emulate
    res.results["seed_compute_bytes"] = SEED_COMPUTE_BYTES
    with Ballast(emulate, env=ctx.child_env(), log_path=ctx.work / "ballast.log") as b:
        res.results["ballast"] = {"held_mib": b.held_mib, "free_mib": b.free_mib, "total_mib": b.total_mib}
        res.commands.append(" ".join(b.command()))
        res.check("ballast leaves the emulated free memory", b.free_mib is not None and b.free_mib <= emulate + 256,
                  f"free {b.free_mib} MiB after holding {b.held_mib} MiB (wanted {emulate})")

        # baseline: series without 0089
        if baseline_server is not None:
            _, log, out = _boot(ctx, res, "baseline", baseline_server,
                                server_args(model, vram_target=target))
            res.results["baseline"] = out
            res.check("baseline fails in graph_reserve", not out["booted"] and log.graph_reserve_failed,
                      f"booted={out['booted']}, graph_reserve_failed={log.graph_reserve_failed}, "
                      f"exit={out['exit_code']}")
            res.check("baseline kept n_ctx (fit did not shrink it)", log.n_ctx in (None, N_CTX),
                      f"n_ctx={log.n_ctx}")
        else:
            res.notes.append("baseline case skipped: no --baseline-build given")

        # full series
        _, log, out = _boot(ctx, res, "full", server, server_args(model, vram_target=target), complete=True)
        res.results["full"] = out
        w = log.window
        res.check("full build boots", out["booted"], f"exit={out['exit_code']}")
        res.check("n_ctx is 524288 (fit did not shrink the context)", log.n_ctx == N_CTX, f"n_ctx={log.n_ctx}")
        if log.offloaded_layers:
            a, b_ = log.offloaded_layers
            res.check("all layers on the GPU (fit did not move layers)", a == b_, f"offloaded {a}/{b_}")
        res.check("window line with a host tail", w is not None and not w.fully_resident and w.host_tail_mib > 0,
                  f"window={None if w is None else w.__dict__}")
        res.check("two-pass reserve ran", log.reserve.two_pass and log.reserve.pass2_ms is not None,
                  f"reserve={log.reserve.__dict__}")
        t = (out.get("completion") or {}).get("timings") or {}
        res.check("completion decodes tokens (t/s > 0)",
                  t.get("predicted_n", 0) > 0 and t.get("predicted_per_second", 0) > 0,
                  f"timings={t}")
        measured = log.reserve.pass1_measured_mib or log.compute_mib("CUDA0")
        res.results["measured_compute_mib"] = measured
        res.results["measured_compute_bytes"] = None if measured is None else int(measured * MiB)
        res.results["seed_compute_mib"] = round(SEED_COMPUTE_BYTES / MiB, 2)
        res.results["boot_ms"] = {"pass1": log.reserve.pass1_ms, "pass2": log.reserve.pass2_ms,
                                  "server_health_s": out["boot_seconds"]}

        # resident fit: small context in window mode
        _, log, out = _boot(ctx, res, "resident-fit", server, server_args(model, n_ctx=32768, vram_target=target))
        res.results["resident_fit"] = out
        w = log.window
        res.check("resident-fit: FULLY RESIDENT", out["booted"] and w is not None and w.fully_resident,
                  f"booted={out['booted']}, window={None if w is None else w.__dict__}")
        res.check("resident-fit: single pass", log.reserve.single_pass and not log.reserve.two_pass,
                  f"reserve={log.reserve.__dict__}")

        # default ubatch: measured reserve vs fixed 1536
        _, lm, om = _boot(ctx, res, "default-ubatch-measured", server,
                          server_args(model, vram_target=target, ubatch=None))
        _, lf, of = _boot(ctx, res, "default-ubatch-fixed1536", server,
                          server_args(model, vram_target=target, ubatch=None, extra=["--kv-compute-reserve", "1536"]))
        res.results["default_ubatch"] = {"measured": om, "fixed_1536": of}
        wm, wf = lm.window, lf.window
        res.check("default-ubatch: both boot", om["booted"] and of["booted"])
        res.check("default-ubatch: measured reserve < 1536 MiB",
                  lm.reserve.pass1_measured_mib is not None and lm.reserve.pass1_measured_mib < 1536,
                  f"measured={lm.reserve.pass1_measured_mib}")
        res.check("default-ubatch: measured reserve gives a larger window than --kv-compute-reserve 1536",
                  wm is not None and wf is not None and wm.cells_resident > wf.cells_resident,
                  f"C measured={None if wm is None else wm.cells_resident}, "
                  f"C fixed={None if wf is None else wf.cells_resident}")
    return res


def report_rows(r: dict[str, Any]) -> list[str]:
    full = r.get("full") or {}
    return [f"- measured CUDA0 compute buffer: {r.get('measured_compute_bytes')} B "
            f"({r.get('measured_compute_mib')} MiB) vs the seed's {r.get('seed_compute_bytes')} B",
            f"- boot: pass 1 {(r.get('boot_ms') or {}).get('pass1')} ms, pass 2 "
            f"{(r.get('boot_ms') or {}).get('pass2')} ms, healthy after {full.get('boot_seconds')} s",
            f"- n_ctx {full.get('n_ctx')}, window {full.get('window')}"]


GATE = Gate(name=NAME, order=20, run=run, options=Options, report_rows=report_rows, binaries=BINARIES,
            needs=(BASELINE_BUILD,))
