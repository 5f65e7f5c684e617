"""rollkv build: settings resolution (no compiling), CUDA arch detection from a fake NVML."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from _rollkv_tool_helpers import make_build_tree

from rollkv_dist import cli
from rollkv_dist.build import BuildSettings, default_targets, parse_archs
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
    return make_build_tree(tmp_path)


def env_for(tools: Path, **extra: str) -> dict[str, str]:
    return {"PATH": str(tools), "HOME": "/nonexistent", **extra}


def no_gpu() -> GpuScan:
    return GpuScan((), "NVML could not start: Driver Not Loaded")


def test_cpu_defaults(tools, tree, tmp_path):
    s = BuildSettings.resolve(tree, tmp_path / "prefix", env=env_for(tools), gpu_scan=no_gpu)
    assert s.variant == "cpu" and s.cuda_archs == ()
    assert s.targets == ("llama-server", "llama-cli", "llama-bench")
    assert s.build_dir == tree / "build-cpu"
    assert s.ninja == str(tools / "ninja")
    d = s.cmake_definitions()
    for key, value in {
        "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_BUILD_UI": "OFF", "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF", "GGML_NATIVE": "OFF", "GGML_CUDA": "OFF",
        "LLAMA_BUILD_NUMBER": "0", "LLAMA_BUILD_COMMIT": "0c1e57098+rollkv.0",
    }.items():
        assert d[key] == value, key
    assert "GGML_CUDA_NCCL" not in d and "CMAKE_CUDA_ARCHITECTURES" not in d
    cmd = s.configure_command()
    assert cmd[:2] == [str(tools / "cmake"), "-S"] and "Ninja" in cmd
    assert s.build_command()[-2:] == ["-j", str(s.jobs)]
    with pytest.raises(AttributeError):
        s.jobs = 3  # type: ignore[misc]


def test_logits_dump_target_when_the_tree_has_it(tools, tree, tmp_path):
    assert "llama-logits-dump" not in default_targets(tree)
    (tree / "tools" / "logits-dump").mkdir(parents=True)
    s = BuildSettings.resolve(tree, tmp_path / "p", env=env_for(tools), gpu_scan=no_gpu)
    assert s.targets[-1] == "llama-logits-dump"
    s2 = BuildSettings.resolve(tree, tmp_path / "p", targets="llama-server, llama-cli",
                               jobs=2, env=env_for(tools), gpu_scan=no_gpu)
    assert s2.targets == ("llama-server", "llama-cli") and s2.jobs == 2


def test_window_test_target_when_the_tree_has_it(tools, tree, tmp_path):
    assert "llama-window-test" not in default_targets(tree)
    (tree / "tools" / "window-test").mkdir(parents=True)
    assert default_targets(tree) == ("llama-server", "llama-cli", "llama-bench", "llama-window-test")
    (tree / "tools" / "logits-dump").mkdir(parents=True)
    s = BuildSettings.resolve(tree, tmp_path / "p", env=env_for(tools), gpu_scan=no_gpu)
    assert s.targets == ("llama-server", "llama-cli", "llama-bench", "llama-logits-dump", "llama-window-test")
    # --targets still overrides the defaults
    s2 = BuildSettings.resolve(tree, tmp_path / "p", targets="llama-bench", env=env_for(tools), gpu_scan=no_gpu)
    assert s2.targets == ("llama-bench",)


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
    assert d["GGML_CUDA_NCCL"] in ("ON", "OFF")
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
if [ "$1" = "-S" ]; then
  mkdir -p "$4"
  echo "CMAKE_CXX_COMPILER:FILEPATH=$(command -v cc || echo /bin/true)" > "$4/CMakeCache.txt"
  echo "$@" > "$4/configure-args"
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
  for t in "$@"; do case "$t" in -j|[0-9]*) ;; *) printf '#!/bin/sh\n' > "$b/bin/$t"; chmod +x "$b/bin/$t";; esac; done
  exit 0
fi
exit 2
'''


def test_run_build_installs_and_records(tools, tree, tmp_path, monkeypatch):
    import io

    from rollkv_dist import log
    from rollkv_dist.build import run_build

    (tools / "cmake").write_text(FAKE_CMAKE)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    (tree / PROVENANCE_FILE).write_text(json.dumps({"series": ["0001-a.patch"], "excluded": []}))
    s = BuildSettings.resolve(tree, tmp_path / "prefix", targets="llama-server,llama-cli",
                              jobs=2, build_dir=tmp_path / "b", env=env_for(tools),
                              gpu_scan=no_gpu)
    buf = io.StringIO()
    monkeypatch.setattr(log, "_default", log.Logger(stream=buf))
    info_path = run_build(s)
    prefix = tmp_path / "prefix"
    assert (prefix / "bin" / "llama-server").is_file() and (prefix / "bin" / "llama-cli").is_file()
    assert (prefix / "lib" / "libllama.so").is_symlink()
    assert os.readlink(prefix / "lib" / "libllama.so") == "libllama.so.0.0.1"
    info = json.loads(info_path.read_text())
    assert info_path == prefix / "share" / "rollkv" / "build-info.json"
    assert info["series"] == ["0001-a.patch"] and info["variant"] == "cpu"
    assert info["cmake_definitions"]["LLAMA_BUILD_COMMIT"] == "0c1e57098+rollkv.1"
    assert "cxx" in info["compilers"] and info["date"].endswith("Z")
    assert (prefix / "share" / "rollkv" / PROVENANCE_FILE).is_file()
    out = buf.getvalue()
    assert "==> Configuring (CMake)" in out and "build: 3/3 (100 %)" in out
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in (tmp_path / "b" / "configure-args").read_text()


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


def test_jobs_zero_is_refused_naming_the_flag(tools, tree, tmp_path, capsys):
    with pytest.raises(UsageError, match=r"-j/--jobs 0"):
        BuildSettings.resolve(tree, tmp_path / "p", jobs=0, env=env_for(tools), gpu_scan=no_gpu)
    s = BuildSettings.resolve(tree, tmp_path / "p", env=env_for(tools), gpu_scan=no_gpu)
    assert s.jobs == (os.cpu_count() or 1)  # -j left out: all CPUs, said in the help


def _counting_cmake(tools: Path, tmp_path: Path) -> Path:
    """FAKE_CMAKE that also records every call in calls.txt."""
    calls = tmp_path / "calls.txt"
    (tools / "cmake").write_text(FAKE_CMAKE.replace("# stand-in", f'echo "$1" >> {calls}\n# stand-in', 1))
    return calls


@pytest.mark.parametrize("case", ["prefix-is-a-file", "parent-is-a-file", "bin-is-a-file", "too-little-space"])
def test_prefix_is_checked_before_configuring(tools, tree, tmp_path, monkeypatch, capsys, case):
    from rollkv_dist import build
    from rollkv_dist.errors import TargetError

    calls = _counting_cmake(tools, tmp_path)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    prefix = tmp_path / "prefix"
    if case == "prefix-is-a-file":
        prefix.write_text("x")
    elif case == "parent-is-a-file":
        (tmp_path / "f").write_text("x")
        prefix = tmp_path / "f" / "prefix"
    elif case == "bin-is-a-file":
        prefix.mkdir()
        (prefix / "bin").write_text("x")
    else:
        real = shutil.disk_usage
        monkeypatch.setattr(build.shutil, "disk_usage",
                            lambda p: real(p)._replace(free=150 * 2**20))
    calls.unlink(missing_ok=True)
    rc = cli.main(["build", "--source", str(tree), "--prefix", str(prefix), "--build-dir", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == TargetError.exit_code, err
    assert "--prefix" in err and str(prefix) in err
    assert not (tmp_path / "b").exists()
    assert not calls.exists() or "-S" not in calls.read_text().split(), "configured before checking the prefix"


def _fake_build(tools, tree, tmp_path, monkeypatch) -> list[str]:
    (tools / "cmake").write_text(FAKE_CMAKE)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    return ["build", "--source", str(tree), "--prefix", str(tmp_path / "prefix"), "--build-dir",
            str(tmp_path / "b"), "--targets", "llama-server,llama-bench", "-j", "1"]


def test_disk_full_during_install_leaves_the_prefix_as_it_was(tools, tree, tmp_path, monkeypatch, capsys):
    argv = _fake_build(tools, tree, tmp_path, monkeypatch)
    assert cli.main(argv) == 0
    prefix = tmp_path / "prefix"
    before = {p.relative_to(prefix): (p.is_symlink(), p.read_bytes() if p.is_file() else None)
              for p in prefix.rglob("*")}
    bench = prefix / "bin" / "llama-bench"
    assert os.access(bench, os.X_OK)
    real_copyfile = shutil.copyfile

    def full_disk(src, dst, *a, **kw):
        if Path(src).name == "llama-bench":  # half the file, then ENOSPC
            Path(dst).write_bytes(Path(src).read_bytes()[:3])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_copyfile(src, dst, *a, **kw)

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    # a second install over the first
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 6, err
    assert "disk full" in err and str(prefix) in err and f"under {os.getcwd()} " not in err
    after = {p.relative_to(prefix): (p.is_symlink(), p.read_bytes() if p.is_file() else None)
             for p in prefix.rglob("*")}
    assert after == before, "the prefix changed although the install failed"
    assert os.access(bench, os.X_OK)
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(".")) == []


def test_new_prefix_appears_complete_or_not_at_all(tools, tree, tmp_path, monkeypatch, capsys):
    argv = _fake_build(tools, tree, tmp_path, monkeypatch)

    def full_disk(src, dst, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    assert cli.main(argv) == 6
    assert not (tmp_path / "prefix").exists()
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".")] == []
