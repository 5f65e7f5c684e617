"""`rollkv build`: configure, build and install a (patched) llama.cpp tree with CMake + Ninja.

Options are resolved once into frozen BuildSettings (detection in rollkv_dist.detect), then
executed. Choices, all visible in PREFIX/share/rollkv/build-info.json:

* Offline-safe: LLAMA_USE_PREBUILT_UI=OFF and LLAMA_BUILD_UI=OFF (no UI download, no npm;
  llama-server runs without the embedded web UI), LLAMA_OPENSSL only when OpenSSL headers are
  present, GGML_CUDA_NCCL only when nccl.h is present, tests/examples/app off.
* GGML_NATIVE=OFF by default, so a build does not depend on the CPU of the build machine
  (reproducible, and binaries that run on the other hosts of a cluster); the x86 baseline is
  then AVX2/FMA/F16C. `--native` turns it on for the last bit of CPU speed (the CUDA variant
  hardly uses the CPU code).
* LLAMA_BUILD_NUMBER=0 and LLAMA_BUILD_COMMIT=<upstream commit>+rollkv.<patches> (the sdist
  has no .git, and git discovery above the tree is blocked so an enclosing repository is not
  mistaken for llama.cpp's).
* Shared libraries with RPATH $ORIGIN/../lib, installed by copying the built targets: only
  the requested targets are built, so `cmake --install` (which installs every tool) is not
  used. The prefix is relocatable.
* The prefix is checked (a directory or creatable, writable, enough free space) before the
  configure step, not after a 12-minute build. The install is staged: every file is copied
  into a temporary folder on the prefix's filesystem first and only then renamed into place,
  so a full disk or an interrupt leaves the prefix as it was (never a truncated program).
* cmake, ninja and the compilers run in their own process group (rollkv_dist.proc), killed as
  a group on failure or interrupt.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rollkv_dist import __version__, log, proc
from rollkv_dist.detect import (
    GpuScan,
    cmake_version,
    compiler_version,
    find_ninja,
    find_nvcc,
    has_nccl,
    has_openssl,
    nvcc_version,
    scan_gpus,
)
from rollkv_dist.errors import BuildError, NoGPUError, TargetError, UsageError
from rollkv_dist.pin import PIN
from rollkv_dist.source import PROVENANCE_FILE, read_provenance
from rollkv_dist.util import disk_full_error, is_enospc, make_temp_dir

DEFAULT_TARGETS = ("llama-server", "llama-cli", "llama-bench")
LOGITS_DUMP = "llama-logits-dump"
# optional programs the series adds: built by default when the tree has their tools/ folder
TOOL_TARGETS = (("logits-dump", LOGITS_DUMP), ("window-test", "llama-window-test"))
VARIANTS = ("cpu", "cuda")
_ARCH_RE = re.compile(r"^(\d+[af]?(-real|-virtual)?|native|all|all-major)$")
# free space the prefix's filesystem needs for an install (the programs and libggml*; a CUDA
# libggml-cuda alone is ~67 MB for one architecture, more with several)
INSTALL_MIB = {"cpu": 200, "cuda": 1024}


def default_targets(source_dir: Path) -> tuple[str, ...]:
    return (*DEFAULT_TARGETS, *(t for d, t in TOOL_TARGETS if (source_dir / "tools" / d).is_dir()))


def check_prefix(prefix: Path, need_mib: int) -> None:
    """Refuse a prefix that cannot take an install, before anything is built: a path that is
    not a directory, a non-writable place, or a filesystem with less than `need_mib` free."""
    if prefix.exists() and not prefix.is_dir():
        raise TargetError(f"--prefix {prefix} exists and is not a directory: choose another --prefix")
    probe = prefix
    while not probe.exists():
        if probe == probe.parent:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise TargetError(f"--prefix {prefix}: {probe} is not a directory: choose another --prefix")
    for sub in ("bin", "lib", "share"):
        d = prefix / sub
        if d.exists() and not d.is_dir():
            raise TargetError(f"--prefix {prefix}: {d} is not a directory: remove it or choose "
                              f"another --prefix")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise TargetError(f"--prefix {prefix}: {probe} is not writable: choose a writable --prefix "
                          f"(or fix its permissions)")
    try:
        free_mib = shutil.disk_usage(probe).free / 2**20
    except OSError:
        return
    if free_mib < need_mib:
        raise TargetError(f"--prefix {prefix}: {free_mib:.0f} MiB free on its filesystem, an install "
                          f"needs about {need_mib} MiB: free some space or choose a --prefix on "
                          f"another filesystem")


def parse_archs(text: str) -> tuple[str, ...]:
    """'90-real,120a-real' or 'sm_90;sm_89' -> ('90-real', '120a-real'); validated."""
    archs = []
    for part in re.split(r"[,;\s]+", text.strip()):
        if not part:
            continue
        part = part.removeprefix("sm_").removeprefix("compute_")
        if not _ARCH_RE.match(part):
            raise UsageError(f"--cuda-arch {part!r} is not a CUDA architecture: use values like "
                             f"90-real, 89, 120a-real (CMAKE_CUDA_ARCHITECTURES syntax)")
        archs.append(part)
    if not archs:
        raise UsageError("--cuda-arch is empty: give e.g. 90-real")
    return tuple(dict.fromkeys(archs))


@dataclass(frozen=True)
class BuildSettings:
    source_dir: Path
    prefix: Path
    build_dir: Path
    variant: str
    cuda_archs: tuple[str, ...]
    arch_source: str
    targets: tuple[str, ...]
    jobs: int
    native: bool
    build_type: str
    cmake: str
    ninja: str
    nvcc: str | None
    openssl: bool
    nccl: bool
    build_number: int
    build_commit: str
    series: tuple[str, ...]
    excluded: tuple[str, ...]
    extra_cmake_args: tuple[str, ...] = field(default=())

    @classmethod
    def resolve(
        cls,
        source_dir: str | os.PathLike[str],
        prefix: str | os.PathLike[str],
        *,
        variant: str = "cpu",
        cuda_arch: str | None = None,
        targets: str | None = None,
        jobs: int | None = None,
        build_dir: str | os.PathLike[str] | None = None,
        native: bool = False,
        build_type: str = "Release",
        extra_cmake_args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        gpu_scan: Callable[[], GpuScan] = scan_gpus,
    ) -> BuildSettings:
        env = os.environ if env is None else env
        src = Path(source_dir).absolute()
        if not (src / "CMakeLists.txt").is_file() or not (src / "ggml").is_dir():
            raise UsageError(f"{src} is not a llama.cpp source tree: make one with "
                             f"`rollkv source DIR` (or unpack a `rollkv pack` archive)")
        if variant not in VARIANTS:
            raise UsageError(f"--variant {variant!r}: choose one of {', '.join(VARIANTS)}")
        cmake = shutil.which("cmake", path=env.get("PATH"))
        if not cmake:
            raise BuildError("cmake not found: install CMake >= 3.18 (e.g. `pip install cmake`)")
        ver = cmake_version(cmake)
        if ver is not None and ver < (3, 18):
            raise BuildError(f"cmake {'.'.join(map(str, ver))} is too old: the pinned llama.cpp "
                             f"needs >= 3.18; install a newer one (e.g. `pip install cmake`)")
        ninja = find_ninja(env)
        if not ninja:
            raise BuildError("ninja not found: install it (e.g. `pip install ninja`)")

        nvcc = None
        archs: tuple[str, ...] = ()
        arch_source = ""
        if variant == "cuda":
            nvcc = find_nvcc(env)
            if not nvcc:
                raise BuildError("--variant cuda needs the CUDA toolkit's nvcc, which was not "
                                 "found on PATH, $CUDACXX or /usr/local/cuda: install the CUDA "
                                 "toolkit or use --variant cpu")
            if cuda_arch:
                archs, arch_source = parse_archs(cuda_arch), "explicit"
            else:
                scan = gpu_scan()
                if not scan.gpus:
                    raise NoGPUError(f"no GPU to take CUDA architectures from ({scan.reason}): "
                                     f"pass --cuda-arch, e.g. --cuda-arch 90-real for H100/H200")
                archs, arch_source = scan.cuda_archs, "nvml"
        elif cuda_arch:
            raise UsageError("--cuda-arch only applies to --variant cuda")

        if targets:
            tlist = tuple(t for t in re.split(r"[,\s]+", targets) if t)
        else:
            tlist = default_targets(src)
        if not tlist:
            raise UsageError("--targets is empty")
        if jobs is not None and jobs < 1:
            raise UsageError(f"-j/--jobs {jobs}: give a number of parallel jobs >= 1, or leave "
                             f"-j out to use all {os.cpu_count() or 1} CPUs")
        njobs = jobs if jobs is not None else (os.cpu_count() or 1)
        prefix_path = Path(prefix).absolute()
        check_prefix(prefix_path, INSTALL_MIB[variant])

        prov = read_provenance(src) or {}
        series = tuple(prov.get("series", ()))
        excluded = tuple(prov.get("excluded", ()))
        commit = f"{PIN.llama_commit}+rollkv.{len(series)}"
        if excluded:
            commit += "-without-" + "-".join(x.split("-", 1)[0] for x in excluded)
        return cls(
            source_dir=src,
            prefix=prefix_path,
            build_dir=Path(build_dir).absolute() if build_dir else src / f"build-{variant}",
            variant=variant,
            cuda_archs=archs,
            arch_source=arch_source,
            targets=tlist,
            jobs=njobs,
            native=native,
            build_type=build_type,
            cmake=cmake,
            ninja=ninja,
            nvcc=nvcc,
            openssl=has_openssl(env),
            nccl=variant == "cuda" and has_nccl(nvcc, env),
            build_number=0,
            build_commit=commit,
            series=series,
            excluded=excluded,
            extra_cmake_args=tuple(extra_cmake_args),
        )

    def cmake_definitions(self) -> dict[str, str]:
        on = {True: "ON", False: "OFF"}
        d = {
            "CMAKE_BUILD_TYPE": self.build_type,
            "CMAKE_INSTALL_PREFIX": str(self.prefix),
            "CMAKE_MAKE_PROGRAM": self.ninja,
            "BUILD_SHARED_LIBS": "ON",
            "CMAKE_BUILD_WITH_INSTALL_RPATH": "ON",
            "CMAKE_INSTALL_RPATH": "$ORIGIN/../lib;$ORIGIN",
            "LLAMA_BUILD_TESTS": "OFF",
            "LLAMA_BUILD_EXAMPLES": "OFF",
            "LLAMA_BUILD_APP": "OFF",
            "LLAMA_BUILD_TOOLS": "ON",
            "LLAMA_BUILD_SERVER": "ON",
            "LLAMA_BUILD_UI": "OFF",
            "LLAMA_USE_PREBUILT_UI": "OFF",
            "LLAMA_OPENSSL": on[self.openssl],
            "LLAMA_BUILD_NUMBER": str(self.build_number),
            "LLAMA_BUILD_COMMIT": self.build_commit,
            "GGML_NATIVE": on[self.native],
            "GGML_CUDA": on[self.variant == "cuda"],
        }
        if self.variant == "cuda":
            d["CMAKE_CUDA_ARCHITECTURES"] = ";".join(self.cuda_archs)
            d["GGML_CUDA_NCCL"] = on[self.nccl]
            if self.nvcc:
                d["CMAKE_CUDA_COMPILER"] = self.nvcc
        return d

    def configure_command(self) -> list[str]:
        cmd = [self.cmake, "-S", str(self.source_dir), "-B", str(self.build_dir), "-G", "Ninja"]
        cmd += [f"-D{k}={v}" for k, v in self.cmake_definitions().items()]
        cmd += list(self.extra_cmake_args)
        return cmd

    def build_command(self) -> list[str]:
        return [self.cmake, "--build", str(self.build_dir), "--target", *self.targets,
                "-j", str(self.jobs)]


# --------------------------------------------------------------------------- execution


def _build_env(settings: BuildSettings) -> dict[str, str]:
    env = dict(os.environ)
    # cmake/build-info.cmake and ggml ask git for a commit: keep them from finding a
    # repository that merely contains the tree.
    env["GIT_CEILING_DIRECTORIES"] = str(settings.source_dir.parent)
    env.setdefault("CLICOLOR_FORCE", "0")
    return env


def _run_logged(cmd: list[str], logfile: Path, env: Mapping[str, str], what: str,
                ninja_progress: bool = False) -> None:
    bar = log.progress(what) if ninja_progress else None
    with open(logfile, "a") as lf:
        lf.write(f"$ {' '.join(cmd)}\n")
        lf.flush()
        try:
            with proc.running(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True, errors="replace",
                              env=dict(env)) as child:
                assert child.stdout is not None
                for line in child.stdout:
                    lf.write(line)
                    if bar is not None:
                        got = log.parse_ninja_progress(line)
                        if got:
                            bar.update(got[0], got[1])
                child.wait()
        finally:
            if bar is not None:
                bar.finish()
    if child.returncode != 0:
        lines = logfile.read_text(errors="replace").splitlines()
        failed = [i for i, ln in enumerate(lines) if ln.startswith("FAILED:")]
        start = failed[0] if failed else max(0, len(lines) - 25)
        excerpt = "\n".join(lines[start:start + 25])
        raise BuildError(f"{what} failed (exit {child.returncode}); full log: {logfile}\n"
                         f"{excerpt}\nfix: see the first error above; a clean retry needs "
                         f"removing the build dir {logfile.parent}")


def _cache_value(build_dir: Path, key: str) -> str | None:
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return None
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith(key + ":"):
            return line.split("=", 1)[1]
    return None


def _stage_install(settings: BuildSettings, stage: Path) -> list[str]:
    """Copy the built executables and the shared libraries into `stage` (bin/, lib/)."""
    bindir = settings.build_dir / "bin"
    sbin, slib = stage / "bin", stage / "lib"
    sbin.mkdir(parents=True, exist_ok=True)
    slib.mkdir(parents=True, exist_ok=True)
    installed = []
    for t in settings.targets:
        exe = bindir / t
        if not exe.is_file():
            raise BuildError(f"target {t} was built but {exe} is missing: is it an executable "
                             f"target? (--targets takes executable names)")
        shutil.copy2(exe, sbin / t)
        installed.append(f"bin/{t}")
    for lib in sorted(bindir.glob("*.so*")):
        if lib.is_symlink():
            os.symlink(os.readlink(lib), slib / lib.name)
        else:
            shutil.copy2(lib, slib / lib.name)
        installed.append(f"lib/{lib.name}")
    return installed


def _commit_stage(stage: Path, prefix: Path) -> None:
    """Move the staged files into the prefix: one rename for a new prefix, else one atomic
    rename per file (all copying, which is what can run out of space, is already done)."""
    if not prefix.exists():
        os.chmod(stage, 0o755)
        os.rename(stage, prefix)
        return
    for root, dirs, files in os.walk(stage):
        rel = Path(root).relative_to(stage)
        (prefix / rel).mkdir(parents=True, exist_ok=True)
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            os.replace(Path(root) / name, prefix / rel / name)


def install(settings: BuildSettings, seconds_so_far: Callable[[], float]) -> Path:
    """Stage the install (programs, libraries, provenance, build-info.json) next to or inside
    the prefix, then move it into place. Returns the path of build-info.json."""
    prefix = settings.prefix
    # on the prefix's filesystem, so that moving the files in is a rename
    stage = make_temp_dir(prefix if prefix.is_dir() else prefix.parent, f".{prefix.name}.rollkv-install-")
    try:
        installed = _stage_install(settings, stage)
        share = stage / "share" / "rollkv"
        share.mkdir(parents=True)
        prov = settings.source_dir / PROVENANCE_FILE
        if prov.is_file():
            shutil.copy2(prov, share / PROVENANCE_FILE)
        info = build_info(settings, installed, seconds_so_far())
        (share / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        for d in (stage / "bin", stage / "lib", stage / "share", share):
            os.chmod(d, 0o755)
        _commit_stage(stage, prefix)
    except OSError as exc:
        if is_enospc(exc):
            raise disk_full_error(prefix, exc) from exc
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info(f"{len(installed)} files; {prefix / 'share' / 'rollkv' / 'build-info.json'}")
    return prefix / "share" / "rollkv" / "build-info.json"


def build_info(settings: BuildSettings, installed: list[str], seconds: float) -> dict:
    compilers = {}
    for lang in ("C", "CXX", "CUDA"):
        path = _cache_value(settings.build_dir, f"CMAKE_{lang}_COMPILER")
        if path:
            compilers[lang.lower()] = {
                "path": path,
                "version": (nvcc_version(path) if lang == "CUDA" else compiler_version(path)),
            }
    prov = read_provenance(settings.source_dir)
    return {
        "schema": 1,
        "tool": {"name": "rollkv", "version": __version__},
        "pin": {"project": PIN.project, "version": PIN.version, "sha256": PIN.sha256,
                "llama_commit": PIN.llama_commit},
        "series": list(settings.series),
        "excluded": list(settings.excluded),
        "provenance": prov,
        "variant": settings.variant,
        "cuda_archs": list(settings.cuda_archs),
        "cuda_archs_from": settings.arch_source,
        "targets": list(settings.targets),
        "cmake_definitions": settings.cmake_definitions(),
        "extra_cmake_args": list(settings.extra_cmake_args),
        "cmake_version": ".".join(map(str, cmake_version(settings.cmake) or ())),
        "compilers": compilers,
        "machine": {"system": platform.system(), "arch": platform.machine()},
        "source_dir": str(settings.source_dir),
        "build_dir": str(settings.build_dir),
        "installed": installed,
        "build_seconds": round(seconds, 1),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def run_build(settings: BuildSettings) -> Path:
    """Configure, build, install; returns the path of build-info.json."""
    import time

    start = time.monotonic()
    env = _build_env(settings)
    try:
        settings.build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create the build dir {settings.build_dir} ({exc.strerror}): "
                         f"pass --build-dir") from exc
    logfile = settings.build_dir / "rollkv-build.log"
    logfile.write_text("")
    log.info(f"variant {settings.variant}"
             + (f", CUDA archs {';'.join(settings.cuda_archs)} ({settings.arch_source})"
                if settings.variant == "cuda" else "")
             + f", targets {' '.join(settings.targets)}, -j{settings.jobs}")
    log.info(f"build dir {settings.build_dir} (log: {logfile})")
    with log.step("Configuring (CMake)"):
        _run_logged(settings.configure_command(), logfile, env, "configure")
    with log.step(f"Building {', '.join(settings.targets)}"):
        _run_logged(settings.build_command(), logfile, env, "build", ninja_progress=True)
    with log.step(f"Installing into {settings.prefix}"):
        return install(settings, lambda: time.monotonic() - start)


def _run(args: argparse.Namespace) -> int:
    settings = BuildSettings.resolve(
        args.source, args.prefix, variant=args.variant, cuda_arch=args.cuda_arch,
        targets=args.targets, jobs=args.jobs, build_dir=args.build_dir, native=args.native,
        build_type=args.build_type, extra_cmake_args=tuple(args.cmake_arg or ()),
    )
    run_build(settings)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "build", help="configure, build and install llama.cpp (CMake + Ninja)",
        description="Build a tree made by `rollkv source` (or unpacked from `rollkv pack`) and "
                    "install the targets into --prefix, with PREFIX/share/rollkv/build-info.json.",
    )
    p.add_argument("--source", default=".", help="llama.cpp source tree (default: .)")
    p.add_argument("--prefix", required=True, help="install prefix")
    p.add_argument("--variant", choices=VARIANTS, default="cpu", help="cpu (default) or cuda")
    p.add_argument("--cuda-arch", help="CUDA architectures, e.g. 90-real or 89-real,90-real "
                   "(default: from the GPUs NVML reports)")
    p.add_argument("--targets", help="comma-separated executables (default: llama-server, "
                   "llama-cli, llama-bench, plus llama-logits-dump when the tree has it)")
    p.add_argument("-j", "--jobs", type=int, help="parallel jobs, >= 1 (default: all CPUs)")
    p.add_argument("--build-dir", help="persistent build directory for incremental rebuilds "
                   "(default: SOURCE/build-VARIANT)")
    p.add_argument("--native", action="store_true",
                   help="GGML_NATIVE=ON: optimise CPU code for this machine (not reproducible)")
    p.add_argument("--build-type", default="Release", help="CMAKE_BUILD_TYPE (default Release)")
    p.add_argument("--cmake-arg", action="append", metavar="ARG",
                   help="extra argument for the CMake configure step (repeatable)")
    p.set_defaults(handler=_run)
