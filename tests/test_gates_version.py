"""version gate against the fake programs in a prefix that records its series like a rollkv build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollkv_dist.gates import version
from rollkv_dist.gates.runner import DEFAULT_GATES
from rollkv_dist.gates.base import option_names, registry
from rollkv_dist.series import build_commit, read_series, record_series

from test_gates import FAKE, ctx_for, run_one

PATCHES = Path(__file__).resolve().parents[1] / "patches"
SERIES = read_series(PATCHES)


def fake_prefix(tmp_path: Path, series: list[str] = SERIES, commit: str | None = None,
                build_number: str = "0") -> Path:
    """The fake programs (linked) in a prefix with share/rollkv-llamafile, as `rollkv build` writes it."""
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    for f in (FAKE / "bin").iterdir():
        (prefix / "bin" / f.name).symlink_to(f)
    record_series(prefix, PATCHES, series, {
        "version": "0.3.36", "build_number": build_number, "build_commit": commit or build_commit(series),
        "targets": "llama-server llama-bench llama-logits-dump llama-window-test"})
    return prefix


def run_version(tmp_path, monkeypatch=None, env=None, **kw):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = ctx_for(tmp_path)
    ctx.build = fake_prefix(tmp_path, **kw)
    return ctx, run_one("version", ctx)


def failed(res) -> list[str]:
    return [c.name for c in res.checks if not c.ok]


def test_registered_after_engine_with_its_flag():
    assert DEFAULT_GATES[:2] == ("engine", "version") and registry()["version"] is version.GATE
    assert "version_timeout" in option_names()


# a conda package records its own build number (300 for CUDA 13.0); the programs print llama.cpp's
# LLAMA_BUILD_NUMBER (0), as the H200 run of the conda artifact showed (reports/2026-12-01-h200-c)
@pytest.mark.parametrize("build_number", ["0", "300"])
def test_programs_say_the_recorded_series(tmp_path, build_number):
    ctx, res = run_version(tmp_path, build_number=build_number)
    assert res.verdict == "pass", failed(res)
    names = f"commit {build_commit(SERIES)}"
    assert [c.name for c in res.checks] == [
        "the build records its series (share/rollkv-llamafile)", "its series is this checkout's patches/series",
        "its build commit is the one of that series", f"llama-server --version names `{names}`",
        f"llama-logits-dump --version names `{names}`", "no process left running (none holds GPU memory)"]
    assert res.results["programs"]["llama-server"] == {"rc": 0, "version": f"version: 0.5.0-dev (build 0, {names})"}
    assert res.results["series"] == SERIES and res.commands[0].endswith("llama-server --version")


def test_a_program_of_another_build_fails_its_check(tmp_path, monkeypatch):
    ctx, res = run_version(tmp_path, monkeypatch, {"FAKE_VERSION_COMMIT": "0c1e57098+rollkv.3"})
    assert failed(res) == [f"{p} --version names `commit {build_commit(SERIES)}`"
                           for p in ("llama-server", "llama-logits-dump")]
    assert "said 'version: 0.5.0-dev (build 0, commit 0c1e57098+rollkv.3)'" in res.checks[3].detail


def test_a_build_of_another_series_or_a_wrong_commit(tmp_path):
    ctx, res = run_version(tmp_path / "a", series=SERIES[:-1])
    assert failed(res) == ["its series is this checkout's patches/series"]
    n = len(SERIES)
    assert res.checks[1].detail == (f"build: {n - 1} patches, checkout: {n}; first difference at #{n}: build -, "
                                    f"checkout {SERIES[-1]}")
    ctx, res = run_version(tmp_path / "b", commit="0c1e57098+rollkv.2")
    assert failed(res)[0] == "its build commit is the one of that series"
    # the baseline build names what it leaves out
    ctx, res = run_version(tmp_path / "c", commit=build_commit(SERIES) + "-without-0089")
    assert "its build commit is the one of that series" not in failed(res)


@pytest.mark.parametrize("what", ["no record", "empty series"])
def test_a_build_without_its_record_fails_before_running_anything(tmp_path, what):
    ctx = ctx_for(tmp_path)
    ctx.build = FAKE if what == "no record" else fake_prefix(tmp_path, series=[])
    res = run_one("version", ctx)
    assert failed(res) == ["the build records its series (share/rollkv-llamafile)"] and res.commands == []


def test_reports_of_an_artifact_name_its_series(tmp_path):
    """A conda or Nix prefix has no share/rollkv/build-info.json, only the series record: the gate
    reports read the series from it (the H200 reports of the conda package said `series: ?`)."""
    from rollkv_dist.gates.context import read_build_info

    prefix = fake_prefix(tmp_path, build_number="300")
    info = read_build_info(prefix)
    assert info["series"] == SERIES and info["record"]["build_number"] == "300"
    assert info["record"]["build_commit"] == build_commit(SERIES)
    assert read_build_info(tmp_path / "nothing") is None


def test_series_record_keeps_the_trees_rollkv_commit_for_the_reports(tmp_path):
    """build.sh's `series record --tree` (conda) copies the rollkv commit of the tree's provenance into
    build-info.txt, and a gate report on that prefix names it as the source commit (a GPU host's copy
    of the checkout may carry a stale .git)."""
    from rollkv_dist import series
    from rollkv_dist.gates import report
    from rollkv_dist.gates.context import read_build_info

    tree = tmp_path / "tree"
    tree.mkdir()
    names = SERIES[:2]  # the tree's provenance names the series it carries
    (tree / series.PROVENANCE_FILE).write_text(json.dumps({"rollkv_commit": "abc123", "series": names}))
    prefix = tmp_path / "prefix"
    assert series.main(["record", str(PATCHES), str(prefix), "build_number=300"]) == 0  # no tree: no commit
    assert "rollkv_commit" not in read_build_info(prefix)["record"]
    assert series.main(["record", "--tree", str(tree), str(PATCHES), str(prefix), "build_number=300"]) == 0
    info = read_build_info(prefix)
    assert info["record"]["rollkv_commit"] == "abc123" and info["series"] == names
    res = type("R", (), {"gate": "version", "gpu": None, "gpus": None, "seconds": 0.0, "commands": [],
                         "results": {}, "checks": [], "notes": [], "logs": {}, "plots": [], "verdict": "pass"})()
    rep = report.gate_report(res, build=prefix, baseline=None, probe=None, build_info=info, baseline_info=None)
    assert rep["rollkv"]["source_commit"] == "abc123" and rep["series"] == names
