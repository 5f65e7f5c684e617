"""recipe/build.sh under conda-build's environment, packed as a .conda, installed with py-rattler.

conda-build is not on PyPI; what it does around build.sh is done here by hand:
the work directory is laid out as the recipe's two sources lay it out (the
unpacked sdist, the patch queue in rollkv-patches/), build.sh runs with the
variables conda-build exports (SRC_DIR, PREFIX, BUILD_PREFIX, CPU_COUNT,
PKG_*, the variant's cuda_compiler_version, the recipe's script_env), the host
prefix is packed as a .conda with conda-package-handling (info/index.json,
paths.json with prefix placeholders, files), indexed into a local channel with
py-rattler and installed with py-rattler, offline, into a fresh prefix, where
recipe/run_test.sh (the recipe's own test) runs.

Two levels:
* a miniature "llama.cpp" CMake project (seconds) pins down build.sh's and
  run_test.sh's behaviour: series order, strict patching, manifest check,
  target selection, relocatable install, flag expectations;
* the pinned upstream tree plus patches/series, CPU variant (about 12 minutes
  on 2 cores), built once per session and shared by the tests that need it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from _mini_llama import FLAGS_EDIT, RESERVE_EDIT, make_mini_llama_sdist

from rollkv_dist.pin import PIN
from rollkv_dist.series import read_series
from rollkv_dist.util import sha256_file

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipe"
PATCHES = ROOT / "patches"
DEFAULT_TARGETS = ["llama-server", "llama-cli", "llama-bench"]
PKG_NAME = "rollkv-llamafile"

# conda-build builds into a host prefix with a long placeholder name, so that the
# installer can rewrite the path in binaries; do the same.
PLACEHOLDER_DIR = "host_env_" + "_placehold" * 12




# --------------------------------------------------------------------------- conda-build emulation


def conda_build_env(src_dir: Path, prefix: Path, build_prefix: Path, *, cuda: str = "None",
                    buildnum: int = 0, targets: list[str] | None = None) -> dict[str, str]:
    """The variables conda-build exports to build.sh, plus the recipe's script_env."""
    env = {
        k: v for k, v in os.environ.items()
        if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TERM", "USER")
    }
    env.update(
        SRC_DIR=str(src_dir),
        PREFIX=str(prefix),
        BUILD_PREFIX=str(build_prefix),
        RECIPE_DIR=str(RECIPE),
        CPU_COUNT=os.environ.get("ROLLKV_TEST_CPU_COUNT", "2"),
        PKG_NAME=PKG_NAME,
        PKG_VERSION=PIN.version,
        PKG_BUILDNUM=str(buildnum),
        PKG_BUILD_STRING=f"cpu_h0000000_{buildnum}",
        PKG_HASH="h0000000",
        CONDA_BUILD="1",
        target_platform="linux-64",
        build_platform="linux-64",
        SHLIB_EXT=".so",
        cuda_compiler_version=cuda,
        # script_env of meta.yaml
        ROLLKV_LLAMA_COMMIT=PIN.llama_commit,
        ROLLKV_LLAMA_BUILD_NUMBER="0",
    )
    if targets:
        env["ROLLKV_BUILD_TARGETS"] = " ".join(targets)
    return env


def run_build_sh(src_dir: Path, prefix: Path, build_prefix: Path, log: Path,
                 extra_env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    prefix.mkdir(parents=True, exist_ok=True)
    build_prefix.mkdir(parents=True, exist_ok=True)
    env = {**conda_build_env(src_dir, prefix, build_prefix, **kw), **(extra_env or {})}
    with open(log, "w") as lf:
        proc = subprocess.run(
            ["nice", "-n", "10", "bash", str(RECIPE / "build.sh")],
            cwd=src_dir, env=env, stdout=lf, stderr=subprocess.STDOUT,
        )
    return proc


def lay_out_work_dir(work: Path, sdist_tree_root: Path, patches_dir: Path) -> Path:
    """conda-build's work dir: source 1 (the sdist, top folder hoisted), source 2 (the queue)
    in rollkv-patches/, source 3 (rollkv_dist) in rollkv-tool/."""
    src = work / "work"
    shutil.copytree(sdist_tree_root, src, symlinks=True)
    shutil.copytree(patches_dir, src / "rollkv-patches")
    shutil.copytree(ROOT / "rollkv_dist", src / "rollkv-tool" / "rollkv_dist",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return src




def pack_conda(prefix: Path, out_dir: Path, *, name: str, version: str, build: str,
               build_number: int, depends: list[str] | None = None) -> Path:
    """Pack an installed host prefix as a .conda the way conda-build's packaging step does."""
    from conda_package_handling import api

    stage = out_dir / f".stage-{build}"
    shutil.copytree(prefix, stage, symlinks=True)
    placeholder = str(prefix).encode()
    entries, has_prefix = [], []
    for path in sorted(p for p in stage.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(stage).as_posix()
        if path.is_symlink():
            target = path.resolve()
            entries.append({
                "_path": rel, "path_type": "softlink",
                "sha256": sha256_file(target), "size_in_bytes": target.stat().st_size,
            })
            continue
        data = path.read_bytes()
        entry = {"_path": rel, "path_type": "hardlink", "sha256": hashlib.sha256(data).hexdigest(),
                 "size_in_bytes": len(data)}
        if placeholder in data:
            mode = "binary" if b"\0" in data else "text"
            entry.update(prefix_placeholder=str(prefix), file_mode=mode)
            has_prefix.append(f"{prefix} {mode} {rel}")
        entries.append(entry)
    info = stage / "info"
    info.mkdir()
    index = {
        "name": name, "version": version, "build": build, "build_number": build_number,
        "depends": depends or [], "license": "MIT", "platform": "linux", "arch": "x86_64",
        "subdir": "linux-64", "timestamp": int(time.time() * 1000),
    }
    (info / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (info / "paths.json").write_text(json.dumps({"paths": entries, "paths_version": 1}, indent=2))
    (info / "files").write_text("".join(e["_path"] + "\n" for e in entries))
    if has_prefix:
        (info / "has_prefix").write_text("\n".join(has_prefix) + "\n")
    (info / "about.json").write_text(json.dumps({"summary": "llama.cpp with rolling KV"}))
    file_list = [p.relative_to(stage).as_posix() for p in sorted(stage.rglob("*"))
                 if p.is_file() or p.is_symlink()]
    fn = f"{name}-{version}-{build}.conda"
    out_dir.mkdir(parents=True, exist_ok=True)
    api.create(str(stage), file_list, fn, out_folder=str(out_dir))
    shutil.rmtree(stage)
    return out_dir / fn


def index_channel(channel: Path) -> dict:
    from rattler.index import index_fs

    (channel / "noarch").mkdir(parents=True, exist_ok=True)
    (channel / "linux-64").mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel))
    return json.loads((channel / "linux-64" / "repodata.json").read_text())


def install_from_channel(channel: Path, spec: str, target: Path, cache: Path) -> list:
    """Solve and install `spec` from the local channel only (no network, no other channel)."""
    import rattler

    chan = rattler.Channel(channel.as_uri())
    assert chan.base_url.startswith("file://"), chan.base_url
    records = asyncio.run(rattler.solve(
        sources=[chan], specs=[spec], platforms=["linux-64", "noarch"], virtual_packages=[],
    ))
    asyncio.run(rattler.install(records, target_prefix=target, cache_dir=cache, show_progress=False))
    return records


def _installed_help(prefix: Path, prog: str) -> str:
    proc = subprocess.run([str(prefix / "bin" / prog), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def run_recipe_test(prefix: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env["PREFIX"] = str(prefix)
    return subprocess.run(["bash", str(RECIPE / "run_test.sh")], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def mini_build(tmp_path_factory):
    """The miniature tree with a two-patch series, built by build.sh into a placeholder prefix."""
    root = tmp_path_factory.mktemp("mini")
    sdist, queue = make_mini_llama_sdist(root, [
        ("0001-kv-residency-flags.patch", FLAGS_EDIT),
        ("0089-rolling-kv-compute-reserve.patch", RESERVE_EDIT),
    ])
    src = lay_out_work_dir(root, sdist, queue)
    prefix = root / PLACEHOLDER_DIR
    proc = run_build_sh(src, prefix, root / "build_env", root / "build.log")
    log = (root / "build.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    return {"root": root, "src": src, "prefix": prefix, "log": log, "queue": queue}


def test_build_sh_applies_series_in_order_and_verifies(mini_build):
    log = mini_build["log"]
    first = log.index("series: applying 0001-kv-residency-flags.patch")
    second = log.index("series: applying 0089-rolling-kv-compute-reserve.patch")
    assert first < second
    assert "byte-identical-verified" in log
    arg = (mini_build["src"] / "vendor" / "llama.cpp" / "common" / "arg.c").read_text()
    assert '"--kv-compute-reserve"' in arg


def test_build_sh_installs_only_the_selected_programs(mini_build):
    prefix = mini_build["prefix"]
    assert sorted(p.name for p in (prefix / "bin").iterdir()) == sorted(DEFAULT_TARGETS)
    libs = {p.name for p in (prefix / "lib").iterdir()}
    for lib in ("libllama.so", "libllama-common.so", "libggml.so", "libserver-context.so"):
        assert lib in libs, sorted(libs)
    assert "libquantize-impl.so" not in libs  # only llama-quantize, which is not selected
    assert (prefix / "include" / "llama.h").is_file()
    assert (prefix / "lib" / "pkgconfig" / "llama.pc").read_text().startswith(f"prefix={prefix}\n")
    share = prefix / "share" / "rollkv-llamafile"
    assert read_series(share / "patches") == read_series(mini_build["queue"])
    for name in read_series(mini_build["queue"]):
        assert (share / "patches" / name).read_bytes() == (mini_build["queue"] / name).read_bytes()
    info = dict(line.split("=", 1) for line in (share / "build-info.txt").read_text().splitlines())
    assert info["llama_commit"] == PIN.llama_commit
    assert info["cuda"] == "None"
    assert info["version"] == PIN.version


def test_mini_package_installs_with_rattler_and_passes_recipe_test(mini_build, tmp_path):
    prefix = mini_build["prefix"]
    channel = tmp_path / "channel"
    pkg = pack_conda(prefix, channel / "linux-64", name=PKG_NAME, version=PIN.version,
                     build="cpu_h0000000_0", build_number=0)
    repodata = index_channel(channel)
    assert pkg.name in repodata.get("packages.conda", {}), repodata
    # the build tree is gone before the install: nothing may point back into it
    shutil.rmtree(mini_build["src"] / "build-rollkv")
    target = tmp_path / "env"
    records = install_from_channel(channel, PKG_NAME, target, tmp_path / "pkgs")
    assert [(str(r.name.normalized), str(r.version), str(r.build)) for r in records] == [
        (PKG_NAME, PIN.version, "cpu_h0000000_0")]
    server_help = _installed_help(target, "llama-server")
    assert "--vram-target" in server_help
    assert "--parallel N          slots (default: 1)" in server_help  # through libserver-context.so
    # text files carrying the build prefix were rewritten to the new one
    assert (target / "lib" / "pkgconfig" / "llama.pc").read_text().startswith(f"prefix={target}\n")
    proc = run_recipe_test(target)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: llama-server --help shows --kv-compute-reserve" in proc.stdout
    assert "ok: llama-bench --help shows --kv-residency-mode" in proc.stdout


# a patch names the flag in code but the program does not list it
_HIDDEN_FLAG = (
    '    printf("  -fa,  --flash-attn on|off   flash attention\\n");\n',
    '    printf("  -fa,  --flash-attn on|off   flash attention\\n");\n'
    '    (void) "--vram-target"; /* parsed elsewhere, never listed */\n',
)
# --help shows a flag that no patch of the recorded series adds: not the series' build
_SPELLED_APART = (
    '    printf("  -fa,  --flash-attn on|off   flash attention\\n");\n',
    '    printf("  -fa,  --flash-attn on|off   flash attention\\n");\n'
    '    printf("  --kv-" "residency-mode\\n");\n',
)


@pytest.mark.parametrize("patch_name, edit, expected", [
    ("0001-hidden-flag.patch", _HIDDEN_FLAG,
     "FAIL: llama-server --help lacks --vram-target, which the series adds"),
    ("0001-spelled-apart.patch", _SPELLED_APART,
     "shows --kv-residency-mode, which no patch in the series adds"),
], ids=["series-adds-help-lacks", "help-shows-no-patch-adds"])
def test_run_test_sh_rejects_help_that_disagrees_with_the_series(tmp_path, patch_name, edit, expected):
    sdist, queue = make_mini_llama_sdist(tmp_path, [(patch_name, edit)])
    src = lay_out_work_dir(tmp_path, sdist, queue)
    prefix = tmp_path / PLACEHOLDER_DIR
    proc = run_build_sh(src, prefix, tmp_path / "build_env", tmp_path / "build.log")
    assert proc.returncode == 0, (tmp_path / "build.log").read_text()[-3000:]
    res = run_recipe_test(prefix)
    assert res.returncode != 0
    assert expected in res.stderr


def test_build_sh_refuses_patch_with_fuzz(tmp_path):
    sdist, queue = make_mini_llama_sdist(tmp_path, [("0001-kv-residency-flags.patch", FLAGS_EDIT)])
    # the tree's context drifted from what the patch expects
    arg = sdist / "vendor" / "llama.cpp" / "common" / "arg.c"
    arg.write_text(arg.read_text().replace("size of the prompt context", "prompt context size"))
    src = lay_out_work_dir(tmp_path, sdist, queue)
    proc = run_build_sh(src, tmp_path / PLACEHOLDER_DIR, tmp_path / "build_env", tmp_path / "build.log")
    log = (tmp_path / "build.log").read_text()
    assert proc.returncode != 0
    assert "applying 0001-kv-residency-flags.patch" in log
    assert not (tmp_path / PLACEHOLDER_DIR / "bin").exists()


def test_build_sh_refuses_tree_that_differs_from_manifest(tmp_path):
    sdist, queue = make_mini_llama_sdist(tmp_path, [("0001-kv-residency-flags.patch", FLAGS_EDIT)])
    manifest = json.loads((queue / "manifest.json").read_text())
    manifest["files"]["common/arg.c"] = "0" * 64
    (queue / "manifest.json").write_text(json.dumps(manifest, indent=2))
    src = lay_out_work_dir(tmp_path, sdist, queue)
    proc = run_build_sh(src, tmp_path / PLACEHOLDER_DIR, tmp_path / "build_env", tmp_path / "build.log")
    log = (tmp_path / "build.log").read_text()
    assert proc.returncode != 0
    assert "patched tree differs from the manifest: common/arg.c" in log


def test_build_sh_refuses_series_without_manifest(tmp_path):
    sdist, queue = make_mini_llama_sdist(tmp_path, [("0001-kv-residency-flags.patch", FLAGS_EDIT)])
    (queue / "manifest.json").unlink()
    src = lay_out_work_dir(tmp_path, sdist, queue)
    proc = run_build_sh(src, tmp_path / PLACEHOLDER_DIR, tmp_path / "build_env", tmp_path / "build.log")
    assert proc.returncode != 0
    assert "manifest.json is missing but the series has 1 patches" in (tmp_path / "build.log").read_text()


# --------------------------------------------------------------------------- the pinned tree


@pytest.fixture(scope="session")
def pinned_cpu_build(cpu_build, tmp_path_factory):
    """build.sh on the session's shared CPU build (tests/conftest.py): same tree, same build
    dir, same build definition, so configure changes nothing that needs compiling and build.sh
    only installs, into a conda-build style placeholder prefix."""
    root = tmp_path_factory.mktemp("pinned")
    prefix = root / PLACEHOLDER_DIR
    env = {"ROLLKV_BUILD_DIR": str(cpu_build["build_dir"]), "ROLLKV_PATCH_DIR": str(PATCHES),
           "ROLLKV_TOOL_DIR": str(ROOT)}
    t0 = time.monotonic()
    proc = run_build_sh(cpu_build["tree"], prefix, root / "build_env", root / "build.log",
                        extra_env=env)
    seconds = time.monotonic() - t0
    log = (root / "build.log").read_text(errors="replace")
    assert proc.returncode == 0, log[-6000:]
    print(f"\nrecipe/build.sh on the shared CPU build: {seconds:.0f} s")
    return {"root": root, "src": cpu_build["tree"], "prefix": prefix, "log": log,
            "seconds": seconds, "build_dir": cpu_build["build_dir"], "cpu_build": cpu_build}


@pytest.mark.integration
def test_pinned_build_sh_reuses_the_shared_build(pinned_cpu_build):
    """One llama.cpp build per CI run: build.sh's configure line is the tool's (same initial
    cache, same build id), so ninja has nothing to do."""
    log = pinned_cpu_build["log"]
    assert "ninja: no work to do." in log, log[-4000:]
    assert "series: " in log and "carries it already" in log
    assert "byte-identical-verified" in log


@pytest.mark.integration
def test_pinned_build_installs_programs_and_libraries(pinned_cpu_build):
    prefix = pinned_cpu_build["prefix"]
    expected = list(DEFAULT_TARGETS)
    if (pinned_cpu_build["src"] / PIN.tree / "tools" / "logits-dump").is_dir():
        expected.append("llama-logits-dump")  # the series adds the gates' tool
    assert sorted(p.name for p in (prefix / "bin").iterdir()) == sorted(expected)
    libs = {p.name for p in (prefix / "lib").iterdir()}
    for lib in ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so"):
        assert lib in libs, sorted(libs)
    assert not any("cuda" in name for name in libs)
    assert (prefix / "include" / "llama.h").is_file()
    assert (prefix / "lib" / "cmake" / "llama" / "llama-config.cmake").is_file()
    share = prefix / "share" / "rollkv-llamafile"
    assert read_series(share / "patches") == read_series(PATCHES)
    # nothing downloaded at configure time: no UI fetch, no HTTPS client
    cache = (pinned_cpu_build["build_dir"] / "CMakeCache.txt").read_text()
    assert "LLAMA_USE_PREBUILT_UI:BOOL=OFF" in cache and "LLAMA_OPENSSL:BOOL=OFF" in cache


@pytest.mark.integration
def test_pinned_build_records_upstream_commit(pinned_cpu_build):
    out = subprocess.run([str(pinned_cpu_build["prefix"] / "bin" / "llama-server"), "--version"],
                         capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    n = len(read_series(PATCHES))
    assert f"{PIN.llama_commit}+rollkv.{n}" in text, text


@pytest.mark.integration
def test_pinned_package_installs_with_rattler(pinned_cpu_build, tiny_model, tmp_path):
    from rollkv_dist.smoke import N_PREDICT, run_smoke

    prefix = pinned_cpu_build["prefix"]
    channel = tmp_path / "channel"
    pkg = pack_conda(prefix, channel / "linux-64", name=PKG_NAME, version=PIN.version,
                     build="cpu_h0000000_0", build_number=0)
    repodata = index_channel(channel)
    assert pkg.name in repodata["packages.conda"]
    build_dir = pinned_cpu_build["build_dir"]
    moved = build_dir.with_name(build_dir.name + ".moved")
    build_dir.rename(moved)  # the installed programs must not reach into the build tree
    try:
        target = tmp_path / "env"
        install_from_channel(channel, f"{PKG_NAME} =={PIN.version}", target, tmp_path / "pkgs")
        server_help = _installed_help(target, "llama-server")
        assert "--ctx-size" in server_help
        proc = run_recipe_test(target)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for prog in DEFAULT_TARGETS:
            assert f"{prog} --help" in proc.stdout
        # the CPU smoke gate: the installed llama-server answers a completion
        res = run_smoke(target, tiny_model, tmp_path / "smoke")
        assert res["tokens_predicted"] == N_PREDICT and res["server"].startswith(str(target))
    finally:
        moved.rename(build_dir)


def test_empty_series_builds_upstream_and_expects_no_flags(tmp_path):
    """With an empty series (no manifest needed) the package is upstream: the flags must be absent."""
    sdist, queue = make_mini_llama_sdist(tmp_path, [])
    src = lay_out_work_dir(tmp_path, sdist, queue)
    prefix = tmp_path / PLACEHOLDER_DIR
    proc = run_build_sh(src, prefix, tmp_path / "build_env", tmp_path / "build.log")
    log = (tmp_path / "build.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "empty series, nothing to verify" in log
    assert read_series(queue) == []
    assert (prefix / "share" / "rollkv-llamafile" / "patches" / "series").read_bytes() == b""
    res = run_recipe_test(prefix)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok: llama-server --help has no --kv-residency-mode (not in the series)" in res.stdout
