"""flake.nix parses and its outputs evaluate (Nix 2.8, offline) and agree with the pin and the series.

A real `nix build` needs nixpkgs' sources or the binary cache; here the flake's
`outputs` function is called with a stand-in for nixpkgs (tests/nixpkgs-stub:
derivations are attribute sets that keep their arguments) and
tests/nixpkgs-stub/eval-flake.nix returns plain data about the outputs.
nix-instantiate comes from Debian's nix-bin, which CI installs (`.ci/run`); the test session never
installs anything. Without it the tests that evaluate the flake skip, saying why (`nox -s tests`
prints skip reasons in its summary).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rollkv_dist.pin import PIN
from rollkv_dist.series import package_version, read_series

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "nixpkgs-stub"
SYSTEM = "x86_64-linux"




NO_NIX = ("nix-instantiate not found, flake.nix not evaluated: install Nix (on Debian/Ubuntu: "
          "`apt-get install nix-bin` as root; CI's .ci/run does that)")


def _nix_instantiate() -> str:
    exe = shutil.which("nix-instantiate")
    if exe is None:
        pytest.skip(NO_NIX)
    return exe


def _nix(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NIX_CONFIG": "experimental-features = nix-command flakes"}
    return subprocess.run([_nix_instantiate(), *args], capture_output=True, text=True, env=env, timeout=120)


def evaluate(repo: Path, tmp_path: Path) -> dict:
    proc = _nix(["--eval", "--strict", "--json", "--readonly-mode", str(STUB / "eval-flake.nix"),
                 "--arg", "repo", str(repo.resolve()), "--argstr", "system", SYSTEM], tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def copy_flake(dest: Path) -> Path:
    """The files flake.nix and package.nix read, in a scratch checkout."""
    for rel in ("flake.nix", "package.nix", "recipe/run_test.sh"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, dest / rel)
    for rel in ("patches", "nix", "rollkv_dist"):
        shutil.copytree(ROOT / rel, dest / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return evaluate(ROOT, tmp_path_factory.mktemp("nix-home"))


def _flags(pkg: dict) -> dict[str, str]:
    """-D flags of cmakeFlags (the -C initial cache aside)."""
    out = {}
    for f in pkg["cmakeFlags"]:
        if f.startswith("-C"):
            continue
        m = re.fullmatch(r"-D([A-Za-z0-9_]+):(BOOL|STRING)=(.*)", f)
        assert m, f
        out[m.group(1)] = m.group(3)
    return out


def test_flake_parses(tmp_path):
    proc = _nix(["--parse", str(ROOT / "flake.nix")], tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_nixpkgs_pinned_by_revision_and_locked():
    text = (ROOT / "flake.nix").read_text()
    m = re.search(r'inputs\.nixpkgs\.url = "github:NixOS/nixpkgs/([0-9a-f]{40})";', text)
    assert m, "nixpkgs must be pinned to a full commit"
    lock = json.loads((ROOT / "flake.lock").read_text())
    locked = lock["nodes"][lock["nodes"]["root"]["inputs"]["nixpkgs"]]["locked"]
    assert locked["rev"] == m.group(1)
    assert (locked["type"], locked["owner"], locked["repo"]) == ("github", "NixOS", "nixpkgs")
    assert re.fullmatch(r"sha256-[A-Za-z0-9+/]{43}=", locked["narHash"])


def test_outputs_cover_the_interface(outputs):
    assert outputs["systems"] == ["aarch64-linux", "x86_64-linux"]
    assert set(outputs["packageNames"]) == {"default", "cpu", "cuda", "rollkv", "gates", "server",
                                            "server-cpu", "llama-tree"}
    assert outputs["default"] == outputs["cuda"]
    assert outputs["checks"] == ["cpu", "recipe-test"]
    assert outputs["cpuCheckOutPath"] == outputs["cpu"]["storePath"]


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_packages_follow_the_pin_and_series(outputs, variant):
    pkg = outputs[variant]
    series = read_series(ROOT / "patches")
    assert pkg["version"] == package_version(len(series))  # the conda package's version, one for every artifact
    assert pkg["src"] == {"pname": PIN.sdist_root.rsplit("-", 1)[0], "version": PIN.version, "hash": PIN.sri}
    assert f"{pkg['src']['pname']}-{PIN.version}.tar.gz" == PIN.sdist_filename
    assert pkg["sourceRoot"] == f"{PIN.sdist_root}/{PIN.tree}"
    assert pkg["patches"] == series
    assert pkg["passthru"]["seriesNames"] == series
    assert pkg["passthru"]["pin"]["llamaCommit"] == PIN.llama_commit
    assert pkg["meta"]["mainProgram"] == "llama-server"
    assert pkg["meta"]["license"] == "MIT"
    # the one build definition: initial cache, target, install rule (tests/test_build_definition.py
    # compares the configure line with the other two consumers)
    assert re.fullmatch(r"-C/nix/store/\S+-rollkv-tool/rollkv_dist/cmake/rollkv\.cmake", pkg["cmakeFlags"][0])
    assert pkg["ninjaFlags"] == ["rollkv-programs"]
    assert re.search(r"cmake -DROLLKV_BUILD_DIR=\. -DCMAKE_INSTALL_PREFIX=\$out -P "
                     r"/nix/store/\S+-rollkv-tool/rollkv_dist/cmake/rollkv-install\.cmake\n", pkg["installPhase"])
    flags = _flags(pkg)
    assert flags["LLAMA_BUILD_COMMIT"] == f"{PIN.llama_commit}+rollkv.{len(series)}"
    assert pkg["passthru"]["buildCommit"] == flags["LLAMA_BUILD_COMMIT"]
    assert re.search(r"PYTHONPATH=\S+-rollkv-tool python3 -m rollkv_dist\.series verify \. \S+-patches\n",
                     pkg["postPatch"])
    assert re.search(r"rollkv_dist\.series record \S+-patches \$out ", pkg["postInstall"])
    assert f"build_commit={flags['LLAMA_BUILD_COMMIT']}" in pkg["postInstall"]
    assert f" version={package_version(len(series))} " in pkg["postInstall"]


def test_cuda_package(outputs):
    pkg = outputs["cuda"]
    assert pkg["pname"] == "rollkv-llamafile-cuda"
    assert pkg["passthru"]["cudaSupport"] is True
    assert pkg["stdenvName"] == "cudaPackages.backendStdenv"
    assert {"cuda_nvcc", "auto-add-driver-runpath-hook", "cmake", "ninja"} <= set(pkg["nativeBuildInputs"])
    assert {"cuda_cudart", "libcublas"} <= set(pkg["buildInputs"])
    flags = _flags(pkg)
    assert flags["GGML_CUDA"] == "TRUE"
    assert flags["CMAKE_CUDA_ARCHITECTURES"] == "75;80;86;89;90;100;120"  # the stub's cudaCapabilities
    assert "cuda=12.9" in pkg["postInstall"]  # the stub's cudaMajorMinorVersion


def test_cpu_package(outputs):
    pkg = outputs["cpu"]
    assert pkg["pname"] == "rollkv-llamafile"
    assert pkg["passthru"]["cudaSupport"] is False
    assert pkg["stdenvName"] == "stdenv"
    assert not any("cuda" in n or "driver" in n for n in pkg["nativeBuildInputs"] + pkg["buildInputs"])
    flags = _flags(pkg)
    assert flags["GGML_CUDA"] == "FALSE"
    assert "CMAKE_CUDA_ARCHITECTURES" not in flags
    assert "cuda=None" in pkg["postInstall"]


def test_package_nix_is_callpackage_able(outputs):
    """overlays.default follows the package set's config.cudaSupport; .override switches it."""
    assert outputs["overlay"]["pname"] == "rollkv-llamafile"
    assert outputs["overlay"]["passthru"]["cudaSupport"] is False
    assert outputs["overlayCuda"]["pname"] == "rollkv-llamafile-cuda"
    assert outputs["overlayCuda"]["stdenvName"] == "cudaPackages.backendStdenv"
    over = outputs["overridden"]
    assert over["pname"] == "rollkv-llamafile-cuda" and _flags(over)["GGML_CUDA"] == "TRUE"
    assert over["cmakeFlags"] == outputs["overlayCuda"]["cmakeFlags"]


def test_apps(outputs):
    apps = outputs["apps"]
    assert set(apps) == {"default", "cpu", "gates"}
    assert all(a["type"] == "app" for a in apps.values())
    # nix run starts the launcher (host driver outside NixOS, usage without a model)
    assert apps["default"]["program"] == outputs["server"]["storePath"] + "/bin/rollkv-llama-server"
    assert apps["cpu"]["program"] == outputs["serverCpu"]["storePath"] + "/bin/rollkv-llama-server"
    assert apps["default"]["program"] != apps["cpu"]["program"]
    launcher = (ROOT / "nix" / "launcher.sh").read_text()
    for app, pkg, cuda in (("server", "cuda", "1"), ("serverCpu", "cpu", "0")):
        text = outputs[app]["text"]
        assert text.startswith(f"ROLLKV_PROGRAM={outputs[pkg]['storePath']}/bin/llama-server\n"
                               f"ROLLKV_CUDA={cuda}\n")
        assert text.endswith(launcher)
    assert apps["gates"]["program"].endswith("-rollkv-gates/bin/rollkv-gates")
    # the gates get the build and the tree it was built from (gguf-py, the qwen2 vocab)
    assert outputs["llamaTree"]["srcOnlyOf"] == outputs["cuda"]["storePath"]
    assert outputs["gates"]["text"] == (f'exec rollkv gates --build {outputs["cuda"]["storePath"]} '
                                        f'--llama-tree {outputs["llamaTree"]["storePath"]} "$@"')
    assert outputs["gates"]["runtimeOutPaths"] == [outputs["rollkvOutPath"]]
    rollkv = outputs["rollkv"]
    assert outputs["cuda"]["storePath"] in rollkv["runtimeOutPaths"]
    assert "exec python3 -m rollkv_dist" in rollkv["text"]


def test_dev_shell_and_checks(outputs):
    shell = outputs["devShell"]
    assert shell["inputsFrom"] == [outputs["cuda"]["storePath"]]
    for p in ("pytest", "nox", "nvidia-ml-py", "requests", "numpy", "matplotlib"):
        assert f"python3.12-{p}" in shell["pythonPackages"]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in shell["shellHook"]
    script = outputs["recipeTestScript"]
    assert script.startswith(f"PREFIX={outputs['cpu']['storePath']} bash /nix/store/")
    assert "-run_test.sh\n" in script


def test_patch_list_follows_series_file(tmp_path):
    repo = copy_flake(tmp_path / "repo")
    names = ["0001-kv-residency-flags.patch", "0003-position-window.patch",
             "0089-rolling-kv-compute-reserve.patch"]
    for n in names:
        (repo / "patches" / n).write_text(f"patch {n}\n")
    (repo / "patches" / "series").write_text(
        "# rolling KV\n" + names[0] + "\n\n" + names[1] + "   # the window\n" + names[2] + "\n")
    out = evaluate(repo, tmp_path)
    for variant in ("cpu", "cuda"):
        assert out[variant]["patches"] == names
        assert _flags(out[variant])["LLAMA_BUILD_COMMIT"] == f"{PIN.llama_commit}+rollkv.3"
        assert out[variant]["postInstall"].count(" record ") == 1


def test_flake_reads_the_pin_file(tmp_path):
    repo = copy_flake(tmp_path / "repo")
    pin = repo / "rollkv_dist" / "pin.toml"
    other_sri = "sha256-" + "A" * 43 + "="
    pin.write_text(pin.read_text().replace(PIN.sri, other_sri)
                   .replace(f'version = "{PIN.version}"', 'version = "9.9.9"'))
    out = evaluate(repo, tmp_path)
    assert out["cuda"]["src"] == {"pname": "llama_cpp_python", "version": "9.9.9", "hash": other_sri}
    assert out["cuda"]["sourceRoot"] == f"llama_cpp_python-9.9.9/{PIN.tree}"


def test_a_pin_without_a_field_is_an_evaluation_error(tmp_path):
    repo = copy_flake(tmp_path / "repo")
    pin = repo / "rollkv_dist" / "pin.toml"
    pin.write_text("\n".join(ln for ln in pin.read_text().splitlines() if not ln.startswith("sri ")) + "\n")
    proc = _nix(["--eval", "--strict", "--json", "--readonly-mode", str(STUB / "eval-flake.nix"),
                 "--arg", "repo", str(repo), "--argstr", "system", SYSTEM], tmp_path)
    assert proc.returncode != 0
    assert "rollkv_dist/pin.toml: expected a string sri" in proc.stderr, proc.stderr[-2000:]
