"""The conda recipe renders for each variant and agrees with the pin and the series.

conda-build is not installable from PyPI, so this renders recipe/meta.yaml the
way conda-build does it: jinja2 with conda-build's recipe functions
(`compiler`, `stdlib`, `pin_compatible`, `load_file_regex`, `environ`,
`RECIPE_DIR`, `PKG_HASH`, `PKG_BUILDNUM`), then line selectors (`# [expr]`),
then YAML; a second pass feeds the rendered build number back as PKG_BUILDNUM,
as conda-build's finalization does. The functions here return what
conda-build's return for the same arguments (package spec strings, a
`re.Match` for load_file_regex).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import jinja2
import pytest
import yaml

from rollkv_dist.pin import PIN
from rollkv_dist.series import read_series

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipe"
SERIES = ROOT / "patches" / "series"
FAKE_HASH = "1a2b3c4"

_SELECTOR = re.compile(r"^(?P<body>.*?)\s*#\s*\[(?P<expr>[^\]]+)\]\s*$")




def load_variants(recipe: Path) -> list[dict]:
    """Expand conda_build_config.yaml into variants (zip_keys zipped, rest crossed)."""
    cbc = yaml.safe_load((recipe / "conda_build_config.yaml").read_text())
    zips = cbc.pop("zip_keys", [])
    zipped_keys = {k for group in zips for k in group}
    variants = [{}]
    for group in zips:
        lengths = {len(cbc[k]) for k in group}
        assert len(lengths) == 1, f"zip_keys group {group} has unequal lengths {lengths}"
        rows = [{k: cbc[k][i] for k in group} for i in range(lengths.pop())]
        variants = [{**v, **r} for v in variants for r in rows]
    for key, values in cbc.items():
        if key in zipped_keys:
            continue
        variants = [{**v, key: val} for v in variants for val in values]
    for v in variants:
        for k, val in list(v.items()):
            v[k] = "None" if val is None else str(val)
    return variants


def _apply_selectors(text: str, namespace: dict) -> str:
    out = []
    for line in text.splitlines():
        m = _SELECTOR.match(line)
        if m:
            if not eval(m.group("expr"), {"__builtins__": {}}, dict(namespace)):  # noqa: S307
                continue
            line = m.group("body")
        out.append(line)
    return "\n".join(out) + "\n"


def render(recipe: Path, variant: dict, environ: dict | None = None) -> dict:
    environ = dict(environ if environ is not None else {"HOME": "/home/builder"})
    platform = "linux-64"

    def compiler(lang):
        default = {"c": "gcc", "cxx": "gxx", "cuda": "cuda-nvcc"}[lang]
        name = variant.get(f"{lang}_compiler", default)
        version = variant.get(f"{lang}_compiler_version", "")
        return f"{name}_{platform} {version}".strip()

    def stdlib(lang):
        return f"{variant[f'{lang}_stdlib']}_{platform} {variant[f'{lang}_stdlib_version']}"

    def pin_compatible(name, min_pin="x.x.x.x.x.x", max_pin="x", lower_bound=None, upper_bound=None, exact=False):
        # conda-build pins against the version in the host environment; the
        # host's cuda-version is the variant's CUDA version
        assert name == "cuda-version", name
        version = variant["cuda_compiler_version"]
        parts = version.split(".")
        lower = ".".join(parts[: len(min_pin.split("."))])
        keep = len(max_pin.split("."))
        upper = parts[: keep - 1] + [str(int(parts[keep - 1]) + 1)] if keep <= len(parts) else parts
        return f"{name} >={lower},<{'.'.join(upper)}.0a0"

    def load_file_regex(load_file, regex_pattern, from_recipe_dir=False, recipe_dir=None, permit_undefined_jinja=True):
        assert from_recipe_dir, "the recipe reads its inputs relative to itself"
        path = (recipe / load_file).resolve()
        if not path.is_file():
            if permit_undefined_jinja:
                return None
            raise FileNotFoundError(path)
        return re.search(regex_pattern, path.read_text())

    def one_pass(buildnum: int) -> dict:
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(recipe)), undefined=jinja2.StrictUndefined)
        ctx = dict(variant)
        ctx.update(
            compiler=compiler,
            stdlib=stdlib,
            pin_compatible=pin_compatible,
            load_file_regex=load_file_regex,
            environ=environ,
            os=os,
            RECIPE_DIR=str(recipe),
            PKG_HASH=FAKE_HASH,
            PKG_BUILDNUM=str(buildnum),
        )
        text = env.get_template("meta.yaml").render(**ctx)
        namespace = {
            "linux": True, "linux64": True, "x86_64": True, "unix": True,
            "win": False, "osx": False, "aarch64": False, "ppc64le": False,
            **variant,
        }
        return yaml.safe_load(_apply_selectors(text, namespace))

    first = one_pass(0)
    meta = one_pass(int(first["build"]["number"]))
    meta["_rendered_twice_equal_number"] = first["build"]["number"] == meta["build"]["number"]
    return meta


VARIANTS = load_variants(RECIPE)
CPU = [v for v in VARIANTS if v["cuda_compiler_version"] == "None"]
CUDA = [v for v in VARIANTS if v["cuda_compiler_version"] != "None"]


def _ids(vs):
    return ["cuda" + v["cuda_compiler_version"] if v["cuda_compiler_version"] != "None" else "cpu" for v in vs]


def test_config_has_cpu_and_cuda_variants():
    assert len(CPU) == 1
    assert CUDA, "no CUDA variant in conda_build_config.yaml"
    versions = [v["cuda_compiler_version"] for v in CUDA]
    assert len(set(versions)) == len(versions)
    for v in versions:
        assert re.fullmatch(r"\d+\.\d+", v), v


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids(VARIANTS))
def test_recipe_agrees_with_pin_and_series(variant):
    meta = render(RECIPE, variant)
    assert meta["package"] == {"name": "rollkv-llamafile", "version": PIN.version}
    sdist, patches, tool = meta["source"]
    assert sdist["fn"] == PIN.sdist_filename
    assert sdist["sha256"] == PIN.sha256
    assert sdist["url"].startswith("file://")
    assert sdist["url"].endswith("/" + PIN.sdist_filename)
    assert patches == {"path": "../patches", "folder": "rollkv-patches"}
    assert (RECIPE / patches["path"]).resolve() == SERIES.parent
    assert tool == {"path": "../rollkv_dist", "folder": "rollkv-tool/rollkv_dist"}
    assert (RECIPE / tool["path"] / "cmake" / "rollkv.cmake").is_file()
    assert "patches" not in sdist, "the series is applied by build.sh (see meta.yaml)"
    assert meta["extra"]["rollkv_patches"] == read_series(SERIES.parent)
    upstream = meta["extra"]["upstream"]
    assert upstream == {
        "project": PIN.project,
        "version": PIN.version,
        "sdist": PIN.sdist_filename,
        "sha256": PIN.sha256,
        "llama_commit": PIN.llama_commit,
    }
    # knobs of build.sh passed through from the builder's environment (unset: rollkv.cmake's)
    assert meta["build"]["script_env"] == ["ROLLKV_BUILD_TARGETS", "ROLLKV_CUDA_ARCHITECTURES"]
    assert meta["about"]["license"] == "MIT"
    tests = meta["test"]["commands"]
    for prog in ("llama-server", "llama-cli", "llama-bench"):
        assert f'test -x "$PREFIX/bin/{prog}"' in tests
    assert (RECIPE / "run_test.sh").is_file()


@pytest.mark.parametrize(
    "environ",
    [
        {"HOME": "/home/u"},
        {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"},
        {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg", "ROLLKV_CACHE": "/c/rollkv-cache"},
    ],
    ids=["home", "xdg", "rollkv-cache"],
)
def test_sdist_is_where_rollkv_fetch_caches_it(environ):
    """The recipe takes the sdist from the cache that `rollkv source` fills."""
    from rollkv_dist.fetch import FetchSettings

    meta = render(RECIPE, CPU[0], environ=environ)
    expected = FetchSettings.resolve(env=environ).cached_sdist
    assert meta["source"][0]["url"] == f"file://{expected}"


def test_sdist_given_as_file(tmp_path):
    """$ROLLKV_SDIST (rollkv's local-copy setting) names the file itself."""
    local = tmp_path / PIN.sdist_filename
    meta = render(RECIPE, CPU[0], environ={"HOME": "/home/u", "ROLLKV_SDIST": str(local)})
    assert meta["source"][0]["url"] == f"file://{local}"
    assert meta["source"][0]["fn"] == PIN.sdist_filename


@pytest.mark.parametrize("variant", CUDA, ids=_ids(CUDA))
def test_cuda_variant(variant):
    meta = render(RECIPE, variant)
    cuda = variant["cuda_compiler_version"]
    major = int(cuda.split(".")[0])
    build = meta["build"]
    assert build["number"] == 200
    assert meta["_rendered_twice_equal_number"]
    assert build["string"] == f"cuda{cuda.replace('.', '')}_h{FAKE_HASH}_200"
    assert build["missing_dso_whitelist"] == ["*/libcuda.so.1"]
    reqs = meta["requirements"]
    assert f"cuda-nvcc_linux-64 {cuda}" in reqs["build"]
    assert f"gcc_linux-64 {variant['c_compiler_version']}" in reqs["build"]
    assert f"gxx_linux-64 {variant['cxx_compiler_version']}" in reqs["build"]
    assert f"sysroot_linux-64 {variant['c_stdlib_version']}" in reqs["build"]
    assert {"cmake >=3.21", "ninja", "git", "python"} <= set(reqs["build"])
    assert f"cuda-version {cuda}" in reqs["host"]
    assert {"cuda-cudart-dev", "libcublas-dev", "cuda-driver-dev"} <= set(reqs["host"])
    assert f"cuda-version >={major},<{major + 1}.0a0" in reqs["run"]
    assert "__cuda" in reqs["run"]
    assert "cuda-driver-dev" in meta["test"]["requires"]


def test_cpu_variant():
    meta = render(RECIPE, CPU[0])
    build = meta["build"]
    assert build["number"] == 0
    assert build["string"] == f"cpu_h{FAKE_HASH}_0"
    assert "missing_dso_whitelist" not in build
    reqs = meta["requirements"]
    assert not any("cuda" in r for r in reqs["build"]), reqs["build"]
    assert not reqs.get("host")
    assert not reqs.get("run")
    assert not (meta["test"].get("requires"))


def test_cuda_builds_rank_above_cpu_build():
    numbers = {v["cuda_compiler_version"]: render(RECIPE, v)["build"]["number"] for v in VARIANTS}
    cpu = numbers.pop("None")
    assert all(n > cpu for n in numbers.values()), numbers


def test_skipped_off_linux64():
    text = (RECIPE / "meta.yaml").read_text()
    assert re.search(r"^\s*skip: true\s+# \[not linux64\]\s*$", text, re.M)


def test_patch_list_follows_series_file(tmp_path):
    """A series with comments and blank lines renders as its names, in order."""
    shutil.copytree(RECIPE, tmp_path / "recipe")
    (tmp_path / "rollkv_dist").mkdir()
    shutil.copy(ROOT / "rollkv_dist" / "pin.py", tmp_path / "rollkv_dist" / "pin.py")
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "series").write_text(
        "# rolling KV\n"
        "0002-position-window.patch\n"
        "\n"
        "0001-kv-residency-flags.patch   # flags first? no: order is the file's\n"
        "0089-rolling-kv-compute-reserve.patch\n"
    )
    meta = render(tmp_path / "recipe", CUDA[-1])
    assert meta["extra"]["rollkv_patches"] == [
        "0002-position-window.patch",
        "0001-kv-residency-flags.patch",
        "0089-rolling-kv-compute-reserve.patch",
    ]


def test_recipe_reads_the_pin_file(tmp_path):
    """Changing pin.py changes the rendered recipe: the values are not copied into it."""
    shutil.copytree(RECIPE, tmp_path / "recipe")
    shutil.copytree(ROOT / "patches", tmp_path / "patches")
    (tmp_path / "rollkv_dist").mkdir()
    pin_text = (ROOT / "rollkv_dist" / "pin.py").read_text()
    other_sha = "0" * 64
    pin_text = pin_text.replace(PIN.sha256, other_sha).replace(f'version="{PIN.version}"', 'version="9.9.9"')
    (tmp_path / "rollkv_dist" / "pin.py").write_text(pin_text)
    meta = render(tmp_path / "recipe", CPU[0])
    assert meta["package"]["version"] == "9.9.9"
    assert meta["source"][0]["sha256"] == other_sha
    assert meta["source"][0]["fn"] == "llama_cpp_python-9.9.9.tar.gz"


# The packaging files name no package index: no URL but file://, and nothing shaped like a host name.
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://", re.I)
_HOST = re.compile(r"\b[a-z0-9-]+(?:\.[a-z0-9-]+)*\.(?:org|com|io|dev|net)\b", re.I)


@pytest.mark.parametrize("rel", ["recipe", "environment.yml", "flake.nix", "flake.lock", "tests/nixpkgs-stub"])
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
