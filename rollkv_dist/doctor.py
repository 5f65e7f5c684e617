"""`rollkv doctor`: what this machine offers for building and running rolling KV.

GPUs (by UUID) with memory, compute capability and PCIe link, the driver, the build tools,
the locked-memory limit and host memory. Works without any GPU or NVML: it then says
"no NVIDIA GPU found: <NVML reason>".

Host tails: for the gates' models (the random shapes at their longest context: Qwen2-1.5B at
131072 cells, the Qwen2.5-14B-1M shape at 1048576) and for `--model GGUF --ctx N`, the KV size
and the smallest host tail it can have on each GPU (the KV less what the GPU could hold beside
the weights, its free memory less the weights; the engine also keeps a compute reserve, so the
real tail is larger), against the host memory available now. The engine pins the tail as cells
come into use (patch 0101), so a tail larger than the host still boots: the doctor then says about
how many cells a prompt can reach before a request fails for host memory (the GPU's cells and what
the available memory holds).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from rollkv_dist.commands import add_command
from rollkv_dist import gpu as gpu_mod
from rollkv_dist import proc

MiB = 1024 * 1024

MEMLOCK_NOTE = (
    "window mode keeps the host tail of the KV cache in pinned (page-locked) host memory, which the "
    "CUDA driver pins itself: on an H200 host a 26880 MiB tail pinned under `ulimit -l 1024` as an "
    "unprivileged user (reports/2026-12-01-h200-c); --mlock counts against the limit, and other "
    "drivers or kernels may, so 'unlimited' (ulimit -l unlimited, or LimitMEMLOCK=infinity / "
    "--ulimit memlock=-1 in containers) is the safe setting"
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


# the gates' models at the longest context they run (boot-beyond runs the 14B-1M shape at 1048576)
TAIL_CASES = (("qwen2-1.5b", 131072), ("qwen2.5-14b-1m", 1048576))
KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32}


@dataclass(frozen=True)
class TailCase:
    """A model and a context whose host tail the doctor sizes."""

    name: str
    n_ctx: int
    kv_bytes_per_cell: float  # K+V over all layers at f16
    weights_bytes: int

    def kv_bytes(self, kv_type: str = "f16") -> int:
        return int(self.n_ctx * self.kv_bytes_per_cell * KV_TYPE_BYTES[kv_type] / 2.0)

    def min_tail_bytes(self, gpu_free_bytes: int, kv_type: str = "f16") -> int:
        return max(0, self.kv_bytes(kv_type) - max(0, gpu_free_bytes - self.weights_bytes))

    def cells_within(self, gpu_free_bytes: int, host_bytes: int, kv_type: str = "f16") -> int:
        """The cells a prompt can fill before its tail needs more than host_bytes (at most n_ctx)."""
        per_cell = self.kv_bytes_per_cell * KV_TYPE_BYTES[kv_type] / 2.0
        return min(self.n_ctx, int((max(0, gpu_free_bytes - self.weights_bytes) + host_bytes) / per_cell))


def shape_case(shape_name: str, n_ctx: int) -> TailCase:
    """A random model shape of the gates, Q8_0 weights (as `rollkv model random` writes them)."""
    from rollkv_dist.models import SHAPES, tensor_plan

    shape = SHAPES[shape_name]
    weights = 0
    for _name, dims, kind in tensor_plan(shape, shape.n_vocab or 151936):
        n = 1
        for d in dims:
            n *= d
        weights += n * 4 if kind in ("norm", "bias") else n * 34 // 32
    return TailCase(shape_name, n_ctx, shape.kv_bytes_per_cell(), weights)


def gguf_case(path: str, n_ctx: int) -> TailCase:
    """A GGUF model's KV per cell from its header (layers, KV heads, head sizes), weights = file size."""
    from rollkv_dist.errors import UsageError
    from rollkv_dist.models import read_kv

    kv = {k: v for k, v, _t, _s in read_kv(path)}
    arch = kv.get("general.architecture")
    try:
        n_layer = int(kv[f"{arch}.block_count"])
        n_head = int(kv[f"{arch}.attention.head_count"])
        n_embd = int(kv[f"{arch}.embedding_length"])
    except KeyError as e:
        raise UsageError(f"{path}: no {e.args[0]} in its header: cannot size its KV cache") from None
    head_kv = kv.get(f"{arch}.attention.head_count_kv", n_head)
    head_kv = max(head_kv) if isinstance(head_kv, list) else int(head_kv)
    k_len = int(kv.get(f"{arch}.attention.key_length", n_embd // n_head))
    v_len = int(kv.get(f"{arch}.attention.value_length", n_embd // n_head))
    return TailCase(os.path.basename(path), n_ctx, 2.0 * n_layer * head_kv * (k_len + v_len),  # f16 bytes
                    os.path.getsize(path))


def host_tails(cases: list[TailCase], gpus: list[dict[str, Any]], available_mib: int | None,
               memlock_soft: int | None) -> list[dict[str, Any]]:
    """Per case, KV type and GPU: the KV, the smallest host tail, and whether host memory holds it."""
    rows = []
    for c in cases:
        for kv_type in KV_TYPE_BYTES:
            for g in gpus:
                tail = c.min_tail_bytes(g["memory_free_mib"] * MiB, kv_type)
                rows.append({
                    "model": c.name, "n_ctx": c.n_ctx, "kv_type": kv_type, "gpu": g["index"],
                    "kv_mib": c.kv_bytes(kv_type) // MiB, "min_tail_mib": tail // MiB,
                    "host_available_mib": available_mib,
                    "fits_host": None if available_mib is None else tail // MiB <= available_mib,
                    "cells_within_host": None if available_mib is None else c.cells_within(
                        g["memory_free_mib"] * MiB, available_mib * MiB, kv_type),
                    "within_memlock": None if memlock_soft is None else tail <= memlock_soft,
                })
    return rows


def collect(probe: gpu_mod.GPUProbe | None = None, extra_cases: list[TailCase] | None = None) -> dict[str, Any]:
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
    gpu_json, lock, hm = p.to_json(), memlock(), host_memory()
    cases = [shape_case(n, c) for n, c in TAIL_CASES] + list(extra_cases or [])
    return {
        "gpu": gpu_json,
        "tools": tools,
        "memlock": lock,
        "host_memory": hm,
        "host_tails": host_tails(cases, gpu_json["gpus"], hm["available_mib"], lock["soft"]),
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
    for t in d.get("host_tails", []):
        verdict = ("?" if t["fits_host"] is None else "fits host memory" if t["fits_host"]
                   else f"boots (pinned as cells come into use); a prompt past about {t['cells_within_host']} cells "
                        f"fails for host memory (the whole context NEEDS "
                        f"{t['min_tail_mib'] - t['host_available_mib']} MiB MORE HOST MEMORY)")
        if t["within_memlock"] is False:
            verdict += ", above the locked-memory limit"
        lines.append(f"host tail: {t['model']} -c {t['n_ctx']} {t['kv_type']} KV ({t['kv_mib']} MiB) on GPU "
                     f"{t['gpu']}: at least {t['min_tail_mib']} MiB -> {verdict}")
    return "\n".join(lines)


def run(args: Any) -> int:
    from rollkv_dist.errors import UsageError

    model, n_ctx = getattr(args, "model", None), getattr(args, "ctx", None)
    if (model is None) != (n_ctx is None):
        raise UsageError("--model and --ctx go together: the host tail of MODEL at context N")
    if n_ctx is not None and n_ctx <= 0:
        raise UsageError(f"--ctx {n_ctx}: give a context of at least 1 cell")
    if model is not None and not os.path.isfile(model):
        raise UsageError(f"--model {model}: no such file")
    d = collect(extra_cases=[gguf_case(model, n_ctx)] if model else None)
    if getattr(args, "json", False):
        print(json.dumps(d, indent=2))
    else:
        print(render(d))
    return 0


def register(subparsers: Any) -> None:
    p = add_command(subparsers, "doctor", "report GPUs, driver, build tools and limits", __doc__, run)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--model", metavar="GGUF", help="also size the host tail of this model ...")
    p.add_argument("--ctx", type=int, metavar="N", help="... at this context (cells)")
