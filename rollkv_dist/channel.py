"""`rollkv channel DIR`: build the variants this machine can build into a conda channel.

CPU always; CUDA where nvcc exists (its version picks the variant, e.g. cuda130). Every
variant is built from `rollkv recipe export`'s self-contained recipe:

* through conda-build where it is installed (`conda-build` on PATH): conda-build resolves
  conda-forge's compilers, builds, post-processes and tests the package itself; for a CUDA
  variant on a machine whose driver NVML cannot see, CONDA_OVERRIDE_CUDA=<version> is set so
  the test environment (run: __cuda) can be solved;
* otherwise through the offline packer: conda-build's work-dir layout by hand (the sdist
  unpacked, the queue and rollkv_dist next to it), the recipe's build.sh with conda-build's
  variables, the host prefix packed as a .conda (conda-package-handling; paths.json with
  prefix placeholders, index.json from the rendered meta.yaml: name, version, build string
  and number, run and run_constrained), installed into a fresh prefix with py-rattler and
  checked with the recipe's run_test.sh. Its packages use the build machine's compilers and
  system libraries (glibc, libstdc++): for hosts like the builder; conda-build's are
  conda-forge packages.

DIR gets noarch/ and linux-64/ with repodata.json (py-rattler's indexer): serve it as static
files (`conda install -c file:///abs/DIR rollkv-llamafile`, pixi, micromamba) or upload
the .conda files to any channel host.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import json
import operator
import os
import re
import shutil
import subprocess
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollkv_dist.commands import add_command
from rollkv_dist import log
from rollkv_dist.build import run_logged
from rollkv_dist.detect import CPU, Variant, machine_variants
from rollkv_dist.errors import BuildError, UsageError
from rollkv_dist.pin import PIN
from rollkv_dist.proc import run as run_process
from rollkv_dist.recipe import PACKAGE_NAME, ExportSettings, export_recipe
from rollkv_dist.util import (default_patches_dir, extract_all, make_temp_dir, optional_import, resolve_jobs,
                              sha256_file)

SUBDIR = "linux-64"
# conda-build builds into a host prefix with a long placeholder name, so that the installer
# can rewrite the path in binaries; the offline packer does the same
PLACEHOLDER_DIR = "host_env_" + "_placehold" * 12
_SELECTOR = re.compile(r"^(?P<body>.*?)\s*#\s*\[(?P<expr>[^\]]+)\]\s*$")


# --------------------------------------------------------------------------- rendering


_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b}


def selector_value(expr: str, namespace: Mapping[str, Any]) -> Any:
    """A `# [expr]` selector's value: names of the namespace, literals, `not`, `and`, `or` and comparisons, as
    conda-build reads them; anything else (a call, an attribute, an unknown name) is a UsageError naming it,
    never evaluated."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Name):
            if node.id not in namespace:
                raise UsageError(f"selector [{expr}]: {node.id!r} is not a variant key or platform name")
            return namespace[node.id]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(value(e) for e in node.elts)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not value(node.operand)
        if isinstance(node, ast.BoolOp):
            if isinstance(node.op, ast.And):
                return all(value(v) for v in node.values)
            return any(value(v) for v in node.values)
        if isinstance(node, ast.Compare):
            left = value(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = value(right_node)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        raise UsageError(f"selector [{expr}]: {type(node).__name__} is not allowed in a selector")

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise UsageError(f"selector [{expr}]: {e.msg}") from e
    return value(tree)


def _apply_selectors(text: str, namespace: Mapping[str, Any]) -> str:
    out = []
    for line in text.splitlines():
        m = _SELECTOR.match(line)
        if m:
            if not selector_value(m.group("expr"), namespace):
                continue
            line = m.group("body")
        out.append(line)
    return "\n".join(out) + "\n"


def render_meta(recipe: Path, variant: Mapping[str, str], environ: Mapping[str, str] | None = None,
                pkg_hash: str = "1a2b3c4") -> dict[str, Any]:
    """meta.yaml rendered the way conda-build renders it, without conda-build: jinja2 with
    conda-build's recipe functions (compiler, stdlib, pin_compatible, load_file_regex,
    load_file_data, environ), line selectors, YAML, and a second pass with the rendered build number as
    PKG_BUILDNUM. The functions return what conda-build's return for the arguments used."""
    jinja2 = optional_import("jinja2", "rendering the conda recipe")
    yaml = optional_import("yaml", "rendering the conda recipe")

    environ = dict(environ if environ is not None else {"HOME": "/home/builder"})
    platform = SUBDIR

    def compiler(lang: str) -> str:
        default = {"c": "gcc", "cxx": "gxx", "cuda": "cuda-nvcc"}[lang]
        name = variant.get(f"{lang}_compiler", default)
        version = variant.get(f"{lang}_compiler_version", "")
        return f"{name}_{platform} {version}".strip()

    def stdlib(lang: str) -> str:
        return (f"{variant.get(f'{lang}_stdlib', 'sysroot')}_{platform} "
                f"{variant.get(f'{lang}_stdlib_version', '')}").strip()

    def pin_compatible(name: str, min_pin: str = "x.x.x.x.x.x", max_pin: str = "x",
                       lower_bound: Any = None, upper_bound: Any = None, exact: bool = False) -> str:
        # conda-build pins against the host environment's version; the host's cuda-version
        # is the variant's CUDA version
        assert name == "cuda-version", name
        parts = variant["cuda_compiler_version"].split(".")
        lower = ".".join(parts[: len(min_pin.split("."))])
        keep = len(max_pin.split("."))
        upper = parts[: keep - 1] + [str(int(parts[keep - 1]) + 1)] if keep <= len(parts) else parts
        return f"{name} >={lower},<{'.'.join(upper)}.0a0"

    def load_file_regex(load_file: str, regex_pattern: str, from_recipe_dir: bool = False,
                        recipe_dir: str | None = None, permit_undefined_jinja: bool = True) -> Any:
        path = (recipe / load_file).resolve() if from_recipe_dir else Path(load_file)
        if not path.is_file():
            if permit_undefined_jinja:
                return None
            raise FileNotFoundError(path)
        return re.search(regex_pattern, path.read_text())

    def load_file_data(filename: str, file_type: str | None = None, from_recipe_dir: bool = False,
                       recipe_dir: str | None = None, permit_undefined_jinja: bool = True) -> Any:
        path = (recipe / filename).resolve() if from_recipe_dir else Path(filename)
        kind = file_type or path.suffix.lstrip(".")
        if kind != "toml":
            raise ValueError(f"load_file_data: only TOML is rendered here, not {kind!r} ({path})")
        if not path.is_file():
            if permit_undefined_jinja:
                return {}
            raise FileNotFoundError(path)
        return tomllib.loads(path.read_text())

    def one_pass(buildnum: int) -> dict[str, Any]:
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(recipe)),
                                 undefined=jinja2.StrictUndefined)
        ctx: dict[str, Any] = dict(variant)
        ctx.update(compiler=compiler, stdlib=stdlib, pin_compatible=pin_compatible,
                   load_file_regex=load_file_regex, load_file_data=load_file_data, environ=environ, os=os,
                   RECIPE_DIR=str(recipe), PKG_HASH=pkg_hash, PKG_BUILDNUM=str(buildnum))
        text = env.get_template("meta.yaml").render(**ctx)
        namespace = {"linux": True, "linux64": True, "x86_64": True, "unix": True, "win": False,
                     "osx": False, "aarch64": False, "ppc64le": False, **variant}
        return yaml.safe_load(_apply_selectors(text, namespace))

    first = one_pass(0)
    meta = one_pass(int(first["build"]["number"]))
    if first["build"]["number"] != meta["build"]["number"]:
        raise UsageError(f"{recipe}/meta.yaml: the build number depends on PKG_BUILDNUM")
    return meta


# --------------------------------------------------------------------------- variants


def conda_build_config(variants: list[dict[str, str]]) -> str:
    """A variant config for conda-build outside conda-forge's pinning: the CUDA versions,
    zipped with the glibc baseline each needs (CUDA 13 needs 2.28)."""
    cudas = [v["cuda_compiler_version"] for v in variants]
    stdlib = ["2.28" if c != "None" and int(c.split(".")[0]) >= 13 else "2.17" for c in cudas]
    lines = ["cuda_compiler:", "  - cuda-nvcc", "cuda_compiler_version:"]
    lines += [f"  - {c}" if c == "None" else f'  - "{c}"' for c in cudas]
    lines += ["c_stdlib_version:"] + [f'  - "{s}"' for s in stdlib]
    lines += ["zip_keys:", "  - - cuda_compiler_version", "    - c_stdlib_version"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- packages


def pack_conda(prefix: Path, out_dir: Path, index: dict[str, Any],
               about: dict[str, Any] | None = None) -> Path:
    """Pack an installed host prefix as a .conda the way conda-build's packaging step does:
    info/index.json, paths.json (sha256, size, prefix placeholders), files, has_prefix."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # packed in a temporary folder next to the channel's packages, the .conda renamed into place
    # when complete: an interrupted or failed pack leaves no partial package to be indexed
    tmp = make_temp_dir(out_dir, f".stage-{index['build']}-")
    try:
        fn = _pack_staged(prefix, tmp, index, about)
        os.replace(tmp / fn, out_dir / fn)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir / fn


def _pack_staged(prefix: Path, tmp: Path, index: dict[str, Any], about: dict[str, Any] | None) -> str:
    """pack_conda's work inside `tmp`: the prefix copied to tmp/pkg, its info/, tmp/<name>.conda."""
    api = optional_import("conda_package_handling.api", "packing a .conda")

    stage = tmp / "pkg"
    shutil.copytree(prefix, stage, symlinks=True)
    placeholder = str(prefix).encode()
    entries, has_prefix = [], []
    for path in sorted(p for p in stage.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(stage).as_posix()
        if path.is_symlink():
            target = path.resolve()
            entries.append({"_path": rel, "path_type": "softlink", "sha256": sha256_file(target),
                            "size_in_bytes": target.stat().st_size})
            continue
        data = path.read_bytes()
        entry: dict[str, Any] = {"_path": rel, "path_type": "hardlink",
                                 "sha256": hashlib.sha256(data).hexdigest(),
                                 "size_in_bytes": len(data)}
        if placeholder in data:
            mode = "binary" if b"\0" in data else "text"
            entry.update(prefix_placeholder=str(prefix), file_mode=mode)
            has_prefix.append(f"{prefix} {mode} {rel}")
        entries.append(entry)
    info = stage / "info"
    info.mkdir()
    index = {"platform": "linux", "arch": "x86_64", "subdir": SUBDIR, "depends": [],
             "timestamp": int(time.time() * 1000), **index}
    (info / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (info / "paths.json").write_text(json.dumps({"paths": entries, "paths_version": 1}, indent=2))
    (info / "files").write_text("".join(e["_path"] + "\n" for e in entries))
    if has_prefix:
        (info / "has_prefix").write_text("\n".join(has_prefix) + "\n")
    (info / "about.json").write_text(json.dumps(about or {}, indent=2))
    file_list = [p.relative_to(stage).as_posix() for p in sorted(stage.rglob("*"))
                 if p.is_file() or p.is_symlink()]
    fn = f"{index['name']}-{index['version']}-{index['build']}.conda"
    api.create(str(stage), file_list, fn, out_folder=str(tmp))
    return fn


def index_channel(channel: Path) -> dict[str, Any]:
    """noarch/ and linux-64/ repodata.json (py-rattler's indexer); returns linux-64's."""
    from rattler.index import index_fs

    (channel / "noarch").mkdir(parents=True, exist_ok=True)
    (channel / SUBDIR).mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel, force=True))
    return json.loads((channel / SUBDIR / "repodata.json").read_text())


def install_from_channel(channel: Path, specs: list[str], target: Path, cache: Path,
                         cuda: str | None = None) -> list[Any]:
    """Solve `specs` against this channel only (no other channel, no network) and install them
    into `target` with py-rattler. `cuda`: the __cuda virtual package to assume (what
    CONDA_OVERRIDE_CUDA does for conda), for a CUDA package on a machine without a driver."""
    rattler = optional_import("rattler", "installing from the channel")

    virtual = []
    if cuda:
        # py-rattler 0.28 takes the build string only as a BuildString; older releases take a str
        build = rattler.BuildString("0") if hasattr(rattler, "BuildString") else "0"
        virtual.append(rattler.GenericVirtualPackage(rattler.PackageName("__cuda"),
                                                     rattler.Version(cuda), build))
    chan = rattler.Channel(channel.absolute().as_uri())
    records = asyncio.run(rattler.solve(sources=[chan], specs=specs, platforms=[SUBDIR, "noarch"],
                                        virtual_packages=virtual))
    asyncio.run(rattler.install(records, target_prefix=target, cache_dir=cache,
                                show_progress=False))
    return records


# --------------------------------------------------------------------------- building


@dataclass(frozen=True)
class ChannelSettings:
    out: Path
    work: Path
    variants: tuple[Variant, ...]
    builder: str
    patches_dir: Path
    sdist: Path | None = None
    """A verified local sdist (offline packer); None: fetched through rollkv's cache."""
    tree: Path | None = None
    """An existing llama.cpp tree to build instead of the sdist's (a `rollkv pack` archive)."""
    build_dir: Path | None = None
    """An existing build dir of `tree` to reuse (the tests' shared CPU build)."""
    jobs: int = 0
    source_url: str | None = None
    """The sdist URL the exported recipe names (conda-build path; default: pip resolves it)."""
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def resolve(cls, out: str | os.PathLike[str], *, work: str | os.PathLike[str] | None = None,
                variants: list[str] | None = None, builder: str = "auto",
                patches_dir: str | os.PathLike[str] | None = None,
                sdist: str | os.PathLike[str] | None = None,
                tree: str | os.PathLike[str] | None = None,
                build_dir: str | os.PathLike[str] | None = None, jobs: int | None = None,
                source_url: str | None = None,
                env: Mapping[str, str] | None = None) -> ChannelSettings:
        env = dict(os.environ if env is None else env)
        if builder == "auto":
            builder = "conda-build" if shutil.which("conda-build", path=env.get("PATH")) else "offline"
        # only CPU asked for: no CUDA detection, so no word about a CUDA variant
        cpu_only = bool(variants) and all(v == "cpu" for v in variants)
        # conda-build brings its own toolkit and cuBLAS from conda-forge; the offline packer builds against ours
        found = [CPU] if cpu_only else machine_variants(env, need_cublas=builder == "offline")
        if variants:
            by_label = {v.name: v for v in found}
            by_label.update({"cuda": v for v in found if v.kind == "cuda"})  # `cuda`: the toolkit's own
            missing = [v for v in variants if v not in by_label]
            if missing:
                raise UsageError(f"variant {', '.join(missing)} cannot be built here (this machine "
                                 f"can build: {', '.join(by_label)}; CUDA needs nvcc)")
            chosen = tuple(by_label[v] for v in variants)
        else:
            chosen = tuple(found)
        if builder not in ("conda-build", "offline"):
            raise UsageError(f"--builder {builder!r}: choose auto, conda-build or offline")
        if builder == "conda-build" and not shutil.which("conda-build", path=env.get("PATH")):
            raise UsageError("--builder conda-build: conda-build is not on PATH "
                             "(`conda install conda-build`), or use --builder offline")
        njobs = resolve_jobs(jobs)  # as `rollkv build`: 0 is refused, not read as "all CPUs"
        out_p = Path(out).absolute()
        return cls(out=out_p, work=Path(work).absolute() if work else out_p.parent / (out_p.name + ".work"),
                   variants=chosen, builder=builder,
                   patches_dir=(Path(patches_dir) if patches_dir else default_patches_dir(env)).absolute(),
                   sdist=Path(sdist).absolute() if sdist else None,
                   tree=Path(tree).absolute() if tree else None,
                   build_dir=Path(build_dir).absolute() if build_dir else None,
                   jobs=njobs, source_url=source_url, env=env)


def _verified_sdist(settings: ChannelSettings) -> Path:
    from rollkv_dist.fetch import FetchSettings, fetch_sdist

    return fetch_sdist(FetchSettings.resolve(sdist=settings.sdist, env=settings.env))


def _no_driver() -> bool:
    from rollkv_dist.gpu import probe

    return not probe().gpus


def _build_with_conda_build(settings: ChannelSettings, recipe: Path) -> list[Path]:
    cbc = settings.work / "variants.yaml"
    cbc.write_text(conda_build_config([v.conda_config() for v in settings.variants]))
    env = dict(settings.env)
    cudas = [v.cuda_version for v in settings.variants if v.kind == "cuda"]
    if cudas and "CONDA_OVERRIDE_CUDA" not in env and _no_driver():
        env["CONDA_OVERRIDE_CUDA"] = max(cudas, key=lambda c: tuple(map(int, c.split("."))))
        log.info(f"no NVIDIA driver visible: CONDA_OVERRIDE_CUDA={env['CONDA_OVERRIDE_CUDA']} so "
                 f"the CUDA test environment (run: __cuda) can be solved")
    cmd = ["conda-build", str(recipe), "-m", str(cbc), "--output-folder", str(settings.out),
           "--no-anaconda-upload"]
    log.info("$ " + " ".join(cmd))
    proc = run_process(cmd, env=env)
    if proc.returncode != 0:
        raise BuildError(f"conda-build failed (exit {proc.returncode}); see its output above")
    return sorted(settings.out.glob(f"{SUBDIR}/{PACKAGE_NAME}-*.conda")) + sorted(
        settings.out.glob(f"{SUBDIR}/{PACKAGE_NAME}-*.tar.bz2"))


def _work_dir_sources(settings: ChannelSettings, recipe: Path, src: Path,
                      sdist: Path | None) -> Path:
    """conda-build's work dir for the exported recipe: the sdist (top folder hoisted) or the
    given tree, `patches` in rollkv-patches/, `rollkv_dist` in rollkv-tool/rollkv_dist."""
    import tarfile

    if src.exists():
        shutil.rmtree(src)
    if settings.tree is None:
        assert sdist is not None
        src.mkdir(parents=True)
        with log.step(f"Unpacking {sdist.name}"):
            with tarfile.open(sdist) as tf:
                extract_all(tf, src.parent / "unpack")
            (src.parent / "unpack" / PIN.sdist_root).rename(src / "sdist")
            shutil.rmtree(src.parent / "unpack")
        root = src / "sdist"
    else:
        src.mkdir(parents=True)
        root = settings.tree  # built in place: an existing build dir stays valid
    shutil.copytree(recipe / "patches", src / "rollkv-patches")
    shutil.copytree(recipe / "rollkv_dist", src / "rollkv-tool" / "rollkv_dist")
    return root


def _build_offline(settings: ChannelSettings, recipe: Path, sdist: Path | None) -> list[Path]:
    built = []
    for variant in settings.variants:
        label, config = variant.name, variant.conda_config()
        vhash = "h" + hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:7]
        meta = render_meta(recipe, config, environ=settings.env, pkg_hash=vhash[1:])
        work = settings.work / label
        src = work / "work"
        root = _work_dir_sources(settings, recipe, src, sdist)
        prefix = work / PLACEHOLDER_DIR
        shutil.rmtree(prefix, ignore_errors=True)
        prefix.mkdir(parents=True)
        env = {k: v for k, v in settings.env.items()
               if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TERM", "USER", "CUDACXX",
                        "ROLLKV_BUILD_TARGETS", "ROLLKV_CUDA_ARCHITECTURES")}
        env.update(SRC_DIR=str(root), PREFIX=str(prefix), BUILD_PREFIX=str(work / "build_env"),
                   RECIPE_DIR=str(recipe), CPU_COUNT=str(settings.jobs), PKG_NAME=PACKAGE_NAME,
                   PKG_VERSION=str(meta["package"]["version"]),
                   PKG_BUILDNUM=str(meta["build"]["number"]), PKG_BUILD_STRING=meta["build"]["string"],
                   PKG_HASH=vhash, CONDA_BUILD="1", target_platform=SUBDIR, build_platform=SUBDIR,
                   SHLIB_EXT=".so", cuda_compiler_version=config["cuda_compiler_version"],
                   ROLLKV_PATCH_DIR=str(src / "rollkv-patches"),
                   ROLLKV_TOOL_DIR=str(src / "rollkv-tool"))
        if settings.build_dir is not None:
            env["ROLLKV_BUILD_DIR"] = str(settings.build_dir)
        logfile = work / "build.log"
        logfile.unlink(missing_ok=True)
        with log.step(f"Building {label} with {recipe / 'build.sh'} (log: {logfile})"):
            # ninja's [N/M] lines as a progress line: the build takes minutes (8 on 2 cores for the CPU variant)
            run_logged(["bash", str(recipe / "build.sh")], logfile, env, f"build.sh for {label}",
                       ninja_progress=True, cwd=root)
        req = meta.get("requirements") or {}
        # built against this machine's toolkit and system libraries, not conda-forge's packages:
        # only the virtual packages of `run` (__cuda) apply
        index = {"name": meta["package"]["name"], "version": str(meta["package"]["version"]),
                 "build": meta["build"]["string"], "build_number": int(meta["build"]["number"]),
                 "depends": [str(d) for d in (req.get("run") or []) if str(d).startswith("__")],
                 "constrains": [str(d) for d in (req.get("run_constrained") or [])],
                 "license": meta["about"]["license"]}
        with log.step(f"Packing {index['name']}-{index['version']}-{index['build']}.conda"):
            pkg = pack_conda(prefix, settings.out / SUBDIR, index,
                             about={k: meta["about"].get(k) for k in ("home", "summary", "license")})
        built.append(pkg)
    return built


def _recipe_test(settings: ChannelSettings, recipe: Path, pkg: Path) -> None:
    """Install the package from the channel into a fresh prefix; run the recipe's test."""
    name, version, build = pkg.name[: -len(".conda")].rsplit("-", 2)
    cuda = None
    m = re.match(r"cuda(\d+)(\d)_", build)
    if m:
        cuda = f"{m.group(1)}.{m.group(2)}"
    target = settings.work / "test" / build
    shutil.rmtree(target, ignore_errors=True)
    with log.step(f"Testing {pkg.name} in a fresh prefix (py-rattler)"):
        install_from_channel(settings.out, [f"{name} =={version} {build}"], target,
                             settings.work / "pkgs", cuda=cuda)
        env = {k: v for k, v in settings.env.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        proc = run_process(["bash", str(recipe / "run_test.sh")], env={**env, "PREFIX": str(target)},
                           stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{pkg.name}: run_test.sh failed in {target}:\n{proc.stdout}{proc.stderr}")


def build_channel(settings: ChannelSettings) -> list[Path]:
    """Export the recipe, build every variant, index the channel; the package paths."""
    settings.work.mkdir(parents=True, exist_ok=True)
    recipe = settings.work / "recipe"
    shutil.rmtree(recipe, ignore_errors=True)
    offline_url, sdist = settings.source_url, None
    if settings.builder == "offline":
        # the offline packer unpacks the verified sdist itself (rollkv's cache, pip); the
        # exported recipe records where it came from
        if settings.tree is None:
            sdist = _verified_sdist(settings)
        offline_url = offline_url or (sdist or settings.tree or Path(".")).absolute().as_uri()
    export = ExportSettings.resolve(recipe, patches_dir=settings.patches_dir, source_url=offline_url,
                                    env=settings.env, feedstock=False)
    with log.step(f"Exporting the recipe ({', '.join(v.name for v in settings.variants)}; "
                  f"{settings.builder})"):
        export_recipe(export)
    settings.out.mkdir(parents=True, exist_ok=True)
    if settings.builder == "conda-build":
        built = _build_with_conda_build(settings, recipe)
    else:
        built = _build_offline(settings, recipe, sdist)
    with log.step(f"Indexing {settings.out}"):
        repodata = index_channel(settings.out)
    log.info(f"{len(repodata.get('packages.conda', {}))} packages in {settings.out / SUBDIR}")
    if settings.builder == "offline":
        for pkg in built:
            _recipe_test(settings, recipe, pkg)
    return built


def channel_package(channel: Path, variant: Variant, patches_dir: Path) -> Path | None:
    """The channel's package of this variant for this series (version and series digest), if any."""
    from rollkv_dist.series import package_version, read_series, series_digest

    names = read_series(patches_dir)
    pattern = (f"{PACKAGE_NAME}-{package_version(len(names))}-{variant.name}"
               f"_s{series_digest(patches_dir, names)}_*.conda")
    found = sorted((channel / SUBDIR).glob(pattern))
    return found[-1] if found else None


def install_artifact(settings: ChannelSettings, target: Path) -> Path:
    """The channel's package of settings.variants[0] installed into a fresh `target` (built
    first when the channel lacks it): the conda artifact the gates and the smoke gate run."""
    variant = settings.variants[0]
    pkg = channel_package(settings.out, variant, settings.patches_dir)
    if pkg is None:
        build_channel(settings)
        pkg = channel_package(settings.out, variant, settings.patches_dir)
        if pkg is None:
            raise BuildError(f"the build left no {variant.name} package in {settings.out}")
    name, version, build = pkg.name[: -len(".conda")].rsplit("-", 2)
    shutil.rmtree(target, ignore_errors=True)
    with log.step(f"Installing {pkg.name} from {settings.out} into {target}"):
        install_from_channel(settings.out, [f"{name} =={version} {build}"], target,
                             settings.work / "pkgs", cuda=variant.cuda_version)
    return target


def _run(args: argparse.Namespace) -> int:
    settings = ChannelSettings.resolve(args.out, work=args.work, variants=args.variant,
                                       builder=args.builder, patches_dir=args.patches,
                                       sdist=args.sdist, tree=args.tree, jobs=args.jobs,
                                       source_url=args.source_url)
    if args.install:
        if len(settings.variants) != 1:
            raise UsageError("--install takes one --variant (cpu or cuda<MAJOR><MINOR>)")
        install_artifact(settings, Path(args.install).absolute())
        return 0
    built = build_channel(settings)
    for pkg in built:
        log.info(f"built {pkg}")
    log.info(f"install: conda install -c {settings.out.as_uri()} {PACKAGE_NAME}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "channel", "build the variants this machine can build into a conda channel",
                    "CPU always, CUDA where nvcc exists; through conda-build where installed, else the offline "
                    "packer. DIR gets indexed noarch/ and linux-64/.", _run)
    p.add_argument("out", help="channel directory (created; existing packages are kept)")
    p.add_argument("--variant", action="append", help="cpu, cuda (the toolkit found) or cuda<MAJOR><MINOR>, the "
                   "names `rollkv build` takes (repeatable; default: every variant this machine can build)")
    p.add_argument("--builder", default="auto", help="auto (default), conda-build or offline")
    p.add_argument("--work", help="work directory (default: OUT.work next to OUT)")
    p.add_argument("--patches", help="patch queue (default: the repository's patches/)")
    p.add_argument("--sdist", help="local copy of the pinned sdist (default: rollkv's cache, pip)")
    p.add_argument("--tree", help="offline packer: build this llama.cpp tree (e.g. an unpacked "
                   "`rollkv pack` archive on a host without network) instead of the sdist's")
    p.add_argument("-j", "--jobs", type=int, help="parallel jobs, >= 1 (default: all CPUs)")
    p.add_argument("--source-url", help="sdist URL for the exported recipe (conda-build; "
                   "default: where pip finds the pinned sdist)")
    p.add_argument("--install", metavar="PREFIX",
                   help="install the --variant's package for this series from the channel into "
                        "a fresh PREFIX (py-rattler), building it first if the channel lacks it")
