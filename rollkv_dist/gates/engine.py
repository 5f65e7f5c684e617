"""engine: the window buffer's own checks at the ggml level (`llama-window-test`, patch 0012).

The other gates compare whole runs; this one runs the build's llama-window-test, which checks a
window buffer directly: granularity and refused segments, q8_0 rows read back byte for byte across
the device/host boundary (whole and in pieces), memset and clear across it, free, flash attention
over f16 and q8_0 K/V in a plain buffer, a window buffer and staged (bit-identical), and with two
or more devices a copy out of a window buffer into another device.

Runs:
- on the GPU under test (CUDA_VISIBLE_DEVICES=<its UUID>, like every child of the gates);
- when the machine has two or more GPUs, once more with all of them visible and GGML_CUDA_P2P=1,
  so peer access is on and the copies into the other devices read the window directly.

Then upstream's op suite with its tensors in window buffers (opsuite.py: test-backend-ops under patch 0094's
GGML_TEST_WINDOW, every op the KV cache and its K-shift use, sources and then outputs split at 0, 1/3, 1/2 and an
odd row count, and patch 0094's planted split fault, which must fail it).

Every `PASS`/`FAIL` line becomes a check named `<run>: <check>`; `SKIP` lines become notes, never
passes. Per run the gate fails when the program exits non-zero (or is killed, or times out),
prints a FAIL, prints no summary line, or its summary's failure count differs from its FAIL lines;
a run that found no device with window buffers tested nothing and fails too, and the all-GPU run
must have window buffers on two devices, run the peer copies and see GGML_CUDA_P2P. Lines that
start like check lines but lack their form are LogParseErrors (logparse.parse_window_test). A
missing program is a UsageError before any gate runs, like every gate's programs.
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollkv_dist import gpu as gpu_mod
from rollkv_dist.gates import logparse, opsuite
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates.context import GateContext, GateResult, preflight
from rollkv_dist.gates.process import ProcResult, run_logged

NAME = "engine"
PROGRAM = "llama-window-test"
BINARIES = (PROGRAM,)
TIMEOUT = 600.0  # s; the program allocates a few granules per device and runs six small graphs
SOLO = "GPU under test"
P2P = "all GPUs, GGML_CUDA_P2P=1"
PEER_COPY = "copy out of a window buffer into"  # the name of the peer-copy checks (patch 0012)
SHOWN_ENV = ("CUDA_VISIBLE_DEVICES", "GGML_CUDA_P2P")


@dataclass(frozen=True)
class Options:
    window_test_timeout: float = option("time limit of one llama-window-test run (s)", TIMEOUT, metavar="S")
    ops_suite: str | None = option("upstream's test-backend-ops (default: the build's, else built from --llama-tree "
                                   "for the build's variant)", None, metavar="PATH")
    ops_filter: str = option("comma list of the ops the op suite runs over window buffers", ",".join(opsuite.OPS))
    ops_places: str = option("comma list: what goes in window buffers (src: the sources, dst: the output)",
                             ",".join(opsuite.PLACES))
    ops_splits: str = option("comma list: where each tensor's device part ends (0, third, half, odd)",
                             ",".join(opsuite.SPLITS))
    ops_jobs: int = option("test-backend-ops worker threads (-j)", 8)
    ops_timeout: float = option("time limit of one test-backend-ops run (s)", 900.0, metavar="S")
    ops_skip: bool = option("leave the op suite out (llama-window-test only)", False)


def run(ctx: GateContext) -> GateResult:
    res = ctx.res
    wt = ctx.bin(PROGRAM)
    # the usage line names --device: the program starts (its libraries load) and is the right one
    if not preflight(ctx, res, wt, ("--device",)):
        return res
    res.results["runs"] = []
    solo_env = ctx.child_env()
    solo_env.pop("GGML_CUDA_P2P", None)  # peer access is the second run's business
    _run_once(ctx, res, wt, SOLO, "window-test", solo_env)
    if len(ctx.gpus) >= 2:
        env = gpu_mod.child_env(",".join(g.uuid for g in ctx.gpus), ctx.env)
        env["GGML_CUDA_P2P"] = "1"
        _run_once(ctx, res, wt, P2P, "window-test-p2p", env)
    else:
        res.notes.append(f"{len(ctx.gpus)} GPU(s) known on this machine: the peer-copy checks (a copy out of a "
                         "window buffer into another device, with GGML_CUDA_P2P=1) need two and did not run")
    if ctx.options.ops_skip:
        res.notes.append("--ops-skip: the op suite over window buffers did not run")
    else:
        opsuite.run(ctx, res)
    return res


def _exit_detail(p: ProcResult, timeout: float) -> str:
    if p.timed_out:
        return f"timed out after {timeout:.0f} s (the process group was killed)"
    if p.rc is not None and p.rc < 0:
        try:
            return f"killed by {signal.Signals(-p.rc).name} (rc={p.rc}); stderr: {p.stderr_path}"
        except ValueError:
            pass
    return f"rc={p.rc}; stderr: {p.stderr_path}"


def _run_once(ctx: GateContext, res: GateResult, wt: Path, label: str, log_name: str, env: dict[str, str]) -> None:
    """One run of llama-window-test with `env`; its lines become checks and notes prefixed with label."""
    timeout = ctx.options.window_test_timeout
    p = run_logged([wt], ctx.work / log_name, timeout, env=env, split_stderr=True, result=res, show_env=SHOWN_ENV)
    # stdout only: the check lines are printf'd there, ggml's log goes to stderr
    out = logparse.parse_window_test(p.stdout, source=str(p.stdout_path))
    fails = out.with_status("FAIL")
    rec: dict[str, Any] = {"run": label, "env": {k: env[k] for k in SHOWN_ENV if k in env}, "rc": p.rc,
                           "timed_out": p.timed_out, "seconds": round(p.seconds, 1),
                           "summary": None if out.summary is None else asdict(out.summary),
                           "counts": {s: len(out.with_status(s)) for s in logparse.WT_STATUSES},
                           "checks": [asdict(c) for c in out.checks],
                           "stdout": str(p.stdout_path), "stderr": str(p.stderr_path)}
    res.results["runs"].append(rec)
    res.check(f"{label}: {PROGRAM} exits 0", p.rc == 0 and not p.timed_out, _exit_detail(p, timeout))
    for c in out.checks:
        if c.status == "SKIP":
            res.notes.append(f"{label}: SKIP {c.name}: {c.detail}")
        else:
            res.check(f"{label}: {c.name}", c.status == "PASS", c.detail)
    s = out.summary
    if not res.check(f"{label}: summary line printed", s is not None,
                     f"no `window-test: N device(s) with window buffers, F failure(s)` line in {p.stdout_path}: "
                     f"the program stopped before its end ({len(out.checks)} check lines before that)"
                     if s is None else f"{s.devices} device(s) with window buffers, {s.failures} failure(s)"):
        return
    res.check(f"{label}: the summary's failure count equals the FAIL lines", s.failures == len(fails),
              f"summary says {s.failures}, {len(fails)} FAIL line(s)")
    if label == SOLO:
        res.check(f"{label}: window buffers on the GPU under test", s.devices >= 1,
                  f"{s.devices} device(s) with window buffers" + ("" if s.devices else ": nothing was tested (a "
                  "CPU-only build, or a backend without window buffers)"))
        return
    peer = [c for c in out.checks if PEER_COPY in c.name and c.status != "SKIP"]
    res.check(f"{label}: window buffers on >= 2 devices and peer copies checked", s.devices >= 2 and bool(peer),
              f"{s.devices} device(s) with window buffers, {len(peer)} peer-copy check(s) of {len(ctx.gpus)} GPUs")
    res.check(f"{label}: the program saw GGML_CUDA_P2P", s.p2p, "the summary lacks `(GGML_CUDA_P2P set)`")


def markdown(results: dict[str, Any]) -> list[str]:
    """Per run: its environment, exit status, the summary and the counts of PASS/FAIL/SKIP lines; then the op
    suite's table."""
    if not results.get("runs"):
        return opsuite.markdown(results)
    out = ["| run | environment | rc | devices with window buffers | PASS | FAIL | SKIP | summary failures |",
           "|---|---|---|---|---|---|---|---|"]
    for r in results.get("runs") or []:
        s, n = r.get("summary") or {}, r.get("counts") or {}
        env = " ".join(f"`{k}={v}`" for k, v in (r.get("env") or {}).items())
        rc = "timed out" if r.get("timed_out") else r.get("rc")
        out.append(f"| {r['run']} | {env} | {rc} | {s.get('devices', 'no summary')} | {n.get('PASS', 0)} | "
                   f"{n.get('FAIL', 0)} | {n.get('SKIP', 0)} | {s.get('failures', '-')} |")
    return out + opsuite.markdown(results)


GATE = Gate(name=NAME, order=10, run=run, options=Options, report_rows=markdown, binaries=BINARIES)
