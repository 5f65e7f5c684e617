"""GPU gates: real runs of the built binaries that a release must pass on a real GPU.

`rollkv gates --build PREFIX [--baseline-build PREFIX] [--upstream-build PREFIX] [--gates a,b]
[--gpu INDEX|UUID|all] [--work DIR] [--reports DIR] [--gemma PATH] [--llama-tree DIR]`

Runtime needs on the GPU host: python3 with numpy, requests, pynvml, matplotlib; the repo on
PYTHONPATH. No network, no nox.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .. import gpu as gpu_mod
from ..errors import GateFailure, UsageError
from ..models import SHAPES
from ..proc import STARTED_GROUPS, group_alive
from .common import GateContext, GateResult, find_bin

# gate name -> module (each has NAME and run(ctx, res) -> GateResult)
GATES: dict[str, str] = {
    "engine": "rollkv_dist.gates.engine",
    "boot-repro": "rollkv_dist.gates.boot_repro",
    "resident-parity": "rollkv_dist.gates.resident_parity",
    "needle": "rollkv_dist.gates.needle",
    "curve": "rollkv_dist.gates.curve",
    "speed": "rollkv_dist.gates.speed",
    "resident-ab": "rollkv_dist.gates.resident_ab",
}
DEFAULT_GATES = ("engine", "boot-repro", "resident-parity", "needle", "curve", "speed", "resident-ab")
# argparse destinations handed to the gates as ctx.options (None = the gate's default)
OPTION_KEYS = ("emulate_vram", "vram_target", "plant_failure", "needle_ctx", "needle_depths", "curve_depth",
               "curve_targets", "curve_fractions", "curve_shape", "curve_ubatch", "curve_staging", "curve_nkvo",
               "speed_depths", "kv_types", "speed_off_max_depth", "ubatch_sweep", "prefill_vs_resident_pct",
               "prefill_vs_nkvo", "decode_vs_link_pct", "f16_decode_floor_pct", "curve_decode_tolerance_pct",
               "reps", "ab_depths", "ab_rounds", "ab_tolerance_pct", "bench_timeout", "boot_timeout", "run_timeout")


def parse_gate_list(spec: str | None) -> list[str]:
    if not spec or spec == "all":
        return list(DEFAULT_GATES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in GATES]
    if bad:
        raise UsageError(f"unknown gate(s) {', '.join(bad)}; known: {', '.join(GATES)}")
    return names


def check_inputs(names: list[str], build: Path, baseline: Path | None = None, upstream: Path | None = None,
                 gemma: Path | None = None) -> None:
    """UsageError, before any gate runs or any model is written, for a build (or baseline /
    upstream build, or Gemma file) that is not there or lacks a program a selected gate runs."""
    for flag, prefix in (("--build", build), ("--baseline-build", baseline), ("--upstream-build", upstream)):
        if prefix is not None and not prefix.is_dir():
            raise UsageError(f"{flag} {prefix} {'is not a directory' if prefix.exists() else 'does not exist'}: "
                             f"pass the install prefix of a build made with `rollkv build`")
    if gemma is not None and not gemma.is_file():
        raise UsageError(f"--gemma {gemma} is not a file: pass the GGUF from `rollkv model gemma -o DIR`")
    for name in names:
        mod = importlib.import_module(GATES[name])
        for binary in mod.BINARIES:
            find_bin(build, binary)
            if name == "boot-repro" and baseline is not None:
                find_bin(baseline, binary)
            if name == "resident-ab" and upstream is not None:
                find_bin(upstream, binary)


def default_reports_dir(gpu: gpu_mod.GPUInfo | None, root: Path | None = None) -> Path:
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M")
    name = gpu.short_name if gpu else "nogpu"
    return (root or Path("reports")) / f"{date}-{name}"


def run_gate(name: str, ctx: GateContext) -> GateResult:
    """Run one gate; an exception becomes a failed check (the report is still written)."""
    mod = importlib.import_module(GATES[name])
    res = GateResult(gate=name, gpu=None if ctx.gpu is None else ctx.gpu.to_json())
    ctx.work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    first = len(STARTED_GROUPS)
    try:
        mod.run(ctx, res)
    except UsageError:
        raise
    except Exception as e:  # a crash of the gate is a failed gate, with the traceback in the report
        res.check("gate ran to completion", False, f"{type(e).__name__}: {e}")
        res.notes.append(traceback.format_exc()[-4000:])
    res.seconds = time.monotonic() - t0
    groups = STARTED_GROUPS[first:]
    if groups:
        left = [g for g in groups if group_alive(g)]
        res.check("no process left running (none holds GPU memory)", not left,
                  f"{len(groups)} process groups started, still alive: {left}")
    return res.finish()


def run_gates(names: list[str], gpus: list[gpu_mod.GPUInfo | None], *, build: Path, work: Path,
              reports: Path | None, probe: Any, baseline: Path | None = None, upstream: Path | None = None,
              llama_tree: Path | None = None,
              gemma: Path | None = None, options: dict[str, Any] | None = None,
              env: dict[str, str] | None = None, out: Any = None) -> tuple[list[dict[str, Any]], Path]:
    from . import report

    out = out or sys.stderr
    check_inputs(names, build, baseline, upstream, gemma)
    binfo = report.read_build_info(build)
    bbinfo = report.read_build_info(baseline)
    if llama_tree is None and binfo and binfo.get("source_dir"):
        cand = Path(binfo["source_dir"])
        if (cand / "gguf-py").is_dir():
            llama_tree = cand
    reports_dir = reports or default_reports_dir(gpus[0] if gpus else None)
    machine = list(getattr(probe, "gpus", None) or [g for g in gpus if g is not None])
    reps = []
    for g in gpus:
        for name in names:
            sub = work / f"gpu{'-' if g is None else g.index}" / name
            ctx = GateContext(build=build, work=sub, gpu=g, baseline_build=baseline, upstream_build=upstream,
                              llama_tree=llama_tree,
                              models_dir=work / "models", gemma=gemma, options=dict(options or {}), env=env,
                              gpus=machine)
            print(f"==> gate {name} on {'no GPU' if g is None else f'GPU {g.index} {g.name} {g.uuid}'}",
                  file=out, flush=True)
            res = run_gate(name, ctx)
            rep = report.gate_report(res, build=build, baseline=baseline, probe=probe, build_info=binfo,
                                     baseline_info=bbinfo)
            stem = f"{name}-gpu{'-' if g is None else g.index}"
            js, _ = report.write_gate(rep, reports_dir, stem)
            failed = [c.name for c in res.checks if not c.ok]
            print(f"    {res.verdict.upper()} in {res.seconds:.0f} s -> {js}"
                  + (f"; failed: {'; '.join(failed)}" if failed else ""), file=out, flush=True)
            reps.append(rep)
    report.write_summary(reps, reports_dir)
    return reps, reports_dir


def _cmd(args: Any) -> int:
    names = parse_gate_list(args.gates)
    paths = {k: None if getattr(args, k) is None else Path(getattr(args, k)).resolve()
             for k in ("build", "baseline_build", "upstream_build", "gemma")}
    check_inputs(names, paths["build"], paths["baseline_build"], paths["upstream_build"], paths["gemma"])
    probe = gpu_mod.probe()
    gpus = probe.select(args.gpu)  # NoGPUError with NVML's reason when there is none
    options = {k: getattr(args, k) for k in OPTION_KEYS}
    reps, rdir = run_gates(
        names, list(gpus), build=Path(args.build).resolve(), work=Path(args.work).resolve(),
        reports=None if args.reports is None else Path(args.reports).resolve(), probe=probe,
        baseline=None if args.baseline_build is None else Path(args.baseline_build).resolve(),
        upstream=None if args.upstream_build is None else Path(args.upstream_build).resolve(),
        llama_tree=None if args.llama_tree is None else Path(args.llama_tree).resolve(),
        gemma=None if args.gemma is None else Path(args.gemma).resolve(), options=options)
    failed = [f"{r['gate']} ({(r.get('gpu') or {}).get('uuid')})" for r in reps if r["verdict"] == "fail"]
    print(f"reports: {rdir}")
    if failed:
        raise GateFailure(f"gate(s) failed: {', '.join(failed)}; see {rdir}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("gates", help="run the GPU gates against a build", description=__doc__)
    p.add_argument("--build", required=True, metavar="PREFIX", help="install prefix of the full series build")
    p.add_argument("--baseline-build", metavar="PREFIX",
                   help="build of the series without 0089 (boot-repro expects it to fail in graph_reserve)")
    p.add_argument("--upstream-build", metavar="PREFIX",
                   help="build of the pin with no patch (resident-ab compares resident t/s against it)")
    p.add_argument("--gates", default="all", help=f"comma list of {', '.join(GATES)} (default all)")
    p.add_argument("--gpu", default=None, help="INDEX, UUID or 'all' (default: the first GPU)")
    p.add_argument("--work", default=".work/gates", help="scratch: models, logs, logits (default .work/gates)")
    p.add_argument("--reports", default=None, help="reports dir (default reports/<date>-<gpu>/)")
    p.add_argument("--gemma", default=None, help="Gemma 3 270M GGUF for the needle gate")
    p.add_argument("--llama-tree", default=None, help="llama.cpp source tree (gguf-py, vocab) to write models")
    p.add_argument("--emulate-vram", type=int, default=None, metavar="MiB",
                   help="boot-repro: free device memory left by the ballast (default 90000)")
    p.add_argument("--vram-target", type=int, default=None, metavar="MiB", help="boot-repro: default 88000")
    p.add_argument("--plant-failure", action="store_true", help="needle: expect a wrong key (the gate must fail)")
    p.add_argument("--needle-ctx", type=int, default=None, help="needle: context (default 12288)")
    p.add_argument("--needle-depths", default=None, help="needle: depths inside the tail (default 0.3,0.6,0.9)")
    p.add_argument("--curve-depth", type=int, default=None, help="curve: depth (default 16384)")
    p.add_argument("--curve-targets", default=None, help="curve: extra --vram-target points (MiB, comma list)")
    p.add_argument("--curve-fractions", default=None,
                   help="curve: points at the engine's fixed part + these fractions of the KV "
                        "(default 1.0,0.9,0.75,0.6,0.5,0.4,0.3,0.2,0.1)")
    p.add_argument("--curve-shape", default=None, choices=sorted(SHAPES),
                   help="curve: random model shape (default qwen2-1.5b; qwen2.5-14b-1m = the seed's model)")
    p.add_argument("--curve-ubatch", type=int, default=None, metavar="N",
                   help="curve: -ub N -b max(N, 2048) and a prompt of max(512, N) tokens (default: llama-bench's 512)")
    p.add_argument("--curve-staging", default=None, choices=("off,auto", "auto"), metavar="off,auto|auto",
                   help="curve: tail staging per point, before and after side by side (default off,auto)")
    p.add_argument("--curve-no-nkvo", dest="curve_nkvo", action="store_false", default=None,
                   help="curve: skip the -nkvo anchor run (slow on large models)")
    p.add_argument("--speed-depths", default=None, help="speed: depths (default 16384,65536)")
    p.add_argument("--kv-types", default=None, help="speed: K/V types, -ctk T -ctv T (default f16,q8_0)")
    p.add_argument("--speed-off-max-depth", type=int, default=None, metavar="D",
                   help="speed: largest depth at which -kts off (before) runs beside auto (default 16384)")
    p.add_argument("--ubatch-sweep", default=None, metavar="LIST",
                   help="speed: window prefill per ubatch at depth 16384, f16 K/V, -kts auto "
                        "(default 512,1024,2048,4096; 'none' skips it)")
    p.add_argument("--prefill-vs-resident", dest="prefill_vs_resident_pct", type=float, default=None, metavar="PCT",
                   help="speed, curve: window (auto) prefill goal in %% of resident (default 70)")
    p.add_argument("--prefill-vs-nkvo", type=float, default=None, metavar="X",
                   help="speed: window (auto) prefill goal as a multiple of -nkvo (default 2)")
    p.add_argument("--decode-vs-link", dest="decode_vs_link_pct", type=float, default=None, metavar="PCT",
                   help="speed: quantized-KV window (auto) decode goal in %% of the link bound (default 85)")
    p.add_argument("--f16-decode-floor", dest="f16_decode_floor_pct", type=float, default=None, metavar="PCT",
                   help="speed: f16 window decode with auto in %% of zero-copy (off) (default 97)")
    p.add_argument("--curve-decode-tolerance", dest="curve_decode_tolerance_pct", type=float, default=None,
                   metavar="PCT", help="curve: decode within PCT %% of the link-rate line (default 10)")
    p.add_argument("--ab-depths", default=None, help="resident-ab: depths (default 0,16384,65536)")
    p.add_argument("--ab-rounds", type=int, default=None,
                   help="resident-ab: rounds, alternating which build runs first (default 2)")
    p.add_argument("--ab-tolerance", dest="ab_tolerance_pct", type=float, default=None, metavar="PCT",
                   help="resident-ab: build-to-build floor of the noise band (default 2 %%)")
    p.add_argument("--reps", type=int, default=None, help="llama-bench repetitions (default 3)")
    p.add_argument("--bench-timeout", type=float, default=None, metavar="S",
                   help="time limit of one llama-bench run (default 600)")
    p.add_argument("--boot-timeout", type=float, default=None, metavar="S",
                   help="time limit for llama-server to become healthy (default 600 boot-repro, 300 needle)")
    p.add_argument("--run-timeout", type=float, default=None, metavar="S",
                   help="time limit of one llama-logits-dump run (default 900)")
    p.set_defaults(handler=_cmd)
