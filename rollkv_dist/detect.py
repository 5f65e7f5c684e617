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
from pathlib import Path

from rollkv_dist import proc


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
