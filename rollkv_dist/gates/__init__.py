"""GPU gates: real runs of the built binaries that a release must pass on a real GPU.

`rollkv gates --build PREFIX [--baseline-build PREFIX] [--upstream-build PREFIX] [--gates a,b]
[--gpu INDEX|UUID|all] [--split-gpus] [--work DIR] [--reports DIR] [--gemma PATH] [--llama-tree DIR]
[gate options]`

Each gate is a module of this package with a GATE (rollkv_dist/gates/base.py says what it holds);
its options dataclass makes its flags below.

Runtime needs on the GPU host: python3 with numpy, requests, pynvml, matplotlib; the repo on
PYTHONPATH. No network, no nox.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import time
import traceback
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rollkv_dist.commands import add_command
from rollkv_dist import gpu as gpu_mod
from rollkv_dist import log
from rollkv_dist.errors import GateFailure, UsageError
from rollkv_dist.proc import STARTED_GROUPS, group_alive
from rollkv_dist.gates import report
from rollkv_dist.gates.base import (BASELINE_BUILD, UPSTREAM_BUILD, add_option_flags, check_option_names, get,
                                    option_values, registry)
from rollkv_dist.gates.common import GateContext, GateResult, find_bin, read_build_info


def parse_gate_list(spec: str | None) -> list[str]:
    gates = registry()
    if not spec or spec == "all":
        return list(gates)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in gates]
    if bad:
        raise UsageError(f"unknown gate(s) {', '.join(bad)}; known: {', '.join(gates)}")
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
    extra = {BASELINE_BUILD: baseline, UPSTREAM_BUILD: upstream}
    for name in names:
        gate = get(name)
        for binary in gate.binaries:
            find_bin(build, binary)
            for need in gate.needs:
                if extra.get(need) is not None:
                    find_bin(extra[need], binary)


def default_reports_dir(gpu: gpu_mod.GPUInfo | None, root: Path | None = None) -> Path:
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M")
    name = gpu.short_name if gpu else "nogpu"
    return (root or Path("reports")) / f"{date}-{name}"


def run_gate(name: str, ctx: GateContext) -> GateResult:
    """Run one gate; an exception becomes a failed check (the report is still written).

    ctx.options may be a mapping of option values (None = the gate's default): the gate gets its
    options dataclass made from it (a name no gate has, or a value of the wrong type, is a
    UsageError). ctx itself is left as it was."""
    gate = get(name)
    options = gate.make_options(ctx.options) if isinstance(ctx.options, Mapping) else ctx.options
    under = ctx.under_test or ([] if ctx.gpu is None else [ctx.gpu])
    res = GateResult(gate=name, gpu=None if ctx.gpu is None else ctx.gpu.to_json(),
                     gpus=[g.to_json() for g in under] if len(under) > 1 else None)
    ctx = replace(ctx, options=options, result=res, under_test=under)
    if ctx.split and not gate.multi_gpu:
        res.verdict = "skip"
        res.notes.append(f"{name} has no all-GPU entry (every GPU in one process, layer split): it runs per GPU "
                         "(a check of its own across GPUs, like engine's GGML_CUDA_P2P run, is part of those runs)")
        return res.finish()
    ctx.work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    first = len(STARTED_GROUPS)
    try:
        gate.run(ctx)
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


def _skipped(name: str, gpus: list[gpu_mod.GPUInfo | None], why: str) -> GateResult:
    res = GateResult(gate=name, gpu=None if not gpus or gpus[0] is None else gpus[0].to_json(), verdict="skip")
    res.notes.append(why)
    return res.finish()


def run_gates(names: list[str], gpus: list[gpu_mod.GPUInfo | None], *, build: Path, work: Path,
              reports: Path | None, probe: Any, baseline: Path | None = None, upstream: Path | None = None,
              llama_tree: Path | None = None, gemma: Path | None = None, options: dict[str, Any] | None = None,
              env: dict[str, str] | None = None, split: bool = False) -> tuple[list[dict[str, Any]], Path]:
    """Run the gates `names` on each GPU of `gpus` in turn, or with split=True once with all of them
    visible to every child (layer split; gates without an all-GPU run skip, and so does every
    gate when fewer than two GPUs are given). Reports go to `reports` (default reports/<date>-<gpu>/)."""
    options = dict(options or {})
    check_option_names(options)
    check_inputs(names, build, baseline, upstream, gemma)
    binfo = read_build_info(build)
    bbinfo = read_build_info(baseline)
    if llama_tree is None and binfo and binfo.get("source_dir"):
        cand = Path(binfo["source_dir"])
        if (cand / "gguf-py").is_dir():
            llama_tree = cand
    reports_dir = reports or default_reports_dir(gpus[0] if gpus else None)
    machine = list(getattr(probe, "gpus", None) or [g for g in gpus if g is not None])
    units = [list(gpus)] if split else [[g] for g in gpus]
    engine_env = report.engine_environment(env)  # what every child below runs with
    reps = []
    for unit in units:
        real = [g for g in unit if g is not None]
        tag = ("gpus" + "+".join(str(g.index) for g in real)) if split else f"gpu{real[0].index if real else '-'}"
        where = (f"GPUs {', '.join(str(g.index) for g in real)} together (layer split)" if split else
                 f"GPU {real[0].index} {real[0].name} {real[0].uuid}" if real else "no GPU")
        for name in names:
            log.info(f"==> gate {name} on {where}")
            if split and len(real) < 2:
                res = _skipped(name, unit, f"an all-GPU run needs two or more GPUs; {len(real)} given")
            else:
                ctx = GateContext(build=build, work=work / tag / name, gpu=unit[0], baseline_build=baseline,
                                  upstream_build=upstream, llama_tree=llama_tree, models_dir=work / "models",
                                  gemma=gemma, options=options, env=env, gpus=machine, under_test=real)
                res = run_gate(name, ctx)
            rep = report.gate_report(res, build=build, baseline=baseline, probe=probe, build_info=binfo,
                                     baseline_info=bbinfo, environment=engine_env)
            js, _ = report.write_gate(rep, reports_dir, f"{name}-{tag}")
            failed = [c.name for c in res.checks if not c.ok]
            log.info(f"    {res.verdict.upper()} in {res.seconds:.0f} s -> {js}"
                     + (f"; failed: {'; '.join(failed)}" if failed else ""))
            reps.append(rep)
    report.write_summary(reps, reports_dir)
    return reps, reports_dir


def _cmd(args: Any) -> int:
    names = parse_gate_list(args.gates)
    options = option_values(args)
    check_option_names(options)
    paths = {k: None if getattr(args, k) is None else Path(getattr(args, k)).resolve()
             for k in ("build", "baseline_build", "upstream_build", "gemma", "llama_tree", "reports")}
    check_inputs(names, paths["build"], paths["baseline_build"], paths["upstream_build"], paths["gemma"])
    probe = gpu_mod.probe()
    gpus = probe.select(args.gpu if args.gpu is not None or not args.split_gpus else "all")  # NoGPUError if none
    reps, rdir = run_gates(
        names, list(gpus), build=paths["build"], work=Path(args.work).resolve(), reports=paths["reports"],
        probe=probe, baseline=paths["baseline_build"], upstream=paths["upstream_build"],
        llama_tree=paths["llama_tree"], gemma=paths["gemma"], options=options, split=args.split_gpus)
    failed = [f"{r['gate']} ({(r.get('gpu') or {}).get('uuid')})" for r in reps if r["verdict"] == "fail"]
    print(f"reports: {rdir}")
    if failed:
        raise GateFailure(f"gate(s) failed: {', '.join(failed)}; see {rdir}")
    return 0


def register(subparsers: Any) -> None:
    gates = registry()
    p = add_command(subparsers, "gates", "run the GPU gates against a build", __doc__, _cmd,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", required=True, metavar="PREFIX", help="install prefix of the full series build")
    p.add_argument("--baseline-build", metavar="PREFIX",
                   help="build of the series without its compute-reserve patch (boot-repro expects it to fail in "
                        "graph_reserve)")
    p.add_argument("--upstream-build", metavar="PREFIX",
                   help="build of the pin with no patch (resident-ab compares resident t/s against it)")
    p.add_argument("--gates", default="all", help=f"comma list of {', '.join(gates)} (default all)")
    p.add_argument("--gpu", default=None, help="INDEX, UUID, a comma list of them, or 'all': each in turn "
                                               "(default: the first GPU; with --split-gpus: all)")
    p.add_argument("--split-gpus", action="store_true",
                   help="one run with the selected GPUs (two or more) visible together, the model split by layers "
                        f"(gates with such a run: {', '.join(n for n, g in gates.items() if g.multi_gpu)}; the "
                        "others skip)")
    p.add_argument("--work", default=".work/gates", help="scratch: models, logs, logits (default .work/gates)")
    p.add_argument("--reports", default=None, help="reports dir (default reports/<date>-<gpu>/)")
    p.add_argument("--gemma", default=None, help="Gemma 3 270M GGUF for the needle gate")
    p.add_argument("--llama-tree", default=None, help="llama.cpp source tree (gguf-py, vocab) to write models")
    add_option_flags(p.add_argument_group("gate options (generated from the gates' options)"))


DEFAULT_GATES = tuple(registry())
