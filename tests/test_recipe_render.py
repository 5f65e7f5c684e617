"""The conda recipe renders for each variant, agrees with the pin and the series, and exports
as a self-contained, feedstock-ready folder.

conda-build is not installable from PyPI, so meta.yaml is rendered here the way conda-build
renders it (rollkv_dist.channel.render_meta: jinja2 with conda-build's recipe functions,
selectors, YAML, two passes for the build number), for the variants conda-forge's global
pinning gives with CUDA enabled (CPU, CUDA 12.9, and 13.0 from its cuda130 migration). The
real conda-build render and conda-smithy's linter were run on an export by hand:
reports/recipe-lint/.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollkv_dist.channel import conda_build_config, render_meta
from rollkv_dist.pin import PIN
from rollkv_dist.recipe import VALUES_BEGIN, VALUES_END, ExportSettings, export_recipe, pip_sdist_url
from rollkv_dist.series import package_version, read_series, series_digest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipe"
PATCHES = ROOT / "patches"
FAKE_HASH = "1a2b3c4"
# what conda-forge's pinning (CF_CUDA_ENABLED=True, with the cuda130 migration) gives on
# linux-64: the recipe itself sets no variant
CPU = {"cuda_compiler_version": "None", "c_compiler_version": "15", "cxx_compiler_version": "15",
       "c_stdlib_version": "2.17"}
CUDA = [{"cuda_compiler_version": "12.9", "cuda_compiler": "cuda-nvcc", "c_compiler_version": "14",
         "cxx_compiler_version": "14", "c_stdlib_version": "2.17"},
        {"cuda_compiler_version": "13.0", "cuda_compiler": "cuda-nvcc", "c_compiler_version": "15",
         "cxx_compiler_version": "15", "c_stdlib_version": "2.28"}]
VARIANTS = [CPU, *CUDA]
IDS = ["cpu", "cuda12.9", "cuda13.0"]


def render(recipe: Path, variant: dict, environ: dict | None = None) -> dict:
    return render_meta(recipe, variant, environ if environ is not None else {"HOME": "/home/u"},
                       pkg_hash=FAKE_HASH)


def _description_series(meta: dict) -> list[str]:
    m = re.search(r"\((\d+) patches: ([^)]*)\)", " ".join(meta["about"]["description"].split()))
    assert m, meta["about"]["description"]
    names = [n.strip() for n in m.group(2).split(",") if n.strip()]
    assert int(m.group(1)) == len(names)
    return names


def test_recipe_sets_no_variants_of_its_own():
    """conda-forge's pinning zips cuda_compiler_version with the compilers and the glibc
    baseline; a recipe-level zip of its own made the pinned render ambiguous."""
    assert not (RECIPE / "conda_build_config.yaml").exists()


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_recipe_agrees_with_pin_and_series(variant):
    meta = render(RECIPE, variant)
    series = read_series(PATCHES)
    assert meta["package"] == {"name": "rollkv-llamafile", "version": package_version(len(series))}
    assert meta["package"]["version"] == f"{PIN.llama_version}.dev+{PIN.llama_commit}.rollkv{len(series)}"
    sdist, queue, tool = meta["source"]
    assert sdist["fn"] == PIN.sdist_filename and sdist["sha256"] == PIN.sha256
    assert queue == {"path": "../patches", "folder": "rollkv-patches"}
    assert tool == {"path": "../rollkv_dist", "folder": "rollkv-tool/rollkv_dist"}
    assert (RECIPE / tool["path"] / "cmake" / "rollkv.cmake").is_file()
    assert "patches" not in sdist, "the series is applied by build.sh (see meta.yaml)"
    assert _description_series(meta) == series  # the jinja's series parse agrees
    assert meta["build"]["script_env"] == ["ROLLKV_BUILD_TARGETS", "ROLLKV_CUDA_ARCHITECTURES"]
    assert meta["requirements"]["run_constrained"] == ["llama.cpp <0.0.0a0"]
    assert meta["about"]["license"] == "MIT" and meta["about"]["license_family"] == "MIT"
    for prog in ("llama-server", "llama-cli", "llama-bench"):
        assert f'test -x "$PREFIX/bin/{prog}"' in meta["test"]["commands"]


@pytest.mark.parametrize("variant", CUDA, ids=IDS[1:])
def test_cuda_variant(variant):
    meta = render(RECIPE, variant)
    cuda = variant["cuda_compiler_version"]
    major, minor = map(int, cuda.split("."))
    build = meta["build"]
    assert build["number"] == 100 * (major - 10) + 10 * minor  # 12.9: 290, 13.0: 300
    assert build["string"] == f"cuda{major}{minor}_scheckout_h{FAKE_HASH}_{build['number']}"
    assert build["missing_dso_whitelist"] == ["*/libcuda.so.1"]
    reqs = meta["requirements"]
    assert f"cuda-nvcc_linux-64 {cuda}" in reqs["build"]
    assert f"gcc_linux-64 {variant['c_compiler_version']}" in reqs["build"]
    assert f"sysroot_linux-64 {variant['c_stdlib_version']}" in reqs["build"]
    assert {"cmake >=3.21", "ninja", "git", "python >=3.11"} <= set(reqs["build"])
    assert f"cuda-version {cuda}" in reqs["host"]
    assert {"cuda-cudart-dev", "libcublas-dev", "cuda-driver-dev"} <= set(reqs["host"])
    assert f"cuda-version >={major},<{major + 1}.0a0" in reqs["run"] and "__cuda" in reqs["run"]
    assert "cuda-driver-dev" in meta["test"]["requires"]


def test_cpu_variant():
    meta = render(RECIPE, CPU)
    assert meta["build"]["number"] == 0
    assert meta["build"]["string"] == f"cpu_scheckout_h{FAKE_HASH}_0"
    assert "missing_dso_whitelist" not in meta["build"]
    reqs = meta["requirements"]
    assert not any("cuda" in r for r in reqs["build"]), reqs["build"]
    assert not reqs.get("host") and not reqs.get("run")
    assert not meta["test"].get("requires")


def test_build_numbers_differ_per_cuda_version_and_rank_above_cpu():
    numbers = [render(RECIPE, v)["build"]["number"] for v in VARIANTS]
    assert numbers == sorted(set(numbers)), numbers


def test_skipped_off_linux64():
    assert re.search(r"^\s*skip: true\s+# \[not linux64\]\s*$", (RECIPE / "meta.yaml").read_text(), re.M)


@pytest.mark.parametrize("environ", [
    {"HOME": "/home/u"},
    {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"},
    {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg", "ROLLKV_CACHE": "/c/rollkv-cache"},
], ids=["home", "xdg", "rollkv-cache"])
def test_checkout_recipe_takes_the_sdist_from_rollkv_cache(environ):
    """`conda render recipe/` in a checkout: the sdist that `rollkv source` cached."""
    from rollkv_dist.fetch import FetchSettings

    meta = render(RECIPE, CPU, environ=environ)
    assert meta["source"][0]["url"] == f"file://{FetchSettings.resolve(env=environ).cached_sdist}"


def test_patch_list_follows_series_file(tmp_path):
    """A series with comments and blank lines renders as its names, in order."""
    shutil.copytree(RECIPE, tmp_path / "recipe")
    (tmp_path / "rollkv_dist").mkdir()
    shutil.copy(ROOT / "rollkv_dist" / "pin.toml", tmp_path / "rollkv_dist" / "pin.toml")
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "series").write_text(
        "# rolling KV\n0002-position-window.patch\n\n"
        "0001-kv-residency-flags.patch   # order is the file's\n"
        "0089-rolling-kv-compute-reserve.patch\n")
    meta = render(tmp_path / "recipe", CUDA[-1])
    assert _description_series(meta) == ["0002-position-window.patch", "0001-kv-residency-flags.patch",
                                         "0089-rolling-kv-compute-reserve.patch"]
    assert meta["package"]["version"].endswith(".rollkv3")


# --------------------------------------------------------------------------- the export


def _export(tmp_path: Path, patches: Path = PATCHES, name: str = "export") -> Path:
    settings = ExportSettings.resolve(tmp_path / name, patches_dir=patches,
                                      source_url="file:///srv/sdists/" + PIN.sdist_filename,
                                      home="file:///srv/rollkv", maintainers=("rollkv-bot",), env={})
    return export_recipe(settings)


def test_export_is_self_contained(tmp_path):
    out = _export(tmp_path)
    # moved somewhere with nothing around it, rendered with an empty environment
    alone = tmp_path / "elsewhere" / "recipe"
    shutil.copytree(out, alone)
    shutil.rmtree(out)
    text = (alone / "meta.yaml").read_text()
    assert "../" not in text and "environ." not in text and "load_file_regex" not in text and "load_file_data" not in text
    assert VALUES_BEGIN in text and VALUES_END in text
    series = read_series(PATCHES)
    for variant in VARIANTS:
        meta = render(alone, variant, environ={})
        assert meta["package"]["version"] == package_version(len(series))
        assert meta["source"][0] == {"url": "file:///srv/sdists/" + PIN.sdist_filename,
                                     "fn": PIN.sdist_filename, "sha256": PIN.sha256}
        assert meta["source"][1:] == [{"path": "patches", "folder": "rollkv-patches"},
                                      {"path": "rollkv_dist", "folder": "rollkv-tool/rollkv_dist"}]
        assert meta["about"]["home"] == "file:///srv/rollkv"
        assert meta["extra"] == {"recipe-maintainers": ["rollkv-bot"]}
        assert f"_s{series_digest(PATCHES, series)}_" in meta["build"]["string"]
        assert _description_series(meta) == series
    # the sources it names are in the folder: the queue, the series tool, the build definition
    assert read_series(alone / "patches") == series
    for rel in ("build.sh", "run_test.sh", "rollkv_dist/series.py", "rollkv_dist/cmake/rollkv.cmake",
                "rollkv_dist/cmake/rollkv-install.cmake", "patches/manifest.json"):
        assert (alone / rel).is_file(), rel
    # the series tool runs from the export alone, as build.sh runs it where rollkv is not
    # installed (-S: no site-packages, so not this checkout's editable install either)
    (tmp_path / "tree").mkdir()
    tool = subprocess.run([sys.executable, "-S", "-m", "rollkv_dist.series", "build-commit",
                           str(tmp_path / "tree"), str(alone / "patches")],
                          env={"PYTHONPATH": str(alone), "PATH": os.environ.get("PATH", "")},
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert tool.returncode == 0, tool.stderr
    assert tool.stdout.strip() == f"{PIN.llama_commit}+rollkv.{len(series)}"


def test_export_build_string_follows_the_series_content(tmp_path):
    queue = tmp_path / "queue"
    shutil.copytree(PATCHES, queue)
    first = render(_export(tmp_path, queue, "a"), CPU, environ={})["build"]["string"]
    name = read_series(queue)[-1]
    (queue / name).write_text((queue / name).read_text() + "\n")  # same names, other bytes
    (queue / "manifest.json").unlink()
    (queue / "series").write_text("")  # (an empty series needs no manifest)
    second = render(_export(tmp_path, queue, "b"), CPU, environ={})["build"]["string"]
    assert first != second


def test_export_needs_home_and_maintainers(tmp_path):
    from rollkv_dist.errors import UsageError

    with pytest.raises(UsageError, match="--home"):
        ExportSettings.resolve(tmp_path / "x", source_url="file:///a", maintainers=("m",), env={})
    with pytest.raises(UsageError, match="--maintainer"):
        ExportSettings.resolve(tmp_path / "x", source_url="file:///a", home="h", env={})


def test_local_variant_config_zips_cuda_with_glibc():
    cbc = yaml.safe_load(conda_build_config([{"cuda_compiler_version": "None"},
                                             {"cuda_compiler_version": "13.0"}]))
    assert cbc["cuda_compiler_version"] == ["None", "13.0"]  # conda-build's None, as conda-forge writes it
    assert cbc["c_stdlib_version"] == ["2.17", "2.28"]
    assert cbc["zip_keys"] == [["cuda_compiler_version", "c_stdlib_version"]]


@pytest.mark.integration
def test_pip_resolves_the_pinned_sdist_url():
    """The export's source URL is where pip (its own index configuration) finds the pinned
    file; this repository names no index."""
    url = pip_sdist_url()
    assert url.endswith("/" + PIN.sdist_filename) and "://" in url


# The packaging files name no package index: no URL but file://, and nothing shaped like a host name.
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://", re.I)
_HOST = re.compile(r"\b[a-z0-9-]+(?:\.[a-z0-9-]+)*\.(?:org|com|io|dev|net)\b", re.I)


@pytest.mark.parametrize("rel", ["recipe", "environment.yml", "flake.nix", "flake.lock", "package.nix",
                                 "nix", "tests/nixpkgs-stub", "rollkv_dist/cmake",
                                 "rollkv_dist/recipe.py", "rollkv_dist/channel.py"])
def test_no_package_index_named(rel):
    target = ROOT / rel
    files = sorted(p for p in target.rglob("*") if p.is_file()) if target.is_dir() else [target]
    assert files
    for path in files:
        text = path.read_text()
        urls = [m.group(0) for m in _URL.finditer(text) if m.group(0).lower() != "file://"]
        assert not urls, f"{path.relative_to(ROOT)} has a URL scheme other than file:// ({urls})"
        hosts = [m.group(0) for m in _HOST.finditer(text)]
        assert not hosts, f"{path.relative_to(ROOT)} names a host: {hosts}"


def test_no_package_index_check_catches_a_host_and_a_url():
    assert _HOST.search("channels: [conda-forge.example.org]")
    assert _URL.search("url: https://example")
    assert _URL.search("url: file://{{ sdist_path }}").group(0) == "file://"


def test_selectors_are_read_never_evaluated():
    """`# [expr]` selectors: names, literals, not/and/or and comparisons, as conda-build reads them; a call, an
    attribute or an unknown name is an error naming the selector (nothing of it runs)."""
    from rollkv_dist.channel import selector_value
    from rollkv_dist.errors import UsageError

    ns = {"linux64": True, "win": False, "cuda_compiler_version": "13.0", "py": 311}
    assert selector_value("not linux64", ns) is False
    assert selector_value("linux64 and cuda_compiler_version != 'None'", ns) is True
    assert selector_value("win or cuda_compiler_version in ('12.9', '13.0')", ns) is True
    assert selector_value("300 < py <= 311", ns) is True and selector_value("311 < py", ns) is False
    for bad, why in (("__import__('os').system('false')", "Call is not allowed"),
                     ("linux64.real", "Attribute is not allowed"), ("osx", "'osx' is not a variant key"),
                     ("linux64 and", "selector \\[linux64 and\\]")):
        with pytest.raises(UsageError, match=why):
            selector_value(bad, ns)
