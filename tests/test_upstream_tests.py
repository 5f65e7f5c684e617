"""find_test_program: upstream's test programs for the gates come from the option, the build, or one build of all
of them from --llama-tree beside the gates' work folders (so ggml compiles once for the archs and engine gates)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollkv_dist import build
from rollkv_dist.errors import UsageError
from rollkv_dist.gates import context


def _ctx(tmp_path: Path, gate: str, tree: Path | None) -> context.GateContext:
    return context.GateContext(build=tmp_path / "prefix", work=tmp_path / "gpu0" / gate, gpu=None, llama_tree=tree)


def test_one_build_makes_every_test_program_for_every_gate(tmp_path, monkeypatch):
    tree = tmp_path / "src"
    (tree / "tests").mkdir(parents=True)
    for n in context.UPSTREAM_TESTS:
        (tree / "tests" / f"{n}.cpp").write_text("// upstream's\n")
    builds = []

    def fake_build(settings):  # installs what it was asked for
        builds.append((settings.targets, settings.build_dir))
        for t in settings.targets:
            exe = settings.prefix / "bin" / t
            exe.parent.mkdir(parents=True, exist_ok=True)
            exe.write_text("#!/bin/sh\n")
            exe.chmod(0o755)
        return settings.prefix / "build-info.json"

    def fake_resolve(src, prefix, variant, targets, build_dir, extra_cmake_args):  # what the build is asked
        assert extra_cmake_args == ("-DLLAMA_BUILD_TESTS=ON",) and variant == "cpu" and src == tree
        return SimpleNamespace(targets=tuple(targets.split(",")), build_dir=Path(build_dir), prefix=Path(prefix))

    monkeypatch.setattr(build, "run_build", fake_build)
    monkeypatch.setattr(build.BuildSettings, "resolve", staticmethod(fake_resolve))
    w = context.find_test_program(_ctx(tmp_path, "archs", tree), "test-llama-archs", None, "cpu", "--archs-writer")
    s = context.find_test_program(_ctx(tmp_path, "engine", tree), "test-backend-ops", None, "cpu", "--ops-suite")
    assert builds == [(context.UPSTREAM_TESTS, tmp_path / "gpu0" / "upstream-tests-cpu-build")]
    assert w.parent == s.parent == tmp_path / "gpu0" / "upstream-tests-cpu" / "bin"


def test_the_option_and_the_build_come_first_and_a_missing_tree_is_a_usage_error(tmp_path):
    exe = tmp_path / "prefix" / "bin" / "test-backend-ops"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    ctx = _ctx(tmp_path, "engine", None)
    assert context.find_test_program(ctx, "test-backend-ops", None, "cuda", "--ops-suite") == exe
    assert context.find_test_program(ctx, "test-llama-archs", str(exe), "cpu", "--archs-writer") == exe
    with pytest.raises(UsageError, match="--archs-writer"):
        context.find_test_program(ctx, "test-llama-archs", str(tmp_path / "nothing"), "cpu", "--archs-writer")
    with pytest.raises(UsageError, match="no --llama-tree was given"):
        context.find_test_program(ctx, "test-llama-archs", None, "cpu", "--archs-writer")
    assert os.access(exe, os.X_OK)
