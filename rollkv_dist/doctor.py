"""`rollkv doctor`: what this machine offers for building and running rolling KV.

GPUs (by UUID) with memory, compute capability and PCIe link, the driver, the build tools,
the locked-memory limit and host memory. Works without any GPU or NVML: it then says
"no NVIDIA GPU found: <NVML reason>".
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from typing import Any
from collections.abc import Callable

from rollkv_dist import gpu as gpu_mod
from rollkv_dist import proc

MiB = 1024 * 1024

MEMLOCK_NOTE = (
    "window mode keeps the host tail of the KV cache in pinned (page-locked) host memory; "
    "a low locked-memory limit can make large pinned allocations or --mlock fail, so "
    "'unlimited' (ulimit -l unlimited, or LimitMEMLOCK=infinity / --ulimit memlock=-1 in "
    "containers) is the safe setting"
)


def tool_version(cmd: list[str], pattern: str | None = None,
                 run: Callable[..., Any] = proc.run) -> str | None:
    """First useful line of `cmd` (or the `pattern` match); None when the tool is missing."""
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        p = run([exe, *cmd[1:]], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (p.stdout or "") + (p.stderr or "")
    if pattern:
        m = re.search(pattern, text)
        if m:
            return m.group(1)
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return None


def _fmt_limit(v: int) -> str:
    if v == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{v // 1024} KiB"


def memlock() -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {
        "soft": None if soft == resource.RLIM_INFINITY else soft,
        "hard": None if hard == resource.RLIM_INFINITY else hard,
        "soft_str": _fmt_limit(soft),
        "hard_str": _fmt_limit(hard),
        "unlimited": soft == resource.RLIM_INFINITY,
        "note": MEMLOCK_NOTE,
    }


def host_memory(path: str = "/proc/meminfo") -> dict[str, int | None]:
    out: dict[str, int | None] = {"total_mib": None, "available_mib": None}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k == "MemTotal":
                    out["total_mib"] = int(v.split()[0]) // 1024
                elif k == "MemAvailable":
                    out["available_mib"] = int(v.split()[0]) // 1024
    except OSError:
        pass
    return out


def collect(probe: gpu_mod.GPUProbe | None = None) -> dict[str, Any]:
    p = gpu_mod.probe() if probe is None else probe
    cc = os.environ.get("CC", "cc")
    cxx = os.environ.get("CXX", "c++")
    tools = {
        "nvcc": tool_version(["nvcc", "--version"], r"(release [^\n]+)"),
        "cmake": tool_version(["cmake", "--version"], r"cmake version (\S+)"),
        "ninja": tool_version(["ninja", "--version"]),
        "cc": tool_version([cc, "--version"]),
        "c++": tool_version([cxx, "--version"]),
    }
    return {
        "gpu": p.to_json(),
        "tools": tools,
        "memlock": memlock(),
        "host_memory": host_memory(),
        "python": sys.version.split()[0],
    }


def render(d: dict[str, Any]) -> str:
    lines = []
    g = d["gpu"]
    if not g["gpus"]:
        lines.append(f"no NVIDIA GPU found: {g['reason']}")
    else:
        lines.append(f"driver {g['driver_version'] or '?'}, CUDA driver API {g['cuda_driver_version'] or '?'}")
        for x in g["gpus"]:
            info = gpu_mod.GPUInfo(**{k: x[k] for k in (
                "index", "uuid", "name", "memory_total", "memory_free", "pci_bus_id",
                "pcie_gen_current", "pcie_width_current", "pcie_gen_max", "pcie_width_max")},
                compute_capability=None)
            lines.append(
                f"GPU {x['index']} {x['uuid']}: {x['name']}, {x['memory_total_mib']} MiB "
                f"({x['memory_free_mib']} MiB free), cc {x['compute_capability']}, "
                f"PCIe {info.pcie_str()}"
            )
    for name, v in d["tools"].items():
        lines.append(f"{name}: {v or 'not found'}")
    m = d["memlock"]
    lines.append(f"locked-memory limit (RLIMIT_MEMLOCK): soft {m['soft_str']}, hard {m['hard_str']}")
    if not m["unlimited"]:
        lines.append(f"  note: {m['note']}")
    h = d["host_memory"]
    if h["total_mib"] is not None:
        lines.append(f"host memory: {h['total_mib']} MiB total, {h['available_mib']} MiB available "
                     "(the host tail lives here)")
    return "\n".join(lines)


def run(args: Any) -> int:
    d = collect()
    if getattr(args, "json", False):
        print(json.dumps(d, indent=2))
    else:
        print(render(d))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("doctor", help="report GPUs, driver, build tools and limits",
                              description=__doc__)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)
