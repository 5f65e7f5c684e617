"""Platform detection for builds: tools, compilers, CUDA, GPUs (via NVML), optional libraries.

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
from typing import Any

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


# --------------------------------------------------------------------------- GPUs via NVML


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    compute_capability: tuple[int, int]

    @property
    def cuda_arch(self) -> str:
        major, minor = self.compute_capability
        return f"{major}{minor}-real"


@dataclass(frozen=True)
class GpuScan:
    gpus: tuple[GpuInfo, ...]
    reason: str = ""
    """Why no GPU was found (NVML's own message), empty when GPUs were found."""

    @property
    def cuda_archs(self) -> tuple[str, ...]:
        archs = {g.cuda_arch for g in self.gpus}
        return tuple(sorted(archs, key=lambda a: int(a.split("-")[0])))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def scan_gpus(nvml: Any = None) -> GpuScan:
    """Ask NVML (the `pynvml` module of nvidia-ml-py, or a stand-in) for the GPUs present."""
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[import-not-found,no-redef]
        except ImportError as exc:
            return GpuScan((), f"nvidia-ml-py is not installed ({exc})")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError and friends: keep NVML's words
        return GpuScan((), f"NVML could not start: {exc}")
    try:
        n = nvml.nvmlDeviceGetCount()
        gpus = []
        for i in range(n):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            gpus.append(GpuInfo(i, _text(nvml.nvmlDeviceGetName(h)),
                                _text(nvml.nvmlDeviceGetUUID(h)), (int(major), int(minor))))
    except Exception as exc:
        return GpuScan((), f"NVML query failed: {exc}")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    if not gpus:
        return GpuScan((), "NVML reports 0 GPUs")
    return GpuScan(tuple(gpus))
