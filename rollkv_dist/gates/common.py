"""Shared machinery of the gates: context, processes with time limits, llama-server, models.

Every child runs in its own process group (rollkv_dist.proc, the one process runner of the
tool); on timeout or exit the whole group gets SIGTERM, then SIGKILL, so no process is left
holding GPU memory. Every command line is recorded in
the gate's result, every log is saved under the gate's work folder.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from rollkv_dist import gpu as gpu_mod
from rollkv_dist import proc as proc_mod
from rollkv_dist.proc import STARTED_GROUPS, group_alive, kill_group  # noqa: F401 - the gates' names for them
from rollkv_dist.errors import RollkvError, UsageError
from rollkv_dist.util import atomic_write_text
from rollkv_dist.gates import logparse, sizing
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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


# ----------------------------------------------------------------------------- processes

@dataclass
class ProcResult:
    cmd: list[str]
    rc: int | None
    timed_out: bool
    seconds: float
    stdout_path: Path
    stderr_path: Path | None

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return "" if self.stderr_path is None else self.stderr_path.read_text(errors="replace")

    @property
    def log(self) -> str:
        """Everything the process printed (llama.cpp logs go to stderr)."""
        return self.stdout + ("\n" + self.stderr if self.stderr_path else "")


def run_logged(cmd: list[str], log_base: Path, timeout: float, env: dict[str, str] | None = None,
               split_stderr: bool = False, result: GateResult | None = None,
               show_env: tuple[str, ...] = ()) -> ProcResult:
    """Run cmd with a time limit in its own process group; stdout (and stderr) saved to files.
    The recorded command line starts with `K=V` for the show_env variables set in env."""
    log_base.parent.mkdir(parents=True, exist_ok=True)
    out_p = log_base.with_suffix(".out" if split_stderr else ".log")
    err_p = log_base.with_suffix(".err") if split_stderr else None
    if result is not None:
        shown = [f"{k}={(env or {})[k]}" for k in show_env if k in (env or {})]
        result.commands.append(shlex.join([*shown, *(str(c) for c in cmd)]))
        result.logs.append(str(out_p))
        if err_p:
            result.logs.append(str(err_p))
    t0 = time.monotonic()
    timed_out = False
    with open(out_p, "w") as fo, (open(err_p, "w") if err_p else open(os.devnull, "w")) as fe, \
            proc_mod.running(cmd, stdout=fo, stderr=fe if err_p else subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env) as proc:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
    return ProcResult([str(c) for c in cmd], None if timed_out else proc.returncode, timed_out,
                      time.monotonic() - t0, out_p, err_p)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """llama-server as a context manager: start, wait for /health, HTTP calls, clean kill."""

    def __init__(self, binary: Path, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 boot_timeout: float = 300.0, request_timeout: float = 600.0,
                 result: GateResult | None = None):
        self.binary, self.args, self.log_path, self.env = binary, list(args), log_path, env
        self.boot_timeout, self.request_timeout = boot_timeout, request_timeout
        self.result = result
        self.port = free_port()
        self.proc: subprocess.Popen[Any] | None = None
        self.booted = False
        self.boot_seconds: float | None = None
        self.exit_code: int | None = None
        self._log_f: Any = None

    @property
    def cmd(self) -> list[str]:
        return [str(self.binary), *self.args, "--host", "127.0.0.1", "--port", str(self.port)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        if self._log_f:
            self._log_f.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def parsed(self) -> logparse.LlamaLog:
        return logparse.parse_log(self.log(), source=str(self.log_path))

    def __enter__(self) -> LlamaServer:
        import requests

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.result is not None:
            self.result.commands.append(shlex.join(self.cmd))
            self.result.logs.append(str(self.log_path))
        self._log_f = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = proc_mod.popen(self.cmd, stdout=self._log_f, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=self.env)
        try:
            while time.monotonic() - t0 < self.boot_timeout:
                if self.proc.poll() is not None:
                    self.exit_code = self.proc.returncode
                    return self
                try:
                    r = requests.get(self.url + "/health", timeout=2)
                    if r.status_code == 200:
                        self.booted = True
                        self.boot_seconds = time.monotonic() - t0
                        return self
                except requests.RequestException:
                    pass
                time.sleep(0.25)
        except BaseException:
            self.close()
            raise
        self.close()
        raise RollkvError(f"llama-server did not become healthy within {self.boot_timeout:.0f} s "
                          f"(log: {self.log_path})")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import requests

        r = requests.post(self.url + path, json=body, timeout=self.request_timeout)
        if r.status_code != 200:
            raise RollkvError(f"{path} returned HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def get(self, path: str) -> dict[str, Any]:
        import requests

        r = requests.get(self.url + path, timeout=self.request_timeout)
        if r.status_code != 200:
            raise RollkvError(f"{path} returned HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        resp = self.post("/tokenize", {"content": text, "add_special": add_special})
        return [t if isinstance(t, int) else t["id"] for t in resp["tokens"]]

    def completion(self, prompt: str, n_predict: int = 16) -> dict[str, Any]:
        return self.post("/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                                         "top_k": 1, "cache_prompt": False, "seed": 0})

    def close(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            if self.exit_code is None:
                self.exit_code = self.proc.returncode
        if self._log_f:
            self._log_f.close()
            self._log_f = None

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------------------- models

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


class WindowRefused(RollkvError):
    """Window mode was refused for a reason no --vram-target can change (no GPU, flags, backend)."""


def window_outcome(log: logparse.LlamaLog, ok: bool, n_cells: int | None = None
                   ) -> tuple[bool, logparse.Window | None]:
    """(ok, window) for search_vram_target from a run's log; raises WindowRefused.

    window: the main cache's (on several GPUs: its lines combined, LlamaLog.caches), or with n_cells
    the one of the context sized for n_cells (llama-bench logs one context per test)."""
    if log.window_refused:
        raise WindowRefused(f"window mode refused: {log.window_refused}")
    return ok, (log.window if n_cells is None else log.window_for(n_cells))


def probe_fixed(log: logparse.LlamaLog, devices: list[str]) -> dict[str, sizing.Fixed]:
    """The engine's fixed part per device from a `--vram-target 1` probe's log (sizing.py); raises
    WindowRefused for a refusal no target can change, LogParseError when the lines are missing."""
    if log.window_refused:
        raise WindowRefused(f"window mode refused: {log.window_refused}")
    return sizing.require_fixed(log, devices)


def search_vram_target(run: Callable[[int], tuple[Any, ...]], estimate: float,
                       kv_mib: float, lo: float = 0.5, hi: float = 0.97, tries: int = 6,
                       history: list[dict[str, Any]] | None = None) -> tuple[int | None, logparse.Window | None]:
    """Find a --vram-target whose window puts a tail fraction in [lo, hi] of the KV in host memory.

    run(target) -> (booted_ok, window[, hint]). The sizer's own margin is not known here, so start from
    an estimate, correct from the logged window, and bisect once a too-low target (boot failed,
    no window, empty window, tail > hi) and a too-high one (fully resident, tail < lo) are known.
    Steps grow when no bracket exists yet, so small and large KVs both converge.
    """
    mid = (lo + hi) / 2
    t = max(1, int(estimate))
    too_low: int | None = None  # largest target known to give too much tail (or no boot)
    too_high: int | None = None  # smallest target known to give too little tail
    up = down = max(4.0, mid * kv_mib)
    seen: set[int] = set()
    for _ in range(tries):
        seen.add(t)
        out = run(t)
        ok, w = out[0], out[1]
        hint = out[2] if len(out) > 2 else None
        if history is not None:
            history.append({"vram_target": t, "ok": ok, "window": None if w is None else asdict(w)})
        has_tail = ok and w is not None and not w.fully_resident and w.cells_resident > 0
        if has_tail and lo <= w.tail_fraction <= hi:
            return t, w
        if has_tail and w.tail_fraction < lo or (ok and w is not None and w.fully_resident):
            too_high = t if too_high is None else min(too_high, t)
            # window known: move by the missing tail; fully resident: the edge is below by >= mid * KV
            cand = int(t - max(1.0, (mid - w.tail_fraction) * kv_mib)) if has_tail else int(t - down)
            if not has_tail:
                down *= 2
            if too_low is not None and (too_high - too_low > 2 * kv_mib or cand <= too_low):
                cand = (too_low + too_high) // 2
            nt = cand
        else:
            too_low = t if too_low is None else max(too_low, t)
            cand = int(t + max(1.0, (w.tail_fraction - mid) * kv_mib)) if has_tail else int(t + up)
            if not has_tail:
                up *= 2
            if too_high is not None and (too_high - too_low > 2 * kv_mib or cand >= too_high):
                cand = (too_low + too_high + 1) // 2
            nt = cand
        if hint is not None and hint not in seen and (too_high is None or hint < too_high):
            nt = hint  # the engine logged its own model/reserve/margin: no guessing
        nt = max(1, nt)
        if nt in seen or (too_low is not None and too_high is not None and too_high - too_low <= 1):
            break  # the bracket is one MiB wide: granularity leaves no target in [lo, hi]
        t = nt
    return None, None


# ----------------------------------------------------------------------------- llama-bench

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
