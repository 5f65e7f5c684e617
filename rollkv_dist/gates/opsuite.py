"""Upstream's op suite (`tests/test-backend-ops.cpp` of the pin) with its tensors in window buffers.

Patch 0094 gives the suite `GGML_TEST_WINDOW=WHERE:SPLIT`: before a test's usual allocation, its sources
(WHERE=src: the leaf tensors, the destinations of SET_ROWS and CPY among them) or its output (dst) go in a window
buffer of the backend under test, each tensor placed so that the device/host boundary falls at SPLIT of it (0: all
in host memory, third, half, odd: an odd row count near the middle). The suite then compares the backend with the
CPU as it always does. A backend without window buffers (the CPU, `-b CPU`) gets a plain buffer of the same layout:
that is how CI runs the harness without a GPU.

One run per (WHERE, SPLIT), all the ops of OPS in it (`-o`), `-j` workers; per run and op a check that every case
passed (and that some ran), a check that the case lines add up to the suite's own `N/M tests passed` (a run that
stopped early has none), and a check that the run placed tensors across the boundary (the suite's closing
`GGML_TEST_WINDOW=...: N tensors placed` line; on a GPU none in a stand-in buffer). On CUDA one more run plants the
fault of patch 0094 (`GGML_CUDA_WINDOW_TEST_FAULT=split`: the host part of a split copy starts 16 bytes late) and
must fail.

The program is the build's own `test-backend-ops` (`rollkv build --targets ...,test-backend-ops
--cmake-arg=-DLLAMA_BUILD_TESTS=ON` on a tree packed `--with-tests`), else --ops-suite, else it is built from
--llama-tree for the build's variant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollkv_dist.errors import LogParseError, UsageError
from rollkv_dist.gates.context import GateContext, GateResult, find_test_program
from rollkv_dist.gates.process import run_logged

PROGRAM = "test-backend-ops"
OPS = ("CPY", "DUP", "CONT", "GET_ROWS", "SET_ROWS", "FLASH_ATTN_EXT", "MUL_MAT", "ROPE")
PLACES = ("src", "dst")
SPLITS = ("0", "third", "half", "odd")
WINDOW_ENV = "GGML_TEST_WINDOW"
FAULT_ENV = "GGML_CUDA_WINDOW_TEST_FAULT"
FAULT_OPS = ("CPY", "CONT", "DUP")  # the same-type contiguous copies go through the split copy
SHOWN_ENV = ("CUDA_VISIBLE_DEVICES", WINDOW_ENV, FAULT_ENV)

ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
# a case line; with -j the workers' messages (`[OP] ERR = a > b `, `[OP] inf mismatch ...`) go to stdout unbuffered
# and land in front of the next case line, without a newline: kept as the line's prefix
CASE_RE = re.compile(r"^(.*?)  ([A-Z][A-Z0-9_]*)\((.*)\): (.*)$")
PLACED_RE = re.compile(r"^GGML_TEST_WINDOW=(\S+): ([0-9]+) tensors placed across the device/host boundary \(([0-9]+) "
                       r"wholly in host memory, ([0-9]+) in a plain buffer standing in for a window\)\s*$")
PASSED_RE = re.compile(r"^  ([0-9]+)/([0-9]+) tests passed\s*$")


@dataclass
class OpCounts:
    passed: int = 0
    failed: int = 0
    not_supported: int = 0
    failures: list[str] = field(default_factory=list)  # the first few failing cases


@dataclass
class SuiteOutput:
    ops: dict[str, OpCounts] = field(default_factory=dict)
    placed: tuple[str, int, int, int] | None = None  # (WHERE:SPLIT, placed, wholly in host, stand-in)
    summary: tuple[int, int] | None = None  # the backend's "N/M tests passed"


def parse(text: str, source: str = "test-backend-ops") -> SuiteOutput:
    """The suite's console output: one line per case (`  OP(params): ... OK|FAIL|not supported [...]`, perhaps after
    another worker's message), the backend's `N/M tests passed`, and patch 0094's closing line."""
    out = SuiteOutput()
    for n, raw in enumerate(ANSI_RE.sub("", text).splitlines(), 1):
        if raw.startswith("GGML_TEST_WINDOW="):
            if not (m := PLACED_RE.match(raw)):
                raise LogParseError(f"{source}:{n}: a `GGML_TEST_WINDOW=` line of no known form: {raw!r}")
            out.placed = (m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))
            continue
        if m := PASSED_RE.match(raw):
            out.summary = (int(m.group(1)), int(m.group(2)))
            continue
        m = CASE_RE.match(raw)
        if not m:
            continue
        pre, op, params, rest = m.groups()
        c = out.ops.setdefault(op, OpCounts())
        rest = " ".join(x for x in (pre.strip(), rest.rstrip()) if x)
        if rest.startswith("not supported") or rest.startswith("skipping large tensors"):
            c.not_supported += 1
        elif rest.endswith("OK"):
            c.passed += 1
        elif rest.endswith("FAIL"):
            c.failed += 1
            if len(c.failures) < 3:
                c.failures.append(f"{op}({params}): {rest}")
        # a case line cut short (the process died mid-case) counts in neither: the exit status says why
    return out


def backend_name(ctx: GateContext) -> str:
    """The suite's name of the device under test: CUDA0 (its only GPU is the one CUDA_VISIBLE_DEVICES shows), or
    the CPU on a build without a GPU (CI: the harness against the CPU itself)."""
    return "CUDA0" if ctx.gpu is not None else "CPU"


def find_suite(ctx: GateContext) -> Path:
    variant = "cuda" if ctx.gpu is not None else "cpu"
    return find_test_program(ctx, PROGRAM, ctx.options.ops_suite, variant, option="--ops-suite")


def _run(ctx: GateContext, res: GateResult, suite: Path, label: str, ops: tuple[str, ...], window: str,
         extra_env: dict[str, str]) -> tuple[Any, SuiteOutput]:
    env = {**ctx.child_env(), WINDOW_ENV: window, **extra_env}
    cmd = [suite, "-b", backend_name(ctx), "-o", ",".join(ops), "-j", str(ctx.options.ops_jobs)]
    # stdout alone: ggml's log lines (stderr) from the other workers would break the case lines
    p = run_logged(cmd, ctx.work / "ops" / label, ctx.options.ops_timeout, env=env, split_stderr=True, result=res,
                   show_env=SHOWN_ENV)
    return p, parse(p.stdout, source=str(p.stdout_path))


def run(ctx: GateContext, res: GateResult) -> None:
    """Every (WHERE, SPLIT) of the options with every op, then the planted fault (CUDA); the rows go to
    res.results["ops_suite"]."""
    o = ctx.options
    ops = tuple(x for x in o.ops_filter.split(",") if x)
    places = tuple(x for x in o.ops_places.split(",") if x)
    splits = tuple(x for x in o.ops_splits.split(",") if x)
    for flag, got, known in (("--ops-places", places, PLACES), ("--ops-splits", splits, SPLITS)):
        if not got or set(got) - set(known):
            raise UsageError(f"{flag} {','.join(got)!r}: give a comma list of {', '.join(known)}")
    suite = find_suite(ctx)
    gpu = ctx.gpu is not None
    if ctx.work.parent in suite.parents and ctx.build not in suite.parents:
        res.notes.append(f"ops: {PROGRAM} was built from {ctx.llama_tree} for this gate, with its own ggml libraries: "
                         f"the suite tested that build of the series, not the libraries of {ctx.build}")
    rows: list[dict[str, Any]] = []
    res.results["ops_suite"] = {"program": str(suite), "backend": backend_name(ctx), "rows": rows, "fault": None}
    for place in places:
        for split in splits:
            window = f"{place}:{split}"
            label = f"ops {window}"
            p, out = _run(ctx, res, suite, f"{place}-{split}", ops, window, {})
            res.check(f"{label}: {PROGRAM} exits 0", p.rc == 0 and not p.timed_out,
                      f"rc={p.rc} timed_out={p.timed_out} after {p.seconds:.0f} s; log {p.stdout_path}, "
                      f"{p.stderr_path}")
            placed = out.placed
            res.check(f"{label}: tensors placed across the device/host boundary",
                      placed is not None and placed[0] == window and placed[1] > 0
                      and (placed[3] == 0 if gpu else placed[3] == placed[1]),
                      f"closing line: {placed} (WHERE:SPLIT, placed, wholly in host, in a stand-in buffer)"
                      if placed else f"no `GGML_TEST_WINDOW=` line: the suite did not place anything (a build "
                                     f"without patch 0094?); log {p.stdout_path}")
            n_pass = sum(c.passed for c in out.ops.values())
            n_run = n_pass + sum(c.failed for c in out.ops.values())
            res.check(f"{label}: the case lines add up to the suite's own summary",
                      out.summary is not None and out.summary == (n_pass, n_run),
                      f"summary {out.summary} (passed, run), case lines {(n_pass, n_run)}" if out.summary else
                      f"no `N/M tests passed` line: the suite stopped before its end (rc={p.rc}; stderr "
                      f"{p.stderr_path})")
            for op in ops:
                c = out.ops.get(op, OpCounts())
                rows.append({"where": place, "split": split, "op": op, "passed": c.passed, "failed": c.failed,
                             "not_supported": c.not_supported, "seconds": round(p.seconds, 1)})
                res.check(f"{label}: {op} passes ({c.passed}/{c.passed + c.failed})",
                          c.failed == 0 and c.passed > 0,
                          "; ".join(c.failures) or ("no case of this op ran" if c.passed == 0 else ""))
    if gpu:
        p, out = _run(ctx, res, suite, "fault-split", FAULT_OPS, "src:half", {FAULT_ENV: "split"})
        failed = sum(c.failed for c in out.ops.values())
        res.results["ops_suite"]["fault"] = {"env": f"{FAULT_ENV}=split", "window": "src:half", "ops": list(FAULT_OPS),
                                             "rc": p.rc, "failed": failed,
                                             "passed": sum(c.passed for c in out.ops.values())}
        res.check(f"ops: the planted split fault ({FAULT_ENV}=split) fails the suite",
                  p.rc not in (0, None) and failed > 0, f"rc={p.rc}, {failed} case(s) failed; log {p.stdout_path}")
    else:
        res.notes.append(f"ops: the planted fault ({FAULT_ENV}) is in ggml-cuda: it runs on a GPU only")


def markdown(results: dict[str, Any]) -> list[str]:
    """Per op and split: cases passed of those run (and not supported)."""
    s = results.get("ops_suite")
    if not s or not s.get("rows"):
        return []
    out = ["", f"Op suite (`{PROGRAM} -b {s['backend']}`, `{WINDOW_ENV}=WHERE:SPLIT`):", "",
           "| where | split | op | passed | failed | not supported |", "|---|---|---|---|---|---|"]
    for r in s["rows"]:
        out.append(f"| {r['where']} | {r['split']} | {r['op']} | {r['passed']} | {r['failed']} | {r['not_supported']} |")
    if f := s.get("fault"):
        out.append(f"\nPlanted fault `{f['env']}` ({f['window']}, {', '.join(f['ops'])}): rc {f['rc']}, "
                   f"{f['failed']} case(s) failed, {f['passed']} passed.")
    return out
