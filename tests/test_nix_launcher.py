"""nix/launcher.sh, the `nix run` wrapper (nix/launcher.nix puts it in a writeShellApplication
after ROLLKV_PROGRAM= and ROLLKV_CUDA=, under `set -o errexit -o nounset -o pipefail`; the
flake test checks that composition). Here it runs the same way, with a stand-in program
that prints what it got, and a stand-in driver directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = (ROOT / "nix" / "launcher.sh").read_text()


def launcher(tmp_path: Path, cuda: bool) -> Path:
    prog = tmp_path / "bin" / "llama-server"
    prog.parent.mkdir(parents=True, exist_ok=True)
    prog.write_text('#!/bin/sh\necho "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"\necho "ARGS=$*"\n')
    prog.chmod(0o755)
    script = tmp_path / "rollkv-llama-server"
    script.write_text("#!/usr/bin/env bash\nset -o errexit -o nounset -o pipefail\n"
                      f"ROLLKV_PROGRAM={prog}\nROLLKV_CUDA={'1' if cuda else '0'}\n" + LAUNCHER)
    script.chmod(0o755)
    return script


def run(script: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": str(script.parent), "XDG_RUNTIME_DIR": str(script.parent)}
    return subprocess.run([str(script), *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


def fake_driver(tmp_path: Path) -> Path:
    d = tmp_path / "host-lib"
    d.mkdir()
    (d / "libcuda.so.580.159").write_text("driver")
    (d / "libcuda.so.1").symlink_to("libcuda.so.580.159")
    (d / "libnvidia-ptxjitcompiler.so.1").write_text("jit")
    (d / "libstdc++.so.6").write_text("a host library the Nix programs must not see")
    return d


def test_no_model_prints_what_to_pass(tmp_path):
    proc = run(launcher(tmp_path, cuda=True), [])
    assert proc.returncode == 2
    assert "llama-server needs a model" in proc.stderr and "-m /path/to/model.gguf" in proc.stderr
    assert "ARGS=" not in proc.stdout  # the server was not started


def test_model_from_the_environment_or_help_starts_the_program(tmp_path):
    script = launcher(tmp_path, cuda=False)
    assert run(script, [], LLAMA_ARG_MODEL="/m.gguf").stdout.splitlines()[-1] == "ARGS="
    assert run(script, ["--help"]).stdout.splitlines()[-1] == "ARGS=--help"


def test_cuda_build_finds_the_host_driver_outside_nixos(tmp_path):
    drv = fake_driver(tmp_path)
    proc = run(launcher(tmp_path, cuda=True), ["-m", "/models/x.gguf", "-c", "4096"],
               ROLLKV_LIBCUDA=str(drv / "libcuda.so.1"), LD_LIBRARY_PATH="/already/there")
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert out["ARGS"] == "-m /models/x.gguf -c 4096"
    first, rest = out["LD_LIBRARY_PATH"].split(":", 1)
    assert rest == "/already/there"
    links = {p.name: os.readlink(p) for p in Path(first).iterdir()}
    # only the driver's libraries, never the rest of the host's library directory
    assert links["libcuda.so.1"] == str(drv / "libcuda.so.580.159")
    assert links["libnvidia-ptxjitcompiler.so.1"] == str(drv / "libnvidia-ptxjitcompiler.so.1")
    assert "libstdc++.so.6" not in links


def test_cpu_build_leaves_the_library_path_alone(tmp_path):
    drv = fake_driver(tmp_path)
    proc = run(launcher(tmp_path, cuda=False), ["-m", "x.gguf"], ROLLKV_LIBCUDA=str(drv / "libcuda.so.1"))
    assert proc.stdout.splitlines()[0] == "LD_LIBRARY_PATH="


def test_no_driver_anywhere_says_so_and_still_starts(tmp_path):
    if Path("/run/opengl-driver/lib/libcuda.so.1").exists() or subprocess.run(
            "ldconfig -p 2>/dev/null | grep -q 'libcuda\\.so\\.1 '", shell=True).returncode == 0 or any(
            Path(d, "libcuda.so.1").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")):
        import pytest

        pytest.skip("this machine has an NVIDIA driver")
    proc = run(launcher(tmp_path, cuda=True), ["-m", "x.gguf"])
    assert proc.returncode == 0
    assert "no libcuda.so.1 found" in proc.stderr and "ROLLKV_LIBCUDA" in proc.stderr
    assert proc.stdout.splitlines()[0] == "LD_LIBRARY_PATH="
