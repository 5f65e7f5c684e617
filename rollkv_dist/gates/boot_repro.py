"""boot-repro: the seed's configuration on an emulated smaller card.

Random Qwen2.5-14B-1M-shape Q8_0 model, `llama-server -c 524288 -b 4096 -ub 4096 -fa on
--kv-residency-mode window --vram-target 88000 -ctk f16 -ctv f16 -np 1 --kv-unified` (default
`--fit` left on; n_ctx read back from the log proves it did not shrink the context), with a
ballast holding device memory so that only `--emulate-vram` MiB stay free.

Cases:
- baseline (the series before 0089, `rollkv source --before`): must fail in graph_reserve (fixed 1536 MiB reserve is too small
  at ubatch 4096);
- full: boots, window line with a host tail, two-pass lines, a completion decodes (t/s > 0);
  the measured compute buffer is recorded beside the seed's 3 800 045 568 B;
- resident-fit: -c 32768 in window mode: FULLY RESIDENT and "single pass";
- default-ubatch: default -b/-ub at -c 524288: the measured reserve gives a larger window than
  `--kv-compute-reserve 1536`.

Free memory: with --vram-target T the window is sized to T MiB; the baseline then needs about
T - 1536 + measured compute (~4984 MiB at ubatch 4096) on the device, the full build about T + a
few hundred MiB. The emulated free memory T + 2000 lies between the two, so the repro
discriminates. The figures were chosen on a 143 GB H200 for the seed's 96 GB card (90000 MiB free,
T = 88000): on a card at least that large they stay as they were (past reports stay comparable);
on a smaller card both scale with its total memory (card_figures), the 2000 MiB gap kept, so the
ballast still has memory to hold; a card too small for the 14B model, its compute buffer and a
window is a skip that says so. The ballast check asks that the ballast held memory and left the
emulated free memory to within 256 MiB (on a card with less free memory than that, it held
nothing and the check fails: the emulation did not happen). A real 96 GB card has ~97 GB free
(pass --emulate-vram 97000 to see what the baseline does there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollkv_dist.gates import logparse
from rollkv_dist.gates.base import BASELINE_BUILD, Gate, option
from rollkv_dist.gates.context import (LOG_ARGS, SEED_COMPUTE_BYTES, GateContext, GateResult, MiB, boot_timeout_option, ensure_random_model, model_option, n_predict_option, preflight)
from rollkv_dist.gates.llama_server import LlamaServer

NAME = "boot-repro"
BINARIES = ("llama-server",)  # of --build (and of --baseline-build when given)
N_CTX = 524288
# chosen on a 143 GB H200 for the seed's 96 GB card; card_figures scales them down on smaller cards
SEED_EMULATE_MIB, SEED_TARGET_MIB = 90000, 88000
SEED_CARD_MIB = 96 * 1024  # the seed's 96 GB card
# below this --vram-target the 14B Q8_0 model (~14.2 GiB), its ubatch-4096 compute buffer (~4.9 GiB)
# and a window of a useful share of its 96 GiB KV do not fit: the gate skips
MIN_TARGET_MIB = 32768
BALLAST_TOLERANCE_MIB = 256


def card_figures(total_mib: float, emulate: int | None = None, target: int | None = None) -> tuple[int, int]:
    """(emulated free MiB, --vram-target MiB) for a card of total_mib: the seed's figures on a card at
    least as large as the seed's, scaled by total / 96 GiB below that (the gap between the two kept);
    a figure given (--emulate-vram, --vram-target) wins and the other follows it."""
    gap = SEED_EMULATE_MIB - SEED_TARGET_MIB
    if emulate is None and target is None:
        emulate = int(SEED_EMULATE_MIB * min(1.0, total_mib / SEED_CARD_MIB))
    if emulate is None:
        emulate = int(target) + gap
    if target is None:
        target = int(emulate) - gap
    return int(emulate), int(target)


def server_args(model: str, n_ctx: int = N_CTX, vram_target: int = SEED_TARGET_MIB, ubatch: int | None = 4096,
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
    emulate_vram: int | None = option("free device memory the ballast leaves (MiB; default: 90000, scaled down on "
                                      "cards smaller than the seed's 96 GB one)", None, metavar="MiB")
    vram_target: int | None = option("--vram-target of the seed's command (MiB; default: the emulated free memory "
                                     "- 2000, 88000 on a large card)", None, metavar="MiB")
    model: str | None = model_option()
    boot_timeout: float = boot_timeout_option(600.0)
    n_predict: int = n_predict_option()


def run(ctx: GateContext) -> GateResult:
    from rollkv_dist.ballast import Ballast

    res, o = ctx.res, ctx.options
    total = None if ctx.gpu is None else ctx.gpu.memory_total // MiB
    emulate, target = card_figures(total or SEED_CARD_MIB, o.emulate_vram, o.vram_target)
    res.results.update({"card_total_mib": total, "emulate_vram_mib": emulate, "vram_target_mib": target})
    # the binaries first: the model is 15 GiB and takes minutes to write
    server = ctx.bin("llama-server")
    baseline_server = None if ctx.baseline_build is None else ctx.bin("llama-server", ctx.baseline_build)
    if o.emulate_vram is None and o.vram_target is None and target < MIN_TARGET_MIB:  # figures given: the user's call
        res.verdict = "skip"
        res.notes.append(f"the card is too small for the seed's configuration: {total} MiB in all gives an emulated "
                         f"{emulate} MiB free and --vram-target {target}, below {MIN_TARGET_MIB} MiB (the 14B model, "
                         f"its ubatch-4096 compute buffer and a window)")
        return res
    if not preflight(ctx, res, server, ("--kv-residency-mode", "--vram-target", "--kv-compute-reserve")):
        return res
    model = str(o.model or ensure_random_model(ctx, "qwen2.5-14b-1m", "q8_0"))
    res.results["model"] = model
    res.results["seed_compute_bytes"] = SEED_COMPUTE_BYTES
    with Ballast(emulate, env=ctx.child_env(), log_path=ctx.work / "ballast.log") as b:
        res.results["ballast"] = {"held_mib": b.held_mib, "free_mib": b.free_mib, "total_mib": b.total_mib}
        res.commands.append(" ".join(b.command()))
        res.check("ballast holds memory and leaves the emulated free memory",
                  bool(b.held_mib) and b.free_mib is not None and abs(b.free_mib - emulate) <= BALLAST_TOLERANCE_MIB,
                  f"free {b.free_mib} MiB after holding {b.held_mib} MiB (wanted {emulate} +- {BALLAST_TOLERANCE_MIB}; "
                  "a ballast that held nothing emulated nothing)")

        # baseline: the series before 0089
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
