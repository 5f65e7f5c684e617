"""One build definition, three consumers: `rollkv build` (rollkv_dist/build.py),
recipe/build.sh (conda) and package.nix (Nix, through flake.nix).

Each consumer's configure line is derived here the way it really is produced: BuildSettings'
configure command, build.sh run under conda-build's variables with a recording `cmake` on
PATH, package.nix's cmakeFlags evaluated by nix-instantiate (stand-in nixpkgs). Every one
must load rollkv_dist/cmake/rollkv.cmake with -C, and the effective settings (the initial
cache overridden by the line's -D) must be the same for all three, apart from what each
ecosystem owns (install prefix, make program, compilers, the CUDA architectures it computes).
The build step must be the target rollkv-programs and the install rule rollkv-install.cmake.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from _mini_llama import FLAGS_EDIT, make_mini_llama_sdist
from test_flake_eval import evaluate
from test_recipe_build import conda_build_env, lay_out_work_dir

from rollkv_dist.build import INITIAL_CACHE, INSTALL_SCRIPT, PROGRAMS_TARGET, BuildSettings, initial_cache
from rollkv_dist.series import build_commit, read_series

ROOT = Path(__file__).resolve().parents[1]
# owned by each ecosystem, not by the build definition
ECOSYSTEM = {"CMAKE_INSTALL_PREFIX", "CMAKE_PREFIX_PATH", "CMAKE_MAKE_PROGRAM",
             "CMAKE_CUDA_COMPILER", "CMAKE_CUDA_ARCHITECTURES"}
_BOOL = {"TRUE": "ON", "FALSE": "OFF", "ON": "ON", "OFF": "OFF"}

RECORDING_CMAKE = r'''#!/bin/sh
# records every cmake call, one per line (arguments separated by \x1f)
printf '%s\037' "$@" >> "$CMAKE_CALLS"; echo >> "$CMAKE_CALLS"
prev=""
for a in "$@"; do
  if [ "$prev" = "-B" ]; then mkdir -p "$a"; printf 'llama-server' > "$a/rollkv-programs.txt"; fi
  prev="$a"
done
exit 0
'''


def parse_line(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(-C files, -D definitions with BOOL values as ON/OFF) of a configure line."""
    caches, defs = [], {}
    it = iter(range(len(args)))
    for i in it:
        a = args[i]
        if a == "-C":
            caches.append(args[i + 1])
            next(it)
        elif a.startswith("-C"):
            caches.append(a[2:])
        elif a.startswith("-D"):
            m = re.fullmatch(r"-D([A-Za-z0-9_.]+)(?::([A-Z]+))?=(.*)", a)
            assert m, a
            value = m.group(3)
            defs[m.group(1)] = _BOOL.get(value.upper(), value) if m.group(2) in (None, "BOOL") else value
    return caches, defs


def effective(defs: dict[str, str]) -> dict[str, str]:
    cache = {k: _BOOL.get(v.upper(), v) for k, v in initial_cache().items()}
    return {k: v for k, v in {**cache, **defs}.items() if k not in ECOSYSTEM}


# --------------------------------------------------------------------------- the three lines


def tool_lines(tmp_path: Path, variant: str) -> dict[str, list[str]]:
    tree = tmp_path / "tree"
    (tree / "ggml").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text('project("llama.cpp")\n')
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "CUDACXX": str(nvcc)}
    from rollkv_dist.series import PROVENANCE_FILE

    import json
    series = read_series(ROOT / "patches")
    (tree / PROVENANCE_FILE).write_text(json.dumps({"series": series, "excluded": []}))
    s = BuildSettings.resolve(tree, tmp_path / "prefix", variant=variant,
                              cuda_arch="90-real" if variant == "cuda" else None, env=env)
    return {"configure": s.configure_command(), "build": s.build_command(),
            "install": s.install_command()}


def recipe_lines(tmp_path: Path, variant: str) -> dict[str, list[str]]:
    """build.sh on an sdist-shaped tree with the repository's series replaced by a small one
    (the build commit counts the series, so it uses the same count as the others)."""
    sdist, queue = make_mini_llama_sdist(tmp_path, [("0001-kv-residency-flags.patch", FLAGS_EDIT)])
    src = lay_out_work_dir(tmp_path, sdist, queue)
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "cmake").write_text(RECORDING_CMAKE)
    (bindir / "cmake").chmod(0o755)
    calls = tmp_path / "cmake-calls"
    env = conda_build_env(src, tmp_path / "prefix", tmp_path / "build_env",
                          cuda="13.0" if variant == "cuda" else "None")
    env.update(PATH=f"{bindir}:{env['PATH']}", CMAKE_CALLS=str(calls),
               CMAKE_ARGS="-DCMAKE_AR=/bin/ar -DCMAKE_INSTALL_PREFIX=/conda/prefix")
    (tmp_path / "prefix").mkdir()
    proc = subprocess.run(["bash", str(ROOT / "recipe" / "build.sh")], env=env, cwd=src,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln.split("\x1f")[:-1] for ln in calls.read_text().splitlines() if ln]
    configure = [ln for ln in lines if "-S" in ln]
    build = [ln for ln in lines if ln[:1] == ["--build"]]
    install = [ln for ln in lines if "-P" in ln]
    assert len(configure) == len(build) == len(install) == 1, lines
    # the conda toolchain string comes first; the build definition's line follows
    line = configure[0]
    assert line[:2] == ["-DCMAKE_AR=/bin/ar", "-DCMAKE_INSTALL_PREFIX=/conda/prefix"]
    return {"configure": ["cmake", *line[2:]], "build": ["cmake", *build[0]],
            "install": ["cmake", *install[0]], "series": read_series(queue)}


@pytest.fixture(scope="module")
def flake_outputs(tmp_path_factory):
    return evaluate(ROOT, tmp_path_factory.mktemp("nix-home"))


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_three_consumers_configure_the_same_build(tmp_path, flake_outputs, variant):
    tool = tool_lines(tmp_path / "tool", variant)
    recipe = recipe_lines(tmp_path / "recipe", variant)
    nix = flake_outputs[variant]

    lines = {"rollkv build": tool["configure"], "recipe/build.sh": recipe["configure"],
             "package.nix": nix["cmakeFlags"]}
    parsed = {who: parse_line(line) for who, line in lines.items()}
    # every consumer loads the one initial cache, once
    assert parsed["rollkv build"][0] == [str(INITIAL_CACHE)]
    assert parsed["recipe/build.sh"][0] == [
        str(tmp_path / "recipe" / "work" / "rollkv-tool" / "rollkv_dist" / "cmake" / "rollkv.cmake")]
    assert len(parsed["package.nix"][0]) == 1
    assert parsed["package.nix"][0][0].endswith("-rollkv-tool/rollkv_dist/cmake/rollkv.cmake")

    # the same effective settings; the build commit counts each one's series
    eff = {who: effective(defs) for who, (_, defs) in parsed.items()}
    n_repo = len(read_series(ROOT / "patches"))
    assert eff["rollkv build"]["LLAMA_BUILD_COMMIT"] == build_commit(read_series(ROOT / "patches"))
    assert eff["package.nix"]["LLAMA_BUILD_COMMIT"] == eff["rollkv build"]["LLAMA_BUILD_COMMIT"]
    assert eff["recipe/build.sh"]["LLAMA_BUILD_COMMIT"] == build_commit(recipe["series"])
    assert n_repo != len(recipe["series"])  # so the comparison below is not vacuous for it
    eff["recipe/build.sh"]["LLAMA_BUILD_COMMIT"] = eff["rollkv build"]["LLAMA_BUILD_COMMIT"]
    assert eff["rollkv build"] == eff["recipe/build.sh"] == eff["package.nix"]
    assert eff["rollkv build"]["GGML_CUDA"] == ("ON" if variant == "cuda" else "OFF")

    # no consumer restates a value of the initial cache (-D only for what it owns)
    cache = initial_cache()
    for who, (_, defs) in parsed.items():
        restated = {k for k in defs if k in cache and k not in ("GGML_CUDA", "CMAKE_CUDA_ARCHITECTURES")}
        assert not restated, (who, restated)

    # CUDA architectures: the initial cache's list unless the consumer computes its own
    if variant == "cuda":
        assert parsed["rollkv build"][1]["CMAKE_CUDA_ARCHITECTURES"] == "90-real"  # --cuda-arch
        assert "CMAKE_CUDA_ARCHITECTURES" not in parsed["recipe/build.sh"][1]  # rollkv.cmake's
        assert parsed["package.nix"][1]["CMAKE_CUDA_ARCHITECTURES"] == "75;80;86;89;90;100;120"


def test_three_consumers_build_and_install_the_same_way(tmp_path, flake_outputs):
    tool = tool_lines(tmp_path / "tool", "cpu")
    recipe = recipe_lines(tmp_path / "recipe", "cpu")
    assert tool["build"][-4:-2] == ["--target", PROGRAMS_TARGET]
    assert recipe["build"][3:5] == ["--target", PROGRAMS_TARGET]
    assert flake_outputs["cpu"]["ninjaFlags"] == [PROGRAMS_TARGET]
    assert tool["install"][-2:] == ["-P", str(INSTALL_SCRIPT)]
    assert recipe["install"][-1].endswith("rollkv-tool/rollkv_dist/cmake/rollkv-install.cmake")
    assert re.search(r"-P /nix/store/\S+-rollkv-tool/rollkv_dist/cmake/rollkv-install\.cmake",
                     flake_outputs["cpu"]["installPhase"])


def test_cuda_architecture_list_lives_in_the_initial_cache_only():
    archs = initial_cache()["CMAKE_CUDA_ARCHITECTURES"]
    for rel in ("recipe/build.sh", "recipe/meta.yaml", "rollkv_dist/channel.py",
                "package.nix", "flake.nix", "rollkv_dist/build.py", "noxfile.py"):
        text = (ROOT / rel).read_text()
        assert archs not in text and "86-real" not in text, rel
