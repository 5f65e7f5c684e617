"""recipe/build.sh under conda-build's environment, packed as a .conda, installed with py-rattler.

conda-build is not on PyPI; what it does around build.sh is done by rollkv's offline packer
(rollkv_dist/channel.py, the `rollkv channel` code): the work directory laid out as the
recipe's sources lay it out (the unpacked sdist, the patch queue in rollkv-patches/,
rollkv_dist in rollkv-tool/), build.sh run with the variables conda-build exports (SRC_DIR,
PREFIX, BUILD_PREFIX, CPU_COUNT, PKG_*, the variant's cuda_compiler_version), the host prefix
packed as a .conda (info/index.json, paths.json with prefix placeholders), indexed into a
channel with py-rattler and installed with py-rattler, offline, into a fresh prefix, where
recipe/run_test.sh (the recipe's own test) runs.

Two levels:
* a miniature "llama.cpp" CMake project (seconds) pins down build.sh's and run_test.sh's
  behaviour: series order, strict patching, manifest check, target selection, relocatable
  install, flag expectations, the channel's constraint against conda-forge's llama.cpp;
* `rollkv channel` on the session's shared CPU build of the pinned tree (tests/conftest.py):
  build.sh finds nothing to compile, the package installs from the channel and its
  llama-server answers a completion.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from _mini_llama import FLAGS_EDIT, RESERVE_EDIT, make_mini_llama_sdist

from rollkv_dist.channel import (
    PLACEHOLDER_DIR,
    ChannelSettings,
    build_channel,
    index_channel,
    install_from_channel,
    pack_conda,
)
from rollkv_dist.pin import PIN
from rollkv_dist.series import read_series

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipe"
PATCHES = ROOT / "patches"
DEFAULT_TARGETS = ["llama-server", "llama-cli", "llama-bench"]
PKG_NAME = "rollkv-llamafile"





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
    pkg = pack_conda(prefix, channel / "linux-64", {"name": PKG_NAME, "version": PIN.version,
                                                     "build": "cpu_h0000000_0", "build_number": 0})
    repodata = index_channel(channel)
    assert pkg.name in repodata.get("packages.conda", {}), repodata
    assert json.loads((channel / "noarch" / "repodata.json").read_text())["packages.conda"] == {}
    # the build tree is gone before the install: nothing may point back into it
    shutil.rmtree(mini_build["src"] / "build-rollkv")
    target = tmp_path / "env"
    records = install_from_channel(channel, [PKG_NAME], target, tmp_path / "pkgs")
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
def pinned_channel(cpu_build, tmp_path_factory):
    """`rollkv channel`'s offline packer on the session's shared CPU build (tests/conftest.py):
    the exported recipe's build.sh runs on the same tree and build dir with the same build
    definition, so it only installs (into a conda-build style placeholder prefix); the prefix
    is packed, indexed, installed from the channel into a fresh prefix with py-rattler and
    checked with run_test.sh."""
    root = tmp_path_factory.mktemp("channel")
    settings = ChannelSettings.resolve(root / "channel", work=root / "work", variants=["cpu"],
                                       builder="offline", patches_dir=PATCHES,
                                       tree=cpu_build["tree"], build_dir=cpu_build["build_dir"],
                                       jobs=2)
    t0 = time.monotonic()
    built = build_channel(settings)
    seconds = time.monotonic() - t0
    print(f"\nrollkv channel (offline packer) on the shared CPU build: {seconds:.0f} s")
    work = settings.work / "cpu"
    return {"channel": settings.out, "built": built, "work": work, "recipe": settings.work / "recipe",
            "prefix": work / PLACEHOLDER_DIR, "log": (work / "build.log").read_text(errors="replace"),
            "build_dir": cpu_build["build_dir"], "tree": cpu_build["tree"]}


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_pinned_build_sh_reuses_the_shared_build(pinned_channel):
    """One llama.cpp build per CI run: build.sh's configure line is the tool's (same initial
    cache, same build id), so ninja compiles and links nothing (only upstream's always-run UI
    asset step runs)."""
    log = pinned_channel["log"]
    assert "-- rollkv: programs llama-server;llama-cli;llama-bench" in log
    assert "-- Install configuration:" in log  # the build step ran, and the install after it
    compiled = re.findall(r"^\[\d+/\d+\] (?:Building|Linking) .*$", log, re.M)
    assert not compiled, compiled[:5]
    assert "carries it already" in log and "byte-identical-verified" in log


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_pinned_build_installs_programs_and_libraries(pinned_channel):
    prefix = pinned_channel["prefix"]
    expected = list(DEFAULT_TARGETS)
    for tool, program in (("logits-dump", "llama-logits-dump"), ("window-test", "llama-window-test"),
                          ("rpc", "ggml-rpc-server")):
        if (pinned_channel["tree"] / "tools" / tool).is_dir():
            expected.append(program)  # the series adds the gates' tools; GGML_RPC the RPC server
    assert sorted(p.name for p in (prefix / "bin").iterdir()) == sorted(expected)
    libs = {p.name for p in (prefix / "lib").iterdir()}
    for lib in ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so", "libggml-rpc.so"):
        assert lib in libs, sorted(libs)
    assert not any("cuda" in name for name in libs)
    assert (prefix / "include" / "llama.h").is_file()
    assert (prefix / "lib" / "cmake" / "llama" / "llama-config.cmake").is_file()
    share = prefix / "share" / "rollkv-llamafile"
    assert read_series(share / "patches") == read_series(PATCHES)
    # nothing downloaded at configure time: no UI fetch, no HTTPS client
    cache = (pinned_channel["build_dir"] / "CMakeCache.txt").read_text()
    assert "LLAMA_USE_PREBUILT_UI:BOOL=OFF" in cache and "LLAMA_OPENSSL:BOOL=OFF" in cache


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_pinned_package_names_upstream_and_series(pinned_channel):
    from rollkv_dist.series import package_version, series_digest

    (pkg,) = pinned_channel["built"]
    series = read_series(PATCHES)
    version = package_version(len(series))
    assert pkg.name.startswith(f"{PKG_NAME}-{version}-cpu_s{series_digest(PATCHES, series)}_h")
    assert pkg.name.endswith("_0.conda")
    out = subprocess.run([str(pinned_channel["prefix"] / "bin" / "llama-server"), "--version"],
                         capture_output=True, text=True, timeout=60)
    assert f"{PIN.llama_commit}+rollkv.{len(series)}" in out.stdout + out.stderr
    repodata = json.loads((pinned_channel["channel"] / "linux-64" / "repodata.json").read_text())
    record = repodata["packages.conda"][pkg.name]
    assert record["constrains"] == ["llama.cpp <0.0.0a0"]


PACKAGE_FACTS = ("<!-- package facts: tests/test_recipe_build.py checks them against a real CPU build -->",
                "<!-- /package facts -->")


def package_facts_block() -> str:
    doc = (ROOT / "docs" / "packaging.md").read_text()
    start, end = doc.find(PACKAGE_FACTS[0]), doc.find(PACKAGE_FACTS[1])
    return doc[start:end + len(PACKAGE_FACTS[1])] if 0 <= start < end else "(no package facts block)"


def test_the_package_facts_carry_this_series():
    """Without a build: the facts' version and build string name the series as it is now (its length and
    digest), so a changed patch fails here in seconds, not only after the integration build."""
    from rollkv_dist.series import package_version, series_digest

    names = read_series(PATCHES)
    block = package_facts_block()
    assert f"- version `{package_version(len(names))}`;" in block, block
    assert f"- CPU build string `cpu_s{series_digest(PATCHES, names)}_h…_0`" in block, block


def package_facts(pkg_name: str, version_line: str, prefix: Path) -> str:
    """docs/packaging.md's lines about the package, from a real build: its version, what the programs say, the
    CPU build string (the build hash left out: it changes with every build), the files it installs."""
    from rollkv_dist.series import package_version

    version = package_version(len(read_series(PATCHES)))
    build = pkg_name[len(f"{PKG_NAME}-{version}-"):-len(".conda")]
    build = re.sub(r"_h[0-9a-f]+_", "_h…_", build)
    m = re.search(r"version: (\S+) \(build \d+, commit (\S+)\)", version_line)
    assert m, version_line
    programs = sorted(p.name for p in (prefix / "bin").iterdir())
    libs = sorted(p.name for p in (prefix / "lib").iterdir() if p.name.endswith(".so"))
    files = [*(f"`bin/{x}`" for x in programs), *(f"`lib/{x}`" for x in libs), "`include/llama.h`",
             "`lib/cmake/llama`"]
    return "\n".join([PACKAGE_FACTS[0],
                      f"- version `{version}`; the programs say `{m.group(1)}`, commit `{m.group(2)}`",
                      f"- CPU build string `{build}` (`<variant>_s<series digest>_h<build hash>_<number>`)",
                      f"- installs {', '.join(files)}",
                      PACKAGE_FACTS[1]])


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_the_docs_name_what_the_package_is(pinned_channel):
    """docs/packaging.md's package name, build string and file list come from a real build, so they cannot go
    stale."""
    (pkg,) = pinned_channel["built"]
    out = subprocess.run([str(pinned_channel["prefix"] / "bin" / "llama-server"), "--version"],
                         capture_output=True, text=True, timeout=60)
    want = package_facts(pkg.name, out.stdout + out.stderr, pinned_channel["prefix"])
    assert package_facts_block() == want, f"docs/packaging.md's package facts are stale; the real build says:\n{want}"


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_channel_installs_with_rattler_and_answers_a_completion(pinned_channel, tiny_model, tmp_path):
    """A fresh prefix installed from the channel (py-rattler) passes run_test.sh and its
    llama-server answers a completion (the CPU smoke gate), with the build tree moved away."""
    from rollkv_dist.smoke import N_PREDICT, run_smoke

    build_dir = pinned_channel["build_dir"]
    moved = build_dir.with_name(build_dir.name + ".moved")
    build_dir.rename(moved)  # the installed programs must not reach into the build tree
    try:
        target = tmp_path / "env"
        install_from_channel(pinned_channel["channel"], [PKG_NAME], target, tmp_path / "pkgs")
        assert "--ctx-size" in _installed_help(target, "llama-server")
        proc = run_recipe_test(target)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for prog in DEFAULT_TARGETS:
            assert f"{prog} --help" in proc.stdout
        res = run_smoke(target, tiny_model, tmp_path / "smoke")
        assert res["tokens_predicted"] == N_PREDICT and res["server"].startswith(str(target))
    finally:
        moved.rename(build_dir)


def test_channel_constraint_keeps_conda_forge_llama_cpp_out(tmp_path):
    """run_constrained `llama.cpp <0.0.0a0` (from the recipe) makes an environment with both
    unsolvable: they install the same files."""
    import rattler.exceptions

    from rollkv_dist.channel import render_meta

    meta = render_meta(RECIPE, {"cuda_compiler_version": "None"})
    constrains = meta["requirements"]["run_constrained"]
    channel = tmp_path / "channel"
    for name, version, extra in ((PKG_NAME, "1.0", {"constrains": constrains}),
                                 ("llama.cpp", "0.0.6188", {})):
        prefix = tmp_path / name
        (prefix / "bin").mkdir(parents=True)
        (prefix / "bin" / "llama-server").write_text("#!/bin/sh\n")
        pack_conda(prefix, channel / "linux-64", {"name": name, "version": version,
                                                  "build": "h0_0", "build_number": 0, **extra})
    index_channel(channel)
    for alone in (PKG_NAME, "llama.cpp"):
        install_from_channel(channel, [alone], tmp_path / f"env-{alone}", tmp_path / "pkgs")
    with pytest.raises(rattler.exceptions.SolverError):
        install_from_channel(channel, [PKG_NAME, "llama.cpp"], tmp_path / "env-both", tmp_path / "pkgs")


def test_a_failed_pack_leaves_no_package_in_the_channel(tmp_path, monkeypatch):
    """The .conda is written in a temporary folder and renamed in when complete: a failure (a
    full disk, an interrupt) while packing leaves nothing the indexer would list."""
    import errno

    from conda_package_handling import api

    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "llama-server").write_text("#!/bin/sh\n")
    out = tmp_path / "channel" / "linux-64"
    index = {"name": PKG_NAME, "version": "1.0", "build": "h0_0", "build_number": 0}

    def half_written(prefix_dir, files, fn, out_folder=None, **kw):
        (Path(out_folder) / fn).write_bytes(b"PK\x03\x04 half a package")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(api, "create", half_written)
    with pytest.raises(OSError):
        pack_conda(prefix, out, index)
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    assert pack_conda(prefix, out, index) == out / f"{PKG_NAME}-1.0-h0_0.conda"
    assert [p.name for p in out.iterdir()] == [f"{PKG_NAME}-1.0-h0_0.conda"]


def test_channel_jobs_zero_is_refused_as_in_rollkv_build(tmp_path):
    from rollkv_dist.errors import UsageError

    with pytest.raises(UsageError, match=r"-j/--jobs 0"):
        ChannelSettings.resolve(tmp_path / "ch", builder="offline", jobs=0,
                                env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert ChannelSettings.resolve(tmp_path / "ch", builder="offline",
                                   env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}).jobs == (os.cpu_count() or 1)


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


FAKE_NVCC = "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"
RECORDING_CONDA_BUILD = """#!/bin/sh
# stands in for conda-build: records its arguments and CONDA_OVERRIDE_CUDA
printf '%s\\n' "$@" > "$CALLS"
echo "CONDA_OVERRIDE_CUDA=${CONDA_OVERRIDE_CUDA:-}" >> "$CALLS"
"""


def _tools(tmp_path: Path, **scripts: str) -> Path:
    bindir = tmp_path / "tools"
    bindir.mkdir()
    for name, text in scripts.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


def test_channel_variants_follow_the_machine(tmp_path):
    """CPU always; CUDA from nvcc's version, for the offline packer only with cuBLAS next to it."""
    bindir = _tools(tmp_path, nvcc=FAKE_NVCC)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "CUDACXX": str(bindir / "nvcc")}
    offline = ChannelSettings.resolve(tmp_path / "ch", builder="offline", env=env)
    if not Path("/usr/include/cublas_v2.h").exists():
        assert [v.name for v in offline.variants] == ["cpu"]  # no cuBLAS
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cublas_v2.h").write_text("")
    offline = ChannelSettings.resolve(tmp_path / "ch", builder="offline", env=env)
    assert [v.name for v in offline.variants] == ["cpu", "cuda130"]
    # `cuda` is the toolkit's own variant, as for `rollkv build --variant cuda`
    named = ChannelSettings.resolve(tmp_path / "ch", variants=["cuda"], builder="offline", env=env)
    assert [(v.name, v.cuda_version) for v in named.variants] == [("cuda130", "13.0")]
    from rollkv_dist.errors import UsageError

    with pytest.raises(UsageError, match="cuda128 cannot be built here"):
        ChannelSettings.resolve(tmp_path / "ch", variants=["cuda128"], builder="offline", env=env)


def test_channel_for_the_cpu_variant_says_nothing_of_cuda(tmp_path, capsys):
    """`rollkv channel --variant cpu` on a machine whose nvcc has no cuBLAS beside it: no CUDA talk."""
    bindir = _tools(tmp_path, nvcc=FAKE_NVCC)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "CUDACXX": str(bindir / "nvcc")}
    s = ChannelSettings.resolve(tmp_path / "ch", variants=["cpu"], builder="offline", env=env)
    assert [v.name for v in s.variants] == ["cpu"]
    assert "CUDA" not in capsys.readouterr().err


def test_channel_runs_conda_build_where_it_is_installed(tmp_path):
    """With conda-build on PATH the channel is conda-build's: the exported recipe, a variant
    config with the machine's CUDA, CONDA_OVERRIDE_CUDA on a machine without a driver, and the
    output folder indexed. (A recording stand-in: conda-build itself was not run here.)"""
    bindir = _tools(tmp_path, nvcc=FAKE_NVCC, **{"conda-build": RECORDING_CONDA_BUILD})
    calls = tmp_path / "calls"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "CUDACXX": str(bindir / "nvcc"), "CALLS": str(calls),
           "HOME": str(tmp_path)}
    settings = ChannelSettings.resolve(tmp_path / "channel", builder="auto", patches_dir=PATCHES,
                                       source_url="file:///srv/" + PIN.sdist_filename, env=env)
    assert settings.builder == "conda-build"
    assert [v.name for v in settings.variants] == ["cpu", "cuda130"]
    assert build_channel(settings) == []
    args = calls.read_text().splitlines()
    recipe = settings.work / "recipe"
    assert args[:3] == [str(recipe), "-m", str(settings.work / "variants.yaml")]
    assert args[3:6] == ["--output-folder", str(settings.out), "--no-anaconda-upload"]
    from rollkv_dist.gpu import probe

    # set only when NVML sees no GPU (CI, this machine)
    assert args[-1] == "CONDA_OVERRIDE_CUDA=" + ("" if probe().gpus else "13.0")
    import yaml

    assert yaml.safe_load((settings.work / "variants.yaml").read_text())["cuda_compiler_version"] == [
        "None", "13.0"]
    assert f'"file:///srv/{PIN.sdist_filename}"' in (recipe / "meta.yaml").read_text()
    for sub in ("noarch", "linux-64"):
        assert json.loads((settings.out / sub / "repodata.json").read_text())["packages.conda"] == {}


def test_channel_from_the_sdist_end_to_end(tmp_path, monkeypatch):
    """`rollkv channel DIR` on a machine without conda-build, from the sdist (here a miniature
    one with the sdist's layout and a two-patch queue): unpack, apply the series to the raw
    tree, build, pack, index, install from the channel, run_test.sh."""
    import tarfile

    import rollkv_dist.channel as channel_mod

    sdist_root, queue = make_mini_llama_sdist(tmp_path, [
        ("0001-kv-residency-flags.patch", FLAGS_EDIT),
        ("0089-rolling-kv-compute-reserve.patch", RESERVE_EDIT)])
    tarball = tmp_path / PIN.sdist_filename
    with tarfile.open(tarball, "w:gz") as tf:
        tf.add(sdist_root, arcname=PIN.sdist_root)
    monkeypatch.setattr(channel_mod, "_verified_sdist", lambda settings: tarball)
    settings = ChannelSettings.resolve(tmp_path / "channel", builder="offline", variants=["cpu"],
                                       patches_dir=queue, jobs=2,
                                       env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    (pkg,) = build_channel(settings)
    log = (settings.work / "cpu" / "build.log").read_text()
    assert log.index("series: applying 0001") < log.index("series: applying 0089")
    assert "[1/" in log and "Linking C executable bin/llama-server" in log
    repodata = json.loads((settings.out / "linux-64" / "repodata.json").read_text())
    assert list(repodata["packages.conda"]) == [pkg.name]
    # build_channel installed it into a fresh prefix and ran run_test.sh there
    tested = settings.work / "test" / pkg.name[: -len(".conda")].rsplit("-", 1)[1]
    assert "--kv-compute-reserve" in _installed_help(tested, "llama-server")
    recipe = (settings.work / "recipe" / "meta.yaml").read_text()
    assert tarball.as_uri() in recipe  # the offline export names the verified local sdist


def test_a_cuda_package_installs_where_cuda_is_assumed(tmp_path):
    """A CUDA package depends on the __cuda virtual package (meta.yaml run); `cuda=` assumes it, as
    CONDA_OVERRIDE_CUDA does for conda. py-rattler 0.28 takes that package's build string only as a
    BuildString: the first CUDA install on the H200 failed there (the CPU tests never pass cuda)."""
    prefix = tmp_path / "prefix"
    (prefix / "share" / "cudapkg").mkdir(parents=True)
    (prefix / "share" / "cudapkg" / "marker").write_text("cuda130\n")
    channel = tmp_path / "channel"
    pack_conda(prefix, channel / "linux-64", {"name": "cudapkg", "version": "1.0", "build": "cuda130_h0_300",
                                              "build_number": 300, "depends": ["__cuda >=13.0"]})
    index_channel(channel)
    records = install_from_channel(channel, ["cudapkg"], tmp_path / "env", tmp_path / "pkgs", cuda="13.0")
    assert [str(r.build) for r in records] == ["cuda130_h0_300"]
    assert (tmp_path / "env" / "share" / "cudapkg" / "marker").read_text() == "cuda130\n"
    with pytest.raises(Exception, match="__cuda"):  # no driver assumed: the solve names what is missing
        install_from_channel(channel, ["cudapkg"], tmp_path / "env2", tmp_path / "pkgs")
