"""`rollkv build`: configure, build and install a (patched) llama.cpp tree with CMake + Ninja.

Options are resolved once into frozen BuildSettings (detection in rollkv_dist.detect), then
executed. The build itself is rollkv's one build definition, shared with recipe/build.sh and
flake.nix (rollkv_dist/cmake/):

* configure with the initial cache `cmake -C rollkv_dist/cmake/rollkv.cmake` (offline-safe,
  reproducible flags, shared libraries with RPATH $ORIGIN/../lib, the CUDA architecture
  list, the program list) plus what only this tool decides: prefix, ninja, the build id,
  the CUDA switch and architectures (from NVML or --cuda-arch), `--native`, `--targets`;
* build the target `rollkv-programs` (the programs and what they link, nothing else);
* install with `cmake -P rollkv_dist/cmake/rollkv-install.cmake` (upstream's install rules
  for the libraries, headers and CMake package, plus the programs and the libraries they
  load). The prefix is relocatable.

LLAMA_BUILD_COMMIT is <upstream commit>+rollkv.<patches> (rollkv_dist.series.build_commit;
the sdist has no .git, and git discovery above the tree is blocked so an enclosing repository
is not mistaken for llama.cpp's). Everything is recorded in PREFIX/share/rollkv/build-info.json,
and the series in PREFIX/share/rollkv-llamafile (as the conda package and the Nix build do).

What only this tool adds around those steps:

* The prefix is checked (a directory or creatable, writable, enough free space) before the
  configure step, not after a 12-minute build; `-j 0` is refused.
* The install is staged: the install script runs with DESTDIR set to a temporary folder on the
  prefix's filesystem, the series record and build-info.json are written there too, and only
  then is everything renamed into place, so a full disk (reported as such, naming the prefix)
  or an interrupt leaves the prefix as it was (never a truncated program).
* cmake, ninja and the compilers run in their own process group (rollkv_dist.proc), killed as
  a group on failure or interrupt.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import errno
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rollkv_dist.commands import add_command
from rollkv_dist import __version__, gpu, log, proc
from rollkv_dist.detect import (
    Variant,
    cmake_version,
    compiler_version,
    find_ninja,
    nvcc_version,
    resolve_variant,
)
from rollkv_dist.errors import BuildError, NoGPUError, TargetError, UsageError
from rollkv_dist.pin import PIN
from rollkv_dist.series import LAB_KEY, SERIES_FILE, build_commit, package_version, record_series
from rollkv_dist.source import PROVENANCE_FILE, read_provenance
from rollkv_dist.util import (
    default_patches_dir,
    disk_full_error,
    is_enospc,
    make_temp_dir,
    resolve_jobs,
)

CMAKE_DIR = Path(__file__).resolve().parent / "cmake"
INITIAL_CACHE = CMAKE_DIR / "rollkv.cmake"
INSTALL_SCRIPT = CMAKE_DIR / "rollkv-install.cmake"
PROGRAMS_TARGET = "rollkv-programs"
_ARCH_RE = re.compile(r"^(\d+[af]?(-real|-virtual)?|native|all|all-major)$")
# free space the prefix's filesystem needs for an install (the programs and libggml*; a CUDA
# libggml-cuda alone is ~67 MB for one architecture, more with several)
INSTALL_MIB = {"cpu": 200, "cuda": 1024}
_CACHE_SET_RE = re.compile(r'^set\(([A-Za-z_][A-Za-z0-9_.]*)\s+("([^"]*)"|(\S+))\s', re.M)


def initial_cache(path: Path = INITIAL_CACHE) -> dict[str, str]:
    """The cache entries rollkv.cmake sets (name -> value), in file order."""
    return {m.group(1): m.group(3) if m.group(3) is not None else m.group(4)
            for m in _CACHE_SET_RE.finditer(path.read_text())}


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
    for sub in ("bin", "lib", "include", "share"):
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
    variant: Variant
    cuda_archs: tuple[str, ...]
    arch_source: str
    targets: tuple[str, ...]
    jobs: int
    native: bool
    build_type: str
    cmake: str
    ninja: str
    nvcc: str | None
    build_commit: str
    series: tuple[str, ...]
    excluded: tuple[str, ...]
    lab: tuple[str, ...]  # the lab overlay's patches (a comparison build), none for the product
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
        gpu_scan: Callable[[], gpu.GPUProbe] = gpu.probe,
    ) -> BuildSettings:
        env = os.environ if env is None else env
        src = Path(source_dir).absolute()
        if not (src / "CMakeLists.txt").is_file() or not (src / "ggml").is_dir():
            raise UsageError(f"{src} is not a llama.cpp source tree: make one with "
                             f"`rollkv source DIR` (or unpack a `rollkv pack` archive)")
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

        chosen, nvcc = resolve_variant(variant, env)
        archs: tuple[str, ...] = ()
        arch_source = ""
        if chosen.kind == "cuda":
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

        tlist = tuple(t for t in re.split(r"[,\s]+", targets or "") if t)
        if targets is not None and not tlist:
            raise UsageError("--targets is empty")
        njobs = resolve_jobs(jobs)
        prefix_path = Path(prefix).absolute()
        check_prefix(prefix_path, INSTALL_MIB[chosen.kind])

        prov = read_provenance(src) or {}
        series = tuple(prov.get("series", ()))
        excluded = tuple(prov.get("excluded", ()))
        lab = tuple(prov.get(LAB_KEY, ()))
        return cls(
            source_dir=src,
            prefix=prefix_path,
            build_dir=Path(build_dir).absolute() if build_dir else src / f"build-{chosen.kind}",
            variant=chosen,
            cuda_archs=archs,
            arch_source=arch_source,
            targets=tlist,
            jobs=njobs,
            native=native,
            build_type=build_type,
            cmake=cmake,
            ninja=ninja,
            nvcc=nvcc,
            build_commit=build_commit(series, excluded, lab=lab),
            series=series,
            excluded=excluded,
            lab=lab,
            extra_cmake_args=tuple(extra_cmake_args),
        )

    def cmake_definitions(self) -> dict[str, str]:
        """What this tool adds to rollkv.cmake on the configure line (-D wins over -C)."""
        d = {
            "CMAKE_INSTALL_PREFIX": str(self.prefix),
            "CMAKE_MAKE_PROGRAM": self.ninja,
            "LLAMA_BUILD_COMMIT": self.build_commit,
        }
        if self.build_type != "Release":
            d["CMAKE_BUILD_TYPE"] = self.build_type
        if self.native:
            d["GGML_NATIVE"] = "ON"
        if self.targets:
            d["ROLLKV_PROGRAMS"] = ";".join(self.targets)
        if self.variant.kind == "cuda":
            d["GGML_CUDA"] = "ON"
            d["CMAKE_CUDA_ARCHITECTURES"] = ";".join(self.cuda_archs)
            if self.nvcc:
                d["CMAKE_CUDA_COMPILER"] = self.nvcc
        return d

    def configure_command(self) -> list[str]:
        cmd = [self.cmake, "-C", str(INITIAL_CACHE), "-S", str(self.source_dir),
               "-B", str(self.build_dir), "-G", "Ninja"]
        cmd += [f"-D{k}={v}" for k, v in self.cmake_definitions().items()]
        cmd += list(self.extra_cmake_args)
        return cmd

    def build_command(self) -> list[str]:
        return [self.cmake, "--build", str(self.build_dir), "--target", PROGRAMS_TARGET,
                "-j", str(self.jobs)]

    def install_command(self) -> list[str]:
        return [self.cmake, f"-DROLLKV_BUILD_DIR={self.build_dir}",
                f"-DCMAKE_INSTALL_PREFIX={self.prefix}", "-P", str(INSTALL_SCRIPT)]


# --------------------------------------------------------------------------- execution


def _build_env(settings: BuildSettings) -> dict[str, str]:
    env = dict(os.environ)
    # cmake/build-info.cmake and ggml ask git for a commit: keep them from finding a
    # repository that merely contains the tree.
    env["GIT_CEILING_DIRECTORIES"] = str(settings.source_dir.parent)
    env.setdefault("CLICOLOR_FORCE", "0")
    return env


def run_logged(cmd: list[str], logfile: Path, env: Mapping[str, str], what: str,
               ninja_progress: bool = False, cwd: Path | None = None) -> None:
    """cmd with its output appended to logfile; with ninja_progress, ninja's [N/M] lines drive a progress
    line (`what: N/M (P %), elapsed`). A failure is a BuildError with the first error of the log."""
    bar = log.progress(what) if ninja_progress else None
    with open(logfile, "a") as lf:
        lf.write(f"$ {' '.join(cmd)}\n")
        lf.flush()
        try:
            with proc.running(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True, errors="replace",
                              env=dict(env), cwd=cwd) as child:
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


def _programs(settings: BuildSettings) -> list[str]:
    """The programs the configure step chose (ROLLKV_PROGRAMS that the tree defines)."""
    return (settings.build_dir / "rollkv-programs.txt").read_text().strip().split(";")


def _installed(settings: BuildSettings) -> list[str]:
    """Files the install script installed, relative to the prefix (the manifest names them by
    their place in the prefix, without DESTDIR)."""
    manifest = settings.build_dir / "rollkv-install-manifest.txt"
    out = []
    for line in manifest.read_text().splitlines():
        if line.strip():
            out.append(Path(line).relative_to(settings.prefix).as_posix())
    return out


def _record_series(settings: BuildSettings, root: Path) -> None:
    """ROOT/share/rollkv-llamafile like the conda package: series, patches, build-info.txt.

    The patches come from the tree (a `rollkv pack` archive carries them) or the repository's
    queue; when neither holds them all, nothing is recorded there."""
    for queue in (settings.source_dir / "patches", default_patches_dir()):
        if (queue / SERIES_FILE).is_file() and all((queue / n).is_file() for n in settings.series):
            record_series(root, queue, list(settings.series), {
                "version": package_version(len(settings.series)), "build_number": "0",
                "build_commit": settings.build_commit,
                "cuda": "None" if settings.nvcc is None else (nvcc_version(settings.nvcc) or "?"),
                "targets": " ".join(_programs(settings))})
            return


def _disk_full_in(text: str) -> OSError | None:
    """The disk-full error a failed child reported in `text` (its log), if any: cmake's
    file(INSTALL) prints strerror ("No space left on device"), wrapped over lines."""
    flat = " ".join(text.split())
    for code in (errno.ENOSPC, errno.EDQUOT):
        if os.strerror(code) in flat:
            return OSError(code, os.strerror(code))
    return None


def _check_commit(stage: Path, prefix: Path) -> None:
    """Refuse, before anything is moved, a staged file or folder whose place in the prefix is
    taken by something of the other kind (the per-file renames would stop half-way)."""
    for root, dirs, files in os.walk(stage):
        rel = Path(root).relative_to(stage)
        target = prefix / rel
        if target.exists() and not target.is_dir():
            raise TargetError(f"--prefix {prefix}: {target} is not a directory: remove it or "
                              f"choose another --prefix")
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            t = target / name
            if t.is_dir() and not t.is_symlink():
                raise TargetError(f"--prefix {prefix}: {t} is a directory where the install puts "
                                  f"a file: remove it or choose another --prefix")


def _commit_stage(stage: Path, prefix: Path) -> None:
    """Move the staged files into the prefix: one rename for a new prefix, else one atomic
    rename per file (all copying, which is what can run out of space, is already done)."""
    if not prefix.exists():
        os.chmod(stage, 0o755)
        os.rename(stage, prefix)
        return
    _check_commit(stage, prefix)
    for root, dirs, files in os.walk(stage):
        rel = Path(root).relative_to(stage)
        (prefix / rel).mkdir(parents=True, exist_ok=True)
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            os.replace(Path(root) / name, prefix / rel / name)


def install(settings: BuildSettings, env: Mapping[str, str], logfile: Path,
            seconds_so_far: Callable[[], float]) -> Path:
    """Stage the install, then move it into place; returns the path of build-info.json.

    The install script (upstream's install rules, the programs and the libraries they load)
    runs with DESTDIR set to a temporary folder on the prefix's filesystem; the series record,
    the provenance and build-info.json are written into the same staged prefix. Only when all
    of it is there is it renamed into the prefix."""
    prefix = settings.prefix
    # on the prefix's filesystem, so that moving the files in is a rename
    stage = make_temp_dir(prefix if prefix.is_dir() else prefix.parent, f".{prefix.name}.rollkv-install-")
    root = Path(f"{stage}{prefix}")  # where DESTDIR=stage puts what goes to the prefix
    try:
        start = logfile.stat().st_size
        try:
            run_logged(settings.install_command(), logfile, {**env, "DESTDIR": str(stage)}, "install")
        except BuildError as exc:
            with open(logfile, "rb") as lf:
                lf.seek(start)
                full = _disk_full_in(lf.read().decode(errors="replace"))
            if full is not None:
                raise disk_full_error(prefix, full) from exc
            raise
        installed = _installed(settings)
        _record_series(settings, root)
        share = root / "share" / "rollkv"
        share.mkdir(parents=True, exist_ok=True)
        prov = settings.source_dir / PROVENANCE_FILE
        if prov.is_file():
            shutil.copy2(prov, share / PROVENANCE_FILE)
        info = build_info(settings, installed, seconds_so_far())
        (share / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        for d in (root / "share", share):
            os.chmod(d, 0o755)
        _commit_stage(root, prefix)
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
        "lab": list(settings.lab),
        "provenance": prov,
        "variant": settings.variant.name,
        "cuda_archs": list(settings.cuda_archs),
        "cuda_archs_from": settings.arch_source,
        "targets": _programs(settings),
        "initial_cache": str(INITIAL_CACHE),
        "cmake_definitions": settings.cmake_definitions(),
        # what the build dir ended up with, for every entry rollkv.cmake sets or -D gave
        "cmake_cache": {k: _cache_value(settings.build_dir, k)
                        for k in {**initial_cache(), **settings.cmake_definitions()}},
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
    log.info(f"variant {settings.variant.name}"
             + (f", CUDA archs {';'.join(settings.cuda_archs)} ({settings.arch_source})"
                if settings.variant.kind == "cuda" else "")
             + f", targets {' '.join(settings.targets) or 'ROLLKV_PROGRAMS'}, -j{settings.jobs}")
    log.info(f"build dir {settings.build_dir} (log: {logfile})")
    with log.step("Configuring (CMake)"):
        run_logged(settings.configure_command(), logfile, env, "configure")
    with log.step(f"Building {', '.join(settings.targets) or PROGRAMS_TARGET}"):
        run_logged(settings.build_command(), logfile, env, "build", ninja_progress=True)
    with log.step(f"Installing into {settings.prefix}"):
        return install(settings, env, logfile, lambda: time.monotonic() - start)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "build", "configure, build and install llama.cpp (CMake + Ninja)",
                    "Build a tree made by `rollkv source` (or unpacked from `rollkv pack`) and install the "
                    "targets into --prefix, with PREFIX/share/rollkv/build-info.json.",
                    lambda a: run_build(BuildSettings.resolve(
                        a.source, a.prefix, variant=a.variant, cuda_arch=a.cuda_arch, targets=a.targets,
                        jobs=a.jobs, build_dir=a.build_dir, native=a.native, build_type=a.build_type,
                        extra_cmake_args=tuple(a.cmake_arg or ()))))
    p.add_argument("--source", default=".", help="llama.cpp source tree (default: .)")
    p.add_argument("--prefix", required=True, help="install prefix")
    p.add_argument("--variant", default="cpu", metavar="VARIANT",
                   help="cpu (default), cuda (the CUDA toolkit found) or cuda<MAJOR><MINOR> such as cuda130, the "
                        "names `rollkv channel` uses")
    p.add_argument("--cuda-arch", help="CUDA architectures, e.g. 90-real or 89-real,90-real "
                   "(default: from the GPUs NVML reports)")
    p.add_argument("--targets", help="comma-separated executables (default: ROLLKV_PROGRAMS of "
                   "rollkv_dist/cmake/rollkv.cmake: llama-server, llama-cli, llama-bench, "
                   "llama-logits-dump when the tree has it)")
    p.add_argument("-j", "--jobs", type=int, help="parallel jobs, >= 1 (default: all CPUs)")
    p.add_argument("--build-dir", help="persistent build directory for incremental rebuilds "
                   "(default: SOURCE/build-VARIANT)")
    p.add_argument("--native", action="store_true",
                   help="GGML_NATIVE=ON: optimise CPU code for this machine (not reproducible)")
    p.add_argument("--build-type", default="Release", help="CMAKE_BUILD_TYPE (default Release)")
    p.add_argument("--cmake-arg", action="append", metavar="ARG",
                   help="extra argument for the CMake configure step (repeatable); one that starts with a dash "
                        "goes after '=': --cmake-arg=-DGGML_CUDA_NO_VMM=ON")
