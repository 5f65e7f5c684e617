"""NVIDIA GPU detection through NVML (`pynvml`, from the nvidia-ml-py package).

`probe()` never raises: when no GPU can be used it returns a `GPUProbe` with no GPUs
and `reason` set to what NVML said (library missing, driver not loaded, zero devices).
GPUs are keyed by UUID; children get `CUDA_DEVICE_ORDER=PCI_BUS_ID` and
`CUDA_VISIBLE_DEVICES=<UUID>` so that the chosen GPU is CUDA0 in the child.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable

from rollkv_dist.errors import NoGPUError, UsageError

MiB = 1024 * 1024
# usable GB/s per lane and direction of each PCIe generation (line rate after encoding: 8b/10b up to
# gen2, 128b/130b for gen3-5, gen6's FLITs)
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@dataclass
class GPUInfo:
    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    memory_free: int  # bytes
    compute_capability: tuple[int, int] | None
    pci_bus_id: str | None = None
    pcie_gen_current: int | None = None
    pcie_width_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None

    @property
    def short_name(self) -> str:
        """Name usable in ids and paths: 'NVIDIA H200' -> 'H200'."""
        name = re.sub(r"^(NVIDIA|Tesla)\s+", "", self.name.strip())
        return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "GPU"

    @property
    def cc_str(self) -> str:
        return "?" if self.compute_capability is None else "{}.{}".format(*self.compute_capability)

    @property
    def cuda_arch(self) -> str | None:
        """CMAKE_CUDA_ARCHITECTURES entry, e.g. '90-real'."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability
        return f"{major}{minor}-real"

    @property
    def pcie_gbps(self) -> float | None:
        """Nominal GB/s per direction of the GPU's PCIe link at its maximum (an idle link reports a
        lower current generation), from NVML's generation and width; None when NVML does not say."""
        gen = self.pcie_gen_max or self.pcie_gen_current
        width = self.pcie_width_max or self.pcie_width_current
        if gen not in PCIE_LANE_GBPS or not width:
            return None
        return round(PCIE_LANE_GBPS[gen] * width, 1)

    def pcie_str(self) -> str:
        def link(gen: int | None, width: int | None) -> str:
            return "?" if gen is None or width is None else f"gen{gen} x{width}"

        return (
            f"{link(self.pcie_gen_current, self.pcie_width_current)} "
            f"(max {link(self.pcie_gen_max, self.pcie_width_max)})"
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = self.cc_str
        d["memory_total_mib"] = self.memory_total // MiB
        d["memory_free_mib"] = self.memory_free // MiB
        return d


@dataclass
class GPUProbe:
    gpus: list[GPUInfo] = field(default_factory=list)
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # e.g. "13.0"
    reason: str | None = None  # why there are no GPUs (NVML's words)

    @property
    def ok(self) -> bool:
        return bool(self.gpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": [g.to_json() for g in self.gpus],
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "reason": self.reason,
        }

    @property
    def cuda_archs(self) -> tuple[str, ...]:
        """CMAKE_CUDA_ARCHITECTURES entries of the GPUs found, ascending ('89-real', '90-real');
        empty without GPUs."""
        archs = {g.cuda_arch for g in self.gpus if g.cuda_arch}
        return tuple(sorted(archs, key=lambda a: int(a.split("-")[0])))

    def require(self) -> list[GPUInfo]:
        if not self.gpus:
            raise NoGPUError(f"no NVIDIA GPU found: {self.reason}")
        return self.gpus

    def select(self, spec: str | int | None) -> list[GPUInfo]:
        """GPUs for `--gpu INDEX|UUID|all` (None = the first GPU)."""
        gpus = self.require()
        if spec is None:
            return [gpus[0]]
        spec = str(spec).strip()
        if spec == "all":
            return list(gpus)
        out = []
        for part in spec.split(","):
            part = part.strip()
            match = [g for g in gpus if (part.isdigit() and g.index == int(part)) or g.uuid == part
                     or (part.startswith("GPU-") and g.uuid.startswith(part))]
            if not match:
                known = ", ".join(f"{g.index}={g.uuid}" for g in gpus)
                raise UsageError(f"--gpu {part}: no such GPU (have {known}); pass an index, a UUID or 'all'")
            out.extend(m for m in match if m not in out)
        return out


def _decode(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # NVMLError_NotSupported and friends: field unknown, not fatal
        return None


def _load_nvml() -> Any:
    import pynvml  # noqa: PLC0415  (optional dependency)

    return pynvml


def probe(nvml: Any = None) -> GPUProbe:
    """The GPU probe of the whole package: NVML through pynvml, else (pynvml itself missing, e.g.
    nox's own environment) nvidia-smi, which asks the same NVML. `nvml` replaces the pynvml module
    (tests)."""
    if nvml is None:
        try:
            nvml = _load_nvml()
        except ImportError:
            return _without_pynvml()
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return GPUProbe(reason=f"NVML init failed: {_nvml_msg(e)}")
    try:
        driver = _try(lambda: _decode(nvml.nvmlSystemGetDriverVersion()))
        cuda_v = _try(lambda: nvml.nvmlSystemGetCudaDriverVersion())
        cuda = None if cuda_v is None else f"{cuda_v // 1000}.{(cuda_v % 1000) // 10}"
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as e:
            return GPUProbe(driver_version=driver, cuda_driver_version=cuda,
                            reason=f"NVML could not count devices: {_nvml_msg(e)}")
        try:
            gpus = [_device(nvml, i) for i in range(count)]
        except Exception as e:  # a device NVML counted but cannot describe
            return GPUProbe(driver_version=driver, cuda_driver_version=cuda,
                            reason=f"NVML query failed: {_nvml_msg(e)}")
        reason = None if gpus else "NVML found 0 devices"
        return GPUProbe(gpus=gpus, driver_version=driver, cuda_driver_version=cuda, reason=reason)
    finally:
        _try(nvml.nvmlShutdown)


def _device(nvml: Any, i: int) -> GPUInfo:
    h = nvml.nvmlDeviceGetHandleByIndex(i)
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    cc = _try(lambda: tuple(nvml.nvmlDeviceGetCudaComputeCapability(h)))
    return GPUInfo(
        index=i,
        uuid=_decode(nvml.nvmlDeviceGetUUID(h)),
        name=_decode(nvml.nvmlDeviceGetName(h)),
        memory_total=int(mem.total),
        memory_free=int(mem.free),
        compute_capability=cc,
        pci_bus_id=_try(lambda: _decode(nvml.nvmlDeviceGetPciInfo(h).busId)),
        pcie_gen_current=_try(lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
        pcie_width_current=_try(lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
        pcie_gen_max=_try(lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
        pcie_width_max=_try(lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(h)),
    )


def _nvml_msg(e: BaseException) -> str:
    msg = str(e) or type(e).__name__
    return msg


def child_env(gpu: GPUInfo | str | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process: PCI bus order, and only `gpu` visible (as CUDA0)."""
    env = dict(os.environ if base is None else base)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu.uuid if isinstance(gpu, GPUInfo) else str(gpu)
    return env


def probe_nvidia_smi(run: Callable[..., Any] | None = None) -> GPUProbe:
    """probe's fallback when pynvml is not importable: ask nvidia-smi, which talks to the same
    NVML. Fields it cannot give stay None."""
    import shutil
    import subprocess

    from rollkv_dist import proc

    run = run or proc.run
    if shutil.which("nvidia-smi") is None and run is proc.run:
        return GPUProbe(reason="nvidia-smi is not on PATH")
    q = ("index,uuid,name,memory.total,memory.free,compute_cap,pci.bus_id,pcie.link.gen.current,"
         "pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max,driver_version")
    try:
        p = run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return GPUProbe(reason=f"nvidia-smi failed: {e}")
    if p.returncode != 0:
        return GPUProbe(reason=f"nvidia-smi: {(p.stdout + p.stderr).strip()[:300]}")

    def num(s: str) -> int | None:
        s = s.strip()
        return int(s) if s.isdigit() else None

    gpus, driver = [], None
    for line in p.stdout.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 12:
            continue
        cc = tuple(int(x) for x in f[5].split(".")) if re.fullmatch(r"\d+\.\d+", f[5]) else None
        gpus.append(GPUInfo(index=int(f[0]), uuid=f[1], name=f[2], memory_total=(num(f[3]) or 0) * MiB,
                            memory_free=(num(f[4]) or 0) * MiB, compute_capability=cc, pci_bus_id=f[6],
                            pcie_gen_current=num(f[7]), pcie_width_current=num(f[8]),
                            pcie_gen_max=num(f[9]), pcie_width_max=num(f[10])))
        driver = f[11]
    return GPUProbe(gpus=gpus, driver_version=driver, reason=None if gpus else "nvidia-smi lists 0 devices")


NVML_LIBRARY = "libnvidia-ml.so.1"  # the NVIDIA driver's NVML, which pynvml and nvidia-smi both load


def nvml_library_present(load: Callable[[str], Any] | None = None) -> bool:
    """Whether the driver's NVML library loads (no NVIDIA driver: it does not)."""
    import ctypes

    try:
        (load or ctypes.CDLL)(NVML_LIBRARY)
        return True
    except OSError:
        return False


def _without_pynvml(smi: Callable[[], GPUProbe] | None = None, has_nvml: Callable[[], bool] | None = None) -> GPUProbe:
    """pynvml not importable (nox's own environment, for one): nvidia-smi; without GPUs the reason says what
    is really missing: the driver's NVML library first, pynvml only where NVML is there."""
    q = (smi or probe_nvidia_smi)()
    if q.gpus:
        return q
    if not (has_nvml or nvml_library_present)():
        return GPUProbe(reason=f"no NVIDIA driver: the NVML library ({NVML_LIBRARY}) is not found")
    return GPUProbe(reason=f"pynvml is not installed (pip package nvidia-ml-py) and {q.reason}")
