"""llama-bench for the gates: the options of every gate that runs it on a random model, one run with its JSON
rows and its log parsed, the engine's fixed part from a `-vt 1` probe, and picking a row."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollkv_dist.gates import logparse, sizing
from rollkv_dist.gates.base import option
from rollkv_dist.gates.context import GateContext, GateResult, model_option, shape_option
from rollkv_dist.gates.process import ProcResult, run_logged
from rollkv_dist.gates.sizing import WindowRefused, probe_fixed


@dataclass(frozen=True)
class BenchOptions:
    """The options of every gate that runs llama-bench on a random model (curve, speed, resident-ab)."""

    model: str | None = model_option()
    reps: int = option("llama-bench repetitions (-r)", 3)
    bench_timeout: float = option("time limit of one llama-bench run (s)", 600.0, metavar="S")


@dataclass(frozen=True)
class SpeedModelOptions(BenchOptions):
    """speed and resident-ab: llama-bench on the same random model."""

    speed_shape: str = shape_option("qwen2-1.5b")


def run_bench(ctx: GateContext, res: GateResult, label: str, model: str, args: list[str],
              timeout: float | None = None, build: Path | None = None, env: dict[str, str] | None = None
              ) -> tuple[ProcResult, list[logparse.BenchRow], logparse.LlamaLog]:
    """One llama-bench run (of `build`, default the series build; in `env`, default the gate's GPUs)
    with `-o json -v` (JSON on stdout; -v so the llama logs, window line included, reach stderr:
    llama-bench installs a null log callback without -v)."""
    cmd = [str(ctx.bin("llama-bench", build)), "-m", model, "-o", "json", "-v", *args]
    p = run_logged(cmd, ctx.work / label, float(timeout or ctx.options.bench_timeout),
                   env=env or ctx.child_env(), split_stderr=True, result=res,
                   show_env=("CUDA_VISIBLE_DEVICES",) if env or ctx.split else ())
    # JSON that does not parse, or a log line that does not, fails the gate (LogParseError)
    rows = logparse.parse_bench_json(p.stdout, source=str(p.stdout_path)) if p.rc == 0 else []
    bare = [r.test for r in rows if not r.samples_ts]
    if bare:
        res.notes.append(f"llama-bench rows without samples_ts in {p.stdout_path} ({', '.join(bare)}): their avg_ts "
                         "stands in for the repetitions (speed and curve read the median of samples_ts)")
    return p, rows, logparse.parse_log(p.stderr, source=str(p.stderr_path))


def bench_fixed(ctx: GateContext, res: GateResult, model: str, base: list[str], label: str,
                devices: list[str] | None = None, env: dict[str, str] | None = None) -> dict[str, sizing.Fixed]:
    """What the engine keeps on each device before any KV cell with these very llama-bench arguments:
    a `-vt 1` probe fails before the depth fill and logs it (sizing.py). With `devices` the parts of
    those are required (LogParseError otherwise); without, whatever was logged (maybe nothing)."""
    _, _, log = run_bench(ctx, res, label, model, [*base, "-krm", "window", "-vt", "1"], env=env)
    if devices is not None:
        return probe_fixed(log, devices)
    if log.window_refused:
        raise WindowRefused(f"window mode refused: {log.window_refused}")
    return sizing.fixed_parts(log)


def pick(rows: list[logparse.BenchRow], kind: str, depth: int | None = None) -> logparse.BenchRow | None:
    for r in rows:
        if r.kind == kind and (depth is None or r.n_depth == depth):
            return r
    return None
