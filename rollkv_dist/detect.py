"""Platform detection for builds: tools, compilers, CUDA (GPUs: rollkv_dist.gpu, the one probe).

Detection only reads the machine; it never builds anything. The build module turns what is
found here plus the user's options into frozen BuildSettings.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rollkv_dist import log, proc
from rollkv_dist.errors import BuildError, UsageError


def _first_line(cmd: list[str]) -> str | None:
    try:
        out = proc.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if out.returncode == 0 and text else None


def find_ninja(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    found = shutil.which("ninja", path=env.get("PATH"))
    if found:
        return found
    try:  # the `ninja` package from PyPI, when installed without its script on PATH
        import ninja  # type: ignore[import-not-found]

        cand = Path(ninja.BIN_DIR) / "ninja"
        if cand.is_file():
            return str(cand)
    except (ImportError, AttributeError):
        pass
    return None


def cmake_version(cmake: str) -> tuple[int, ...] | None:
    line = _first_line([cmake, "--version"])
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", line or "")
    return tuple(int(x) for x in m.groups() if x is not None) if m else None


def compiler_version(cmd: str) -> str | None:
    return _first_line([cmd, "--version"])


def find_nvcc(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    if env.get("CUDACXX") and Path(env["CUDACXX"]).is_file():
        return env["CUDACXX"]
    found = shutil.which("nvcc", path=env.get("PATH"))
    if found:
        return found
    for root in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def nvcc_version(nvcc: str) -> str | None:
    try:
        out = proc.run([nvcc, "--version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release ([\d.]+), V([\d.]+)", out.stdout)
    return m.group(2) if m else None


# --------------------------------------------------------------------------- variants: one vocabulary

@dataclass(frozen=True)
class Variant:
    """A build variant by its one name, the same for `rollkv build`, `rollkv channel`, nox and the conda build
    string: `cpu`, or `cuda` + the toolkit's major and minor version (`cuda130` for CUDA 13.0); `cuda` alone
    where a toolkit's version cannot be read."""

    name: str
    cuda_version: str | None = None  # "13.0"; None for cpu

    @property
    def kind(self) -> str:
        """cpu or cuda: what the build definition switches on (GGML_CUDA)."""
        return "cpu" if self.name == "cpu" else "cuda"

    def conda_config(self) -> dict[str, str]:
        """The conda-build variant keys of this variant (conda-forge's names)."""
        if self.kind == "cpu":
            return {"cuda_compiler_version": "None"}
        return {"cuda_compiler_version": self.cuda_version or "None", "cuda_compiler": "cuda-nvcc"}


CPU = Variant("cpu")


def cuda_variant(version: str | None) -> Variant:
    return Variant("cuda" + version.replace(".", ""), version) if version else Variant("cuda")


def toolkit_cuda_version(nvcc: str) -> str | None:
    """MAJOR.MINOR of the toolkit's nvcc ("13.0.88" -> "13.0")."""
    m = re.match(r"(\d+)\.(\d+)", nvcc_version(nvcc) or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def has_cublas(nvcc: str) -> bool:
    """cuBLAS headers next to the toolkit's nvcc (ggml-cuda needs cuBLAS)."""
    root = Path(nvcc).resolve().parent.parent
    return any((d / "cublas_v2.h").is_file()
               for d in (root / "include", *root.glob("targets/*/include"), Path("/usr/include")))


def machine_variants(env: Mapping[str, str] | None = None, need_cublas: bool = False) -> list[Variant]:
    """CPU always; the CUDA variant of the nvcc found (PATH, $CUDACXX, /usr/local/cuda). need_cublas (a build
    against the machine's toolkit): only when the toolkit has cuBLAS too."""
    nvcc = find_nvcc(os.environ if env is None else env)
    version = toolkit_cuda_version(nvcc) if nvcc else None
    if version and need_cublas and not has_cublas(nvcc):
        log.info(f"CUDA {version}: nvcc found ({nvcc}) but no cuBLAS headers next to it: "
                 f"the {cuda_variant(version).name} variant cannot be built against this toolkit")
        return [CPU]
    return [CPU, cuda_variant(version)] if version else [CPU]


def resolve_variant(name: str, env: Mapping[str, str] | None = None) -> tuple[Variant, str | None]:
    """(variant, nvcc) for a variant name: `cpu`; `cuda`, the variant of the toolkit found; `cudaNNN`, which
    must be that toolkit's. A name of neither form is a UsageError, a CUDA variant without nvcc a BuildError."""
    if name == "cpu":
        return CPU, None
    if not re.fullmatch(r"cuda(\d{2,4})?", name):
        raise UsageError(f"--variant {name!r}: choose cpu, cuda (the toolkit found) or cuda<MAJOR><MINOR> "
                         f"(e.g. cuda130)")
    nvcc = find_nvcc(os.environ if env is None else env)
    if not nvcc:
        raise BuildError(f"--variant {name} needs the CUDA toolkit's nvcc, which was not found on PATH, $CUDACXX "
                         "or /usr/local/cuda: install the CUDA toolkit or use --variant cpu")
    found = cuda_variant(toolkit_cuda_version(nvcc))
    if name != "cuda" and name != found.name:
        raise UsageError(f"--variant {name}: this machine's nvcc ({nvcc}) builds {found.name}; use --variant "
                         f"{found.name} (or cuda)")
    return found, nvcc
