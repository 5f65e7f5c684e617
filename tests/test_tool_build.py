"""rollkv build: settings resolution (no compiling), CUDA arch detection from a fake NVML."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import types
from pathlib import Path

import pytest
from _rollkv_tool_helpers import make_build_tree

from rollkv_dist import cli
from rollkv_dist.build import INITIAL_CACHE, BuildSettings, initial_cache, parse_archs
from rollkv_dist.gpu import GPUProbe, probe
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


def no_gpu() -> GPUProbe:
    return GPUProbe(reason="NVML init failed: Driver Not Loaded")


def test_cpu_defaults(tools, tree, tmp_path):
    s = BuildSettings.resolve(tree, tmp_path / "prefix", env=env_for(tools), gpu_scan=no_gpu)
    assert s.variant.name == "cpu" and s.cuda_archs == ()
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


def test_the_series_programs_are_in_the_build_definition(tools, tree, tmp_path):
    # the one build definition ships the programs the series adds (rollkv-programs.cmake keeps only
    # those the tree defines); without --targets rollkv passes no list of its own
    programs = initial_cache()["ROLLKV_PROGRAMS"].split(";")
    assert {"llama-logits-dump", "llama-window-test"} <= set(programs)
    assert programs[:3] == ["llama-server", "llama-cli", "llama-bench"]
    s = BuildSettings.resolve(tree, tmp_path / "p", env=env_for(tools), gpu_scan=no_gpu)
    assert s.targets == () and "ROLLKV_PROGRAMS" not in s.cmake_definitions()
    # --targets still overrides the definition's list
    s2 = BuildSettings.resolve(tree, tmp_path / "p", targets="llama-bench", env=env_for(tools), gpu_scan=no_gpu)
    assert s2.targets == ("llama-bench",) and s2.cmake_definitions()["ROLLKV_PROGRAMS"] == "llama-bench"


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


def test_a_variant_has_one_name_across_build_and_channel(tools, tree, tmp_path):
    """`--variant` takes cpu, cuda (the toolkit found) or the toolkit's own name (cuda130), the names of
    `rollkv channel` and of the conda build string; another CUDA version or another word is a usage error."""
    from rollkv_dist.detect import machine_variants

    _tool(tools, "nvcc", "Cuda compilation tools, release 13.0, V13.0.88")
    env = env_for(tools)
    assert [v.name for v in machine_variants(env)] == ["cpu", "cuda130"]
    for name in ("cuda", "cuda130"):
        s = BuildSettings.resolve(tree, tmp_path / "p", variant=name, cuda_arch="90-real", env=env, gpu_scan=no_gpu)
        assert (s.variant.name, s.variant.kind, s.variant.cuda_version) == ("cuda130", "cuda", "13.0")
        assert s.cmake_definitions()["GGML_CUDA"] == "ON"
    with pytest.raises(UsageError, match="--variant cuda129: this machine's nvcc .* builds cuda130"):
        BuildSettings.resolve(tree, tmp_path / "p", variant="cuda129", cuda_arch="90-real", env=env, gpu_scan=no_gpu)
    with pytest.raises(UsageError, match="--variant 'gpu': choose cpu, cuda"):
        BuildSettings.resolve(tree, tmp_path / "p", variant="gpu", env=env, gpu_scan=no_gpu)


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

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=143771 << 20, free=143000 << 20)


def test_arch_detection_from_nvml():
    nvml = FakeNVML([(9, 0), (12, 0), (9, 0)])
    scan = probe(nvml)  # the one GPU probe (rollkv_dist.gpu), as rollkv build uses it
    assert nvml.shut
    assert [g.name for g in scan.gpus] == ["NVIDIA H200", "NVIDIA RTX PRO 6000", "NVIDIA H200"]
    g0 = scan.gpus[0]
    assert (g0.index, g0.name, g0.uuid, g0.compute_capability) == (0, "NVIDIA H200", "GPU-00000000", (9, 0))
    assert scan.cuda_archs == ("90-real", "120-real")


def test_nvml_failure_keeps_its_reason(tools, tree, tmp_path):
    scan = probe(FakeNVML([], init_error=RuntimeError("Driver Not Loaded")))
    assert scan.gpus == [] and "Driver Not Loaded" in scan.reason
    assert probe(FakeNVML([])).reason == "NVML found 0 devices"
    _tool(tools, "nvcc", "x")
    s = BuildSettings.resolve(tree, tmp_path / "p", variant="cuda", env=env_for(tools),
                              gpu_scan=lambda: probe(FakeNVML([(8, 6), (9, 0)])))
    assert s.cuda_archs == ("86-real", "90-real") and s.arch_source == "nvml"


FAKE_CMAKE = r'''#!/bin/sh
# stand-in for cmake's three steps: configure (-C rollkv.cmake) writes a cache and
# rollkv-programs.txt, --build prints ninja lines and makes bin/, the install script
# (-DROLLKV_BUILD_DIR=B -DCMAKE_INSTALL_PREFIX=P -P ...) copies the programs and libraries to
# $DESTDIR$P and writes the manifest (paths in P), as rollkv-install.cmake does
if [ "$1" = "--version" ]; then echo "cmake version 3.25.1"; exit 0; fi
if [ "$1" = "-C" ]; then
  mkdir -p "$6"
  echo "CMAKE_CXX_COMPILER:FILEPATH=$(command -v cc || echo /bin/true)" > "$6/CMakeCache.txt"
  echo "$@" > "$6/configure-args"
  progs="llama-server;llama-cli;llama-bench"
  for a in "$@"; do case "$a" in -DROLLKV_PROGRAMS=*) progs="${a#-DROLLKV_PROGRAMS=}";; esac; done
  printf '%s' "$progs" > "$6/rollkv-programs.txt"
  echo "-- Configuring done"; exit 0
fi
if [ "$1" = "--build" ]; then
  b="$2"
  mkdir -p "$b/bin"
  if [ -n "$FAKE_FAIL" ]; then
    echo "[1/2] Building CXX object a.o"; echo "FAILED: a.o"; echo "a.cpp:1: error: boom"; exit 1
  fi
  echo "[1/3] Building C object x.o"; echo "[2/3] Linking libllama.so"; echo "[3/3] Linking"
  printf 'lib' > "$b/bin/libllama.so.0.0.1"; ln -sf libllama.so.0.0.1 "$b/bin/libllama.so"
  for t in $(tr ';' ' ' < "$b/rollkv-programs.txt"); do
    printf '#!/bin/sh\n' > "$b/bin/$t"; chmod +x "$b/bin/$t"
  done
  exit 0
fi
case "$1" in -DROLLKV_BUILD_DIR=*)
  b="${1#-DROLLKV_BUILD_DIR=}"; d="$DESTDIR${2#-DCMAKE_INSTALL_PREFIX=}"
  mkdir -p "$d/bin" "$d/lib"; : > "$b/rollkv-install-manifest.txt"
  for f in $(tr ';' ' ' < "$b/rollkv-programs.txt") libllama.so.0.0.1 libllama.so; do
    case "$f" in lib*) to="$d/lib/$f";; *) to="$d/bin/$f";; esac
    echo "-- Installing: $to"
    if [ "$f" = "$FAKE_ENOSPC" ]; then  # half the file, then what cmake prints for ENOSPC
      head -c 3 "$b/bin/$f" > "$to"
      printf 'CMake Error at rollkv-install.cmake:46 (file):\n  file INSTALL cannot copy file\n  "%s" to\n  "%s": No space left on\n  device.\n\n' "$b/bin/$f" "$to"
      exit 1
    fi
    cp -P "$b/bin/$f" "$to"; echo "${to#"$DESTDIR"}" >> "$b/rollkv-install-manifest.txt"
  done
  exit 0;;
esac
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
    # staged with DESTDIR: the files name the prefix, not the staging folder
    assert "prefix=" + str(prefix) + "\n" in (prefix / "lib" / "pkgconfig" / "llama.pc").read_text()
    assert all(not f.startswith((".", "/")) and ".rollkv-install-" not in f for f in info["installed"])
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".")] == []
    # again, over the existing prefix (staged inside it this time, then moved in file by file)
    files = sorted(p.relative_to(prefix).as_posix() for p in prefix.rglob("*"))
    run_build(s)
    assert sorted(p.relative_to(prefix).as_posix() for p in prefix.rglob("*")) == files
    assert json.loads(info_path.read_text())["installed"] == info["installed"]


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


@pytest.mark.parametrize("case", ["prefix-is-a-file", "parent-is-a-file", "bin-is-a-file", "include-is-a-file",
                                  "too-little-space"])
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
    elif case in ("bin-is-a-file", "include-is-a-file"):  # the install writes bin/ and include/
        prefix.mkdir()
        (prefix / case.split("-")[0]).write_text("x")
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
    # only the version probe ran: no configure (`cmake -C rollkv.cmake -S ...`), build or install
    assert not calls.exists() or set(calls.read_text().split()) <= {"--version"}, \
        "configured before checking the prefix"


def _fake_build(tools, tree, tmp_path, monkeypatch) -> list[str]:
    (tools / "cmake").write_text(FAKE_CMAKE)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    return ["build", "--source", str(tree), "--prefix", str(tmp_path / "prefix"), "--build-dir",
            str(tmp_path / "b"), "--targets", "llama-server,llama-bench", "-j", "1"]


def _disk_full_at(where: str, monkeypatch) -> None:
    """ENOSPC in the install: `cmake` (its file(INSTALL) copying llama-bench, half written) or
    `python` (rollkv copying the provenance into the staged prefix, half written)."""
    if where == "cmake":
        monkeypatch.setenv("FAKE_ENOSPC", "llama-bench")
        return
    real_copyfile = shutil.copyfile

    def full_disk(src, dst, *a, **kw):
        if Path(src).name == PROVENANCE_FILE:  # half the file, then ENOSPC
            Path(dst).write_bytes(Path(src).read_bytes()[:3])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_copyfile(src, dst, *a, **kw)

    monkeypatch.setattr(shutil, "copyfile", full_disk)


@pytest.mark.parametrize("where", ["cmake", "python"])
def test_disk_full_during_install_leaves_the_prefix_as_it_was(tools, tree, tmp_path, monkeypatch, capsys,
                                                               where):
    argv = _fake_build(tools, tree, tmp_path, monkeypatch)
    (tree / PROVENANCE_FILE).write_text(json.dumps({"series": [], "excluded": []}))
    assert cli.main(argv) == 0
    prefix = tmp_path / "prefix"
    before = {p.relative_to(prefix): (p.is_symlink(), p.read_bytes() if p.is_file() else None)
              for p in prefix.rglob("*")}
    bench = prefix / "bin" / "llama-bench"
    assert os.access(bench, os.X_OK)
    assert (prefix / "share" / "rollkv" / PROVENANCE_FILE).is_file()
    _disk_full_at(where, monkeypatch)
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


@pytest.mark.parametrize("where", ["cmake", "python"])
def test_new_prefix_appears_complete_or_not_at_all(tools, tree, tmp_path, monkeypatch, capsys, where):
    argv = _fake_build(tools, tree, tmp_path, monkeypatch)
    (tree / PROVENANCE_FILE).write_text(json.dumps({"series": [], "excluded": []}))
    _disk_full_at(where, monkeypatch)
    assert cli.main(argv) == 6
    assert "disk full" in capsys.readouterr().err
    assert not (tmp_path / "prefix").exists()
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".")] == []


def test_install_over_a_prefix_with_a_folder_in_a_file_s_place_moves_nothing(tools, tree, tmp_path,
                                                                             monkeypatch, capsys):
    """A clash found while moving the staged files in would stop half-way: it is found first."""
    argv = _fake_build(tools, tree, tmp_path, monkeypatch)
    prefix = tmp_path / "prefix"
    (prefix / "bin" / "llama-bench").mkdir(parents=True)
    (prefix / "bin" / "llama-server").write_text("old")
    assert cli.main(argv) == 6
    err = capsys.readouterr().err
    assert str(prefix / "bin" / "llama-bench") in err and "directory" in err
    assert (prefix / "bin" / "llama-server").read_text() == "old"
    assert not (prefix / "lib").exists() and not (prefix / "share").exists()
    assert [x.name for x in prefix.iterdir() if x.name.startswith(".")] == []
