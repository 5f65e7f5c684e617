"""rollkv build: settings resolution (no compiling), CUDA arch detection from a fake NVML."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from rollkv_dist.build import INITIAL_CACHE, BuildSettings, initial_cache, parse_archs
from rollkv_dist.detect import GpuInfo, GpuScan, scan_gpus
from rollkv_dist.errors import BuildError, NoGPUError, UsageError
from rollkv_dist.source import PROVENANCE_FILE


def _tool(d: Path, name: str, out: str) -> None:
    p = d / name
    p.write_text(f"#!/bin/sh\necho '{out}'\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def tools(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    _tool(d, "cmake", "cmake version 3.25.1")
    _tool(d, "ninja", "1.11.1")
    return d


@pytest.fixture
def tree(tmp_path):
    t = tmp_path / "llama.cpp"
    (t / "ggml").mkdir(parents=True)
    (t / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    return t


def env_for(tools: Path, **extra: str) -> dict[str, str]:
    return {"PATH": str(tools), "HOME": "/nonexistent", **extra}


def no_gpu() -> GpuScan:
    return GpuScan((), "NVML could not start: Driver Not Loaded")


def test_cpu_defaults(tools, tree, tmp_path):
    s = BuildSettings.resolve(tree, tmp_path / "prefix", env=env_for(tools), gpu_scan=no_gpu)
    assert s.variant == "cpu" and s.cuda_archs == ()
    assert s.targets == ()  # rollkv.cmake's ROLLKV_PROGRAMS
    assert s.build_dir == tree / "build-cpu"
    assert s.ninja == str(tools / "ninja")
    # the tool adds only what it owns to the initial cache
    assert s.cmake_definitions() == {
        "CMAKE_INSTALL_PREFIX": str(tmp_path / "prefix"), "CMAKE_MAKE_PROGRAM": str(tools / "ninja"),
        "LLAMA_BUILD_COMMIT": "0c1e57098+rollkv.0"}
    cmd = s.configure_command()
    assert cmd[:3] == [str(tools / "cmake"), "-C", str(INITIAL_CACHE)] and "Ninja" in cmd
    assert s.build_command()[-4:] == ["--target", "rollkv-programs", "-j", str(s.jobs)]
    with pytest.raises(AttributeError):
        s.jobs = 3  # type: ignore[misc]


def test_initial_cache_holds_the_flags():
    cache = initial_cache()
    for key, value in {
        "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_BUILD_UI": "OFF", "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF", "GGML_NATIVE": "OFF", "GGML_CUDA": "OFF",
        "LLAMA_OPENSSL": "OFF", "GGML_CCACHE": "OFF", "GGML_CUDA_NCCL": "OFF",
        "LLAMA_BUILD_NUMBER": "0", "BUILD_SHARED_LIBS": "ON",
        "CMAKE_INSTALL_RPATH": "$ORIGIN/../lib;$ORIGIN",
    }.items():
        assert cache[key] == value, key
    assert cache["ROLLKV_PROGRAMS"].split(";")[:3] == ["llama-server", "llama-cli", "llama-bench"]
    assert "90-real" in cache["CMAKE_CUDA_ARCHITECTURES"].split(";")


def test_targets_become_rollkv_programs(tools, tree, tmp_path):
    s = BuildSettings.resolve(tree, tmp_path / "p", targets="llama-server, llama-cli",
                              jobs=2, env=env_for(tools), gpu_scan=no_gpu)
    assert s.targets == ("llama-server", "llama-cli") and s.jobs == 2
    assert s.cmake_definitions()["ROLLKV_PROGRAMS"] == "llama-server;llama-cli"
    with pytest.raises(UsageError, match="empty"):
        BuildSettings.resolve(tree, tmp_path / "p", targets=" , ", env=env_for(tools),
                              gpu_scan=no_gpu)


def test_build_commit_follows_provenance(tools, tree, tmp_path):
    (tree / PROVENANCE_FILE).write_text(json.dumps({
        "series": ["0001-a.patch", "0002-b.patch"],
        "excluded": ["0089-rolling-kv-compute-reserve.patch"]}))
    s = BuildSettings.resolve(tree, tmp_path / "p", env=env_for(tools), gpu_scan=no_gpu)
    assert s.build_commit == "0c1e57098+rollkv.2-without-0089"
    assert s.series == ("0001-a.patch", "0002-b.patch")


def test_not_a_tree_and_missing_tools(tools, tree, tmp_path, monkeypatch):
    import sys

    with pytest.raises(UsageError, match="rollkv source"):
        BuildSettings.resolve(tmp_path, tmp_path / "p", env=env_for(tools), gpu_scan=no_gpu)
    (tools / "ninja").unlink()
    monkeypatch.setitem(sys.modules, "ninja", None)  # nor the PyPI package's binary
    with pytest.raises(BuildError, match="ninja"):
        BuildSettings.resolve(tree, tmp_path / "p", env=env_for(tools), gpu_scan=no_gpu)
    _tool(tools, "ninja", "1.11.1")
    _tool(tools, "cmake", "cmake version 3.10.0")
    with pytest.raises(BuildError, match="too old"):
        BuildSettings.resolve(tree, tmp_path / "p", env=env_for(tools), gpu_scan=no_gpu)


def test_cuda_needs_nvcc(tools, tree, tmp_path, monkeypatch):
    monkeypatch.setattr("rollkv_dist.detect.Path.is_file",
                        lambda self: os.path.isfile(self) and "/usr/local/cuda" not in str(self))
    with pytest.raises(BuildError, match="nvcc"):
        BuildSettings.resolve(tree, tmp_path / "p", variant="cuda", cuda_arch="90-real",
                              env=env_for(tools), gpu_scan=no_gpu)


def test_cuda_without_gpu_needs_explicit_arch(tools, tree, tmp_path):
    _tool(tools, "nvcc", "Cuda compilation tools, release 13.0, V13.0.88")
    with pytest.raises(NoGPUError) as ei:
        BuildSettings.resolve(tree, tmp_path / "p", variant="cuda", env=env_for(tools),
                              gpu_scan=no_gpu)
    assert "Driver Not Loaded" in str(ei.value) and "--cuda-arch" in str(ei.value)
    s = BuildSettings.resolve(tree, tmp_path / "p", variant="cuda", cuda_arch="sm_90,89-real",
                              env=env_for(tools), gpu_scan=no_gpu)
    assert s.cuda_archs == ("90", "89-real") and s.arch_source == "explicit"
    d = s.cmake_definitions()
    assert d["CMAKE_CUDA_ARCHITECTURES"] == "90;89-real" and d["GGML_CUDA"] == "ON"
    assert d["CMAKE_CUDA_COMPILER"] == str(tools / "nvcc")


def test_cuda_arch_for_cpu_variant_is_a_usage_error(tools, tree, tmp_path):
    with pytest.raises(UsageError, match="--variant cuda"):
        BuildSettings.resolve(tree, tmp_path / "p", cuda_arch="90-real", env=env_for(tools),
                              gpu_scan=no_gpu)


def test_parse_archs():
    assert parse_archs("90-real") == ("90-real",)
    assert parse_archs("sm_120a;compute_90 90-real") == ("120a", "90", "90-real")
    for bad in ("ninety", "90-fake", ""):
        with pytest.raises(UsageError):
            parse_archs(bad)


class FakeNVML:
    """Just the NVML calls rollkv uses, with the compute capabilities given."""

    def __init__(self, caps, init_error: Exception | None = None):
        self.caps = caps
        self.init_error = init_error
        self.shut = False

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.caps)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.caps[h]

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200" if self.caps[h] == (9, 0) else "NVIDIA RTX PRO 6000"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08d}"


def test_arch_detection_from_nvml():
    nvml = FakeNVML([(9, 0), (12, 0), (9, 0)])
    scan = scan_gpus(nvml)
    assert nvml.shut
    assert [g.name for g in scan.gpus] == ["NVIDIA H200", "NVIDIA RTX PRO 6000", "NVIDIA H200"]
    assert scan.gpus[0] == GpuInfo(0, "NVIDIA H200", "GPU-00000000", (9, 0))
    assert scan.cuda_archs == ("90-real", "120-real")


def test_nvml_failure_keeps_its_reason(tools, tree, tmp_path):
    scan = scan_gpus(FakeNVML([], init_error=RuntimeError("Driver Not Loaded")))
    assert scan.gpus == () and "Driver Not Loaded" in scan.reason
    assert scan_gpus(FakeNVML([])).reason == "NVML reports 0 GPUs"
    _tool(tools, "nvcc", "x")
    s = BuildSettings.resolve(tree, tmp_path / "p", variant="cuda", env=env_for(tools),
                              gpu_scan=lambda: scan_gpus(FakeNVML([(8, 6), (9, 0)])))
    assert s.cuda_archs == ("86-real", "90-real") and s.arch_source == "nvml"


FAKE_CMAKE = r'''#!/bin/sh
# stand-in for cmake: configure writes a cache, build prints ninja lines and makes bin/
if [ "$1" = "--version" ]; then echo "cmake version 3.25.1"; exit 0; fi
if [ "$1" = "-C" ]; then
  mkdir -p "$6"
  echo "CMAKE_CXX_COMPILER:FILEPATH=$(command -v cc || echo /bin/true)" > "$6/CMakeCache.txt"
  echo "$@" > "$6/configure-args"
  echo "-- Configuring done"; exit 0
fi
if [ "$1" = "--build" ]; then
  b="$2"; shift 3
  mkdir -p "$b/bin"
  if [ -n "$FAKE_FAIL" ]; then
    echo "[1/2] Building CXX object a.o"; echo "FAILED: a.o"; echo "a.cpp:1: error: boom"; exit 1
  fi
  echo "[1/3] Building C object x.o"; echo "[2/3] Linking libllama.so"; echo "[3/3] Linking"
  printf 'lib' > "$b/bin/libllama.so.0.0.1"; ln -sf libllama.so.0.0.1 "$b/bin/libllama.so"
  for t in "$@"; do case "$t" in -j|[0-9]*) ;; *) printf '#!/bin/sh\n' > "$b/bin/$t";; esac; done
  exit 0
fi
exit 2
'''


def test_run_build_installs_and_records(tree, tmp_path, monkeypatch):
    """The real three steps (cmake -C rollkv.cmake, rollkv-programs, rollkv-install.cmake) on
    the miniature llama.cpp."""
    import io

    from _mini_llama import write_mini_tree

    from rollkv_dist import log
    from rollkv_dist.build import run_build

    write_mini_tree(tree)
    (tree / PROVENANCE_FILE).write_text(json.dumps({"series": [], "excluded": []}))
    s = BuildSettings.resolve(tree, tmp_path / "prefix", jobs=2, build_dir=tmp_path / "b",
                              gpu_scan=no_gpu)
    buf = io.StringIO()
    monkeypatch.setattr(log, "_default", log.Logger(stream=buf))
    info_path = run_build(s)
    prefix = tmp_path / "prefix"
    # the tree defines llama-quantize too, but only ROLLKV_PROGRAMS are built and installed
    assert sorted(p.name for p in (prefix / "bin").iterdir()) == [
        "llama-bench", "llama-cli", "llama-server"]
    assert not (tmp_path / "b" / "bin" / "llama-quantize").exists()
    libs = sorted(p.name for p in (prefix / "lib").iterdir() if p.is_file())
    assert libs == ["libggml.so", "libllama-common.so", "libllama.so", "libserver-context.so"]
    assert (prefix / "include" / "llama.h").is_file()
    info = json.loads(info_path.read_text())
    assert info_path == prefix / "share" / "rollkv" / "build-info.json"
    assert info["targets"] == ["llama-server", "llama-cli", "llama-bench"]
    assert "bin/llama-server" in info["installed"] and "lib/libserver-context.so" in info["installed"]
    assert info["cmake_cache"]["LLAMA_USE_PREBUILT_UI"] == "OFF"
    assert info["cmake_cache"]["LLAMA_BUILD_COMMIT"] == "0c1e57098+rollkv.0"
    assert "c" in info["compilers"] and info["date"].endswith("Z")
    assert (prefix / "share" / "rollkv" / PROVENANCE_FILE).is_file()
    # recorded like the conda package, so recipe/run_test.sh reads it
    share = prefix / "share" / "rollkv-llamafile"
    assert (share / "patches" / "series").read_text() == ""
    assert "build_commit=0c1e57098+rollkv.0" in (share / "build-info.txt").read_text()
    out = buf.getvalue()
    assert "==> Configuring (CMake)" in out and "build: 14/14 (100 %)" in out
    help_text = subprocess.run([str(prefix / "bin" / "llama-server"), "--help"],
                               capture_output=True, text=True).stdout
    assert "slots (default: 1)" in help_text  # through the installed libserver-context.so


def test_run_build_failure_shows_the_first_error(tools, tree, tmp_path, monkeypatch):
    from rollkv_dist.build import run_build

    (tools / "cmake").write_text(FAKE_CMAKE)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_FAIL", "1")
    s = BuildSettings.resolve(tree, tmp_path / "prefix", build_dir=tmp_path / "b",
                              env=env_for(tools), gpu_scan=no_gpu)
    with pytest.raises(BuildError) as ei:
        run_build(s)
    msg = str(ei.value)
    assert "FAILED: a.o" in msg and "error: boom" in msg
    assert str(tmp_path / "b" / "rollkv-build.log") in msg
    assert not (tmp_path / "prefix" / "bin").exists()
