"""version: the build says which series it carries, and its programs say the same.

Every rollkv build records its series in PREFIX/share/rollkv-llamafile (`rollkv build`, the conda
package and the Nix build alike: the applied patches with their `series`, and build-info.txt with
the build commit `0c1e57098+rollkv.<patches>`). Checks: the record is there with every patch it
lists; its series is this checkout's patches/series (the gates test the series they come with);
its build commit is the one of that series; and each program of the build that takes common
arguments (llama-server, llama-cli, llama-logits-dump) prints `version: V (build N, commit <that
commit>)` for `--version` (common/build-info.cpp at the pin; N is llama.cpp's LLAMA_BUILD_NUMBER, 0 in
rollkv.cmake, not a package's build number). No model, no GPU memory: seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollkv_dist.errors import UsageError
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates.context import GateContext, GateResult
from rollkv_dist.gates.process import run_logged
from rollkv_dist.series import RECORD_DIR, build_commit, read_record, read_series
from rollkv_dist.util import default_patches_dir

NAME = "version"
BINARIES = ("llama-server",)
VERSIONED = ("llama-server", "llama-cli", "llama-logits-dump")  # programs with common args' --version


@dataclass(frozen=True)
class Options:
    version_timeout: float = option("time limit of one `--version` run (s)", 60.0, metavar="S")


def _has(ctx: GateContext, program: str) -> bool:
    try:
        ctx.bin(program)
    except UsageError:
        return False
    return True


def run(ctx: GateContext) -> GateResult:
    res = ctx.res
    series, info = read_record(ctx.build)
    commit = info.get("build_commit")
    res.results.update({"series": series, "build_info": info})
    if not res.check("the build records its series (share/rollkv-llamafile)", bool(series) and bool(commit),
                     f"{ctx.build / RECORD_DIR}: series {series or 'missing'}, build_commit {commit or 'missing'}"):
        return res
    ours = read_series(default_patches_dir())
    first = next((i for i, (a, b) in enumerate(zip(series + ["-"], ours + ["-"], strict=False)) if a != b), None)
    res.check("its series is this checkout's patches/series", series == ours,
              f"build: {len(series)} patches, checkout: {len(ours)}" + ("" if first is None else
              f"; first difference at #{first + 1}: build {(series + ['-'])[first]}, checkout {(ours + ['-'])[first]}"))
    want = build_commit(series)
    res.check("its build commit is the one of that series", commit == want or commit.startswith((want + "-without-", want + "-lab-")),
              f"build_commit={commit}, series gives {want}")
    names = f"commit {commit})"  # the end of `version: V (build N, commit C)`
    targets = info.get("targets", "").split()
    for prog in [p for p in VERSIONED if p in targets or not targets and _has(ctx, p)]:
        p = run_logged([ctx.bin(prog), "--version"], ctx.work / prog, ctx.options.version_timeout,
                       env=ctx.child_env(), result=res)
        lines = [ln.strip() for ln in p.log.splitlines()]
        res.results.setdefault("programs", {})[prog] = {"rc": p.rc, "version": next(
            (ln for ln in lines if ln.startswith("version:")), None)}
        said = res.results["programs"][prog]["version"]
        res.check(f"{prog} --version names `{names[:-1]}`", p.rc == 0 and said is not None and said.endswith(names),
                  f"rc={p.rc}; said {said!r}; log {p.stdout_path}")
    return res


GATE = Gate(name=NAME, order=15, run=run, options=Options, binaries=BINARIES)
