"""The rollkv commit that reports and provenance record (GPU hosts get copies without .git)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rollkv_dist.gates.report import rollkv_commit
from rollkv_dist.util import git_head


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


def test_git_head_names_the_commit_and_marks_a_dirty_tree(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f.txt").write_text("one\n")
    _git(repo, "add", "f.txt")
    _git(repo, "commit", "-qm", "c1")
    sha = _git(repo, "rev-parse", "HEAD")
    assert git_head(repo) == sha
    (repo / "f.txt").write_text("two\n")
    assert git_head(repo) == sha + "-dirty"


def test_no_git_means_no_commit_and_reports_fall_back_to_the_provenance(tmp_path):
    assert git_head(tmp_path) is None
    assert git_head(None) is None
    info = {"provenance": {"rollkv_commit": "0123abc"}}
    assert rollkv_commit(tmp_path, info) == "0123abc"
    assert rollkv_commit(tmp_path, {"provenance": {}}) is None


def test_gate_report_records_the_source_tree_commit_next_to_the_checkout_commit(tmp_path):
    from rollkv_dist.gates.context import GateResult
    from rollkv_dist.gates.report import gate_report, markdown

    res = GateResult(gate="speed", gpu=None).finish()
    info = {"series": [], "provenance": {"rollkv_commit": "53986f0abc"}}
    rep = gate_report(res, build=tmp_path, baseline=None, probe=None, build_info=info, baseline_info=None)
    assert rep["rollkv"]["source_commit"] == "53986f0abc"
    assert "(source tree made at `53986f0abc`)" in markdown(rep)
