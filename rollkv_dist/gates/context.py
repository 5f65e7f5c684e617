"""What every gate works with: its options' shared helpers, its result (checks, commands, logs), its context
(build, work folder, GPUs, environment), the programs it runs (a build's, upstream's test programs) and the
random-weight models it writes."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollkv_dist import gpu as gpu_mod
from rollkv_dist import proc as proc_mod
from rollkv_dist.errors import UsageError
from rollkv_dist.util import atomic_write_text
from rollkv_dist.gates.base import option
from rollkv_dist.models import SHAPES

MiB = 1024 * 1024
SEED_COMPUTE_BYTES = 3_800_045_568  # the seed's measured CUDA compute buffer (ENGINE.md)
# llama-server & co. map libllama's INFO lines (n_ctx, model/KV/compute buffer sizes, ...) to
# verbosity 4 (trace) and print up to 3 by default (common/log.cpp): the gates ask for 4.
LOG_ARGS = ("-lv", "4")


# ----------------------------------------------------------------------------- options several gates share
# (one definition each: a flag is generated once per option name, so its gates must agree on it)

def model_option() -> Any:
    return option("a GGUF to run instead of the random-weight model the gate writes into --work/models (of the "
                  "gate's shape)", None, metavar="GGUF")


def shape_option(default: str) -> Any:
    return option("shape of the random-weight model the gate writes", default, choices=sorted(SHAPES))


def n_predict_option() -> Any:
    return option("tokens the completion decodes", 64)


def boot_timeout_option(default: float) -> Any:
    return option("time limit for llama-server to become healthy (s)", default, metavar="S")


def run_timeout_option() -> Any:
    return option("time limit of one llama-logits-dump run (s)", 900.0, metavar="S")


# ----------------------------------------------------------------------------- results

@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class GateResult:
    gate: str
    gpu: dict[str, Any] | None
    verdict: str = "fail"  # pass | fail | skip
    commands: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    plots: list[str] = field(default_factory=list)
    gpus: list[dict[str, Any]] | None = None  # every GPU of an all-GPU run (gpu is the first)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def finish(self) -> GateResult:
        if self.verdict != "skip":
            self.verdict = "pass" if self.checks and all(c.ok for c in self.checks) else "fail"
        return self


# ----------------------------------------------------------------------------- context

@dataclass
class GateContext:
    build: Path  # install prefix (or build dir) of the full series
    work: Path  # per-gate scratch: logs, prompts, logits
    gpu: gpu_mod.GPUInfo | None  # the GPU under test (the first of them in an all-GPU run)
    baseline_build: Path | None = None
    upstream_build: Path | None = None  # the pin built with no patch (resident-ab)
    llama_tree: Path | None = None
    models_dir: Path | None = None
    gemma: Path | None = None
    # the gate's options: its options dataclass (run_gate makes it from a mapping of option values)
    options: Any = field(default_factory=dict)
    env: dict[str, str] | None = None  # base environment (tests)
    # every GPU of the machine (the probe's), for the runs that span several; `gpu` is the one under test
    gpus: list[gpu_mod.GPUInfo] = field(default_factory=list)
    # the GPUs the gate's children see: [gpu], or every GPU of an all-GPU run (layer split)
    under_test: list[gpu_mod.GPUInfo] = field(default_factory=list)
    result: GateResult | None = None  # what run_gate hands the gate to fill

    @property
    def split(self) -> bool:
        """An all-GPU run: several GPUs visible to every child, the model split by layers."""
        return len(self.under_test) > 1

    @property
    def res(self) -> GateResult:
        if self.result is None:
            raise RuntimeError("a gate ran outside run_gate (no GateResult to fill)")
        return self.result

    def child_env(self) -> dict[str, str]:
        if self.split:
            return gpu_mod.child_env(",".join(g.uuid for g in self.under_test), self.env)
        return gpu_mod.child_env(self.gpu, self.env)

    def bin(self, name: str, build: Path | None = None) -> Path:
        return find_bin(build or self.build, name)


def read_build_info(prefix: Path | None) -> dict[str, Any] | None:
    """What an install prefix says of its build: build-info.json (`rollkv build`), else the series
    record every build writes (share/rollkv-llamafile: the conda package, the Nix build) as
    {"series", "record" (build-info.txt), "source"}; None when it has neither."""
    from rollkv_dist.series import RECORD_DIR, read_record

    if prefix is None:
        return None
    for cand in (prefix / "share" / "rollkv" / "build-info.json", prefix / "build-info.json"):
        if cand.is_file():
            try:
                return json.loads(cand.read_text())
            except ValueError:
                return None
    series, record = read_record(prefix)
    if series or record:
        return {"series": series, "record": record, "source": str(prefix / RECORD_DIR)}
    return None


def find_bin(prefix: Path, name: str) -> Path:
    for cand in (prefix / "bin" / name, prefix / name, prefix / "build" / "bin" / name):
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    raise UsageError(f"{name} not found under {prefix} (looked in bin/, ./, build/bin/): pass the install "
                     "prefix of a build made with `rollkv build`")


UPSTREAM_TESTS = ("test-llama-archs", "test-backend-ops")  # the pin's test programs the gates run


def find_test_program(ctx: GateContext, name: str, given: str | None, variant: str, option: str) -> Path:
    """One of upstream's test programs from the pin's tests/ (UPSTREAM_TESTS): `given` (the gate's option), else
    the build's own (`rollkv build --targets ...,NAME --cmake-arg=-DLLAMA_BUILD_TESTS=ON` on a tree packed
    `--with-tests`), else built for `variant` from --llama-tree beside the gate's work folder, all of
    UPSTREAM_TESTS in one build (ggml and libllama compile once for the gates that need them)."""
    if given:
        path = Path(given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise UsageError(f"{option} {path}: not an executable file")
        return path
    try:
        return find_bin(ctx.build, name)
    except UsageError:
        pass
    tree = ctx.llama_tree
    if tree is None or not (tree / "tests" / f"{name}.cpp").is_file():
        raise UsageError(f"this gate needs upstream's {name}: the build has none, and "
                         f"{'no --llama-tree was given' if tree is None else f'{tree} has no tests/{name}.cpp'}; "
                         f"pass --llama-tree with a `rollkv source` tree (it keeps tests/), or {option} PATH")
    from rollkv_dist import log
    from rollkv_dist.build import BuildSettings, run_build

    prefix = ctx.work.parent / f"upstream-tests-{variant}"
    if not (prefix / "bin" / name).is_file():
        names = [n for n in UPSTREAM_TESTS if n == name or (tree / "tests" / f"{n}.cpp").is_file()]
        log.info(f"building {', '.join(names)} ({variant}) from {tree} into {prefix} (the build has no {name})")
        run_build(BuildSettings.resolve(tree, prefix, variant=variant, targets=",".join(names),
                                        build_dir=ctx.work.parent / f"upstream-tests-{variant}-build",
                                        extra_cmake_args=("-DLLAMA_BUILD_TESTS=ON",)))
    return find_bin(prefix, name)


def ensure_random_model(ctx: GateContext, shape: str, qtype: str = "q8_0", seed: int = 0) -> Path:
    """The random-weight model for a gate: reuse <models>/<shape>-<qtype>-s<seed>.gguf or write it."""
    from rollkv_dist import models

    mdir = ctx.models_dir or (ctx.work.parent / "models")
    path = mdir / f"{shape}-{qtype}-s{seed}.gguf"
    meta = path.with_suffix(".json")
    if path.is_file() and meta.is_file():
        try:
            m = json.loads(meta.read_text())
            if m.get("bytes") == path.stat().st_size:
                return path
        except (OSError, ValueError):
            pass
    if ctx.llama_tree is None:
        raise UsageError(f"model {path} does not exist; pass --llama-tree (the llama.cpp source tree, "
                         "for gguf-py and the qwen2 vocab) so the gate can write it")
    info = models.write_random_gguf(path, shape, qtype=qtype, llama_tree=ctx.llama_tree, seed=seed)
    atomic_write_text(meta, json.dumps(info, indent=2))
    return path


# ----------------------------------------------------------------------------- programs

def has_flags(binary: Path, flags: tuple[str, ...], env: dict[str, str] | None = None) -> tuple[bool, str]:
    """Does `binary --help` mention every flag? (A build without the engine patches does not.)"""
    try:
        p = proc_mod.run([binary, "--help"], capture_output=True, text=True, timeout=120, env=env,
                         stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{binary} --help failed: {e}"
    text = p.stdout + p.stderr
    missing = [f for f in flags if f not in text]
    return not missing, ("" if not missing else f"{binary.name} --help lacks {', '.join(missing)}: "
                         "not a rolling-KV build?")


def preflight(ctx: GateContext, res: GateResult, binary: Path, flags: tuple[str, ...]) -> bool:
    ok, why = has_flags(binary, flags, ctx.child_env())
    return res.check(f"{binary.name} has {' '.join(flags)}", ok, why)
