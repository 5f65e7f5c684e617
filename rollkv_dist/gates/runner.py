"""Running gates: the selection (`--gates`, ROLLKV_GATES), the inputs checked before anything runs, one gate in its
context with a time and a check that no process outlives it, every selected gate on each GPU (or on all of them
together), and their reports."""

from __future__ import annotations

import datetime as _dt
import time
import traceback
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rollkv_dist import gpu as gpu_mod
from rollkv_dist import log
from rollkv_dist.errors import UsageError
from rollkv_dist.proc import STARTED_GROUPS, group_alive
from rollkv_dist.gates import report
from rollkv_dist.gates.base import BASELINE_BUILD, UPSTREAM_BUILD, check_option_names, get, registry
from rollkv_dist.gates.context import GateContext, GateResult, find_bin, read_build_info


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


DEFAULT_GATES = tuple(registry())
