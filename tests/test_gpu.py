"""NVML probing with a fake pynvml, and the no-GPU paths."""

from __future__ import annotations

import types

import pytest

from rollkv_dist import gpu
from rollkv_dist.errors import NoGPUError, UsageError


class NVMLError(Exception):
    pass


def fake_nvml(n=2, init_error=None, pcie_unsupported=False):
    m = types.SimpleNamespace()
    state = {"init": 0, "shutdown": 0}

    def init():
        if init_error:
            raise NVMLError(init_error)
        state["init"] += 1

    def unsupported(*_a):
        raise NVMLError("Not Supported")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: state.__setitem__("shutdown", state["shutdown"] + 1)
    m.nvmlSystemGetDriverVersion = lambda: b"580.159"
    m.nvmlSystemGetCudaDriverVersion = lambda: 13000
    m.nvmlDeviceGetCount = lambda: n
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=150754820096, free=150000000000 - h)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h:08d}-aaaa-bbbb-cccc-dddddddddddd"
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{0x1b + h:02X}:00.0".encode())
    m.nvmlDeviceGetCurrPcieLinkGeneration = unsupported if pcie_unsupported else (lambda h: 5)
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    m.state = state
    return m


def test_probe_lists_gpus_by_uuid():
    nv = fake_nvml(2)
    p = gpu.probe(nv)
    assert p.ok and p.reason is None
    assert p.driver_version == "580.159" and p.cuda_driver_version == "13.0"
    g0, g1 = p.gpus
    assert g0.uuid.startswith("GPU-00000000") and g1.index == 1
    assert g0.short_name == "H200" and g0.cc_str == "9.0" and g0.cuda_arch == "90-real"
    assert g0.pcie_str() == "gen5 x16 (max gen5 x16)"
    assert g0.pci_bus_id == "00000000:1B:00.0"
    assert g0.to_json()["memory_total_mib"] == 150754820096 // (1 << 20)
    assert p.cuda_archs == ("90-real",)
    assert nv.state == {"init": 1, "shutdown": 1}


def test_unsupported_fields_are_none_not_fatal():
    p = gpu.probe(fake_nvml(1, pcie_unsupported=True))
    assert p.gpus[0].pcie_gen_current is None and p.gpus[0].pcie_str().startswith("? ")


def test_no_driver_reason():
    p = gpu.probe(fake_nvml(init_error="Driver Not Loaded"))
    assert not p.ok and p.gpus == []
    assert p.reason == "NVML init failed: Driver Not Loaded"
    with pytest.raises(NoGPUError, match="no NVIDIA GPU found: NVML init failed: Driver Not Loaded"):
        p.require()


def test_zero_devices_reason():
    p = gpu.probe(fake_nvml(0))
    assert not p.ok and p.reason == "NVML found 0 devices" and p.driver_version == "580.159"


def test_missing_pynvml(monkeypatch):
    def boom():
        raise ImportError("no pynvml")

    monkeypatch.setattr(gpu, "_load_nvml", boom)
    p = gpu.probe()
    # this machine's real answer, whichever it is: never pynvml where the driver itself is missing
    if gpu.nvml_library_present():
        assert not p.ok or p.gpus
    else:
        assert not p.ok and "NVML library" in p.reason and "nvidia-ml-py" not in p.reason


def test_without_pynvml_the_reason_is_what_is_really_missing():
    none = lambda: gpu.GPUProbe(reason="nvidia-smi is not on PATH")  # noqa: E731
    no_driver = gpu._without_pynvml(smi=none, has_nvml=lambda: False)
    assert no_driver.reason == "no NVIDIA driver: the NVML library (libnvidia-ml.so.1) is not found"
    driver = gpu._without_pynvml(smi=none, has_nvml=lambda: True)
    assert driver.reason == "pynvml is not installed (pip package nvidia-ml-py) and nvidia-smi is not on PATH"
    one = gpu.GPUInfo(index=0, uuid="GPU-x", name="H200", memory_total=1, memory_free=1, compute_capability=(9, 0))
    assert gpu._without_pynvml(smi=lambda: gpu.GPUProbe(gpus=[one]), has_nvml=lambda: False).gpus == [one]
    assert not gpu.nvml_library_present(load=lambda name: (_ for _ in ()).throw(OSError(name)))


def test_select_by_index_uuid_all():
    p = gpu.probe(fake_nvml(3))
    assert [g.index for g in p.select(None)] == [0]
    assert [g.index for g in p.select("all")] == [0, 1, 2]
    assert [g.index for g in p.select("2")] == [2]
    assert [g.index for g in p.select(p.gpus[1].uuid)] == [1]
    assert [g.index for g in p.select("0,2")] == [0, 2]
    with pytest.raises(UsageError, match="no such GPU"):
        p.select("7")


def test_child_env_pci_order_and_visible_uuid():
    g = gpu.probe(fake_nvml(1)).gpus[0]
    env = gpu.child_env(g, base={"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3"})
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["CUDA_VISIBLE_DEVICES"] == g.uuid
    assert env["PATH"] == "/bin"
    assert "CUDA_VISIBLE_DEVICES" not in gpu.child_env(None, base={})


def test_a_device_nvml_cannot_describe_is_a_reason_not_a_crash():
    nv = fake_nvml(2)

    def broken(h):
        raise NVMLError("GPU is lost")

    nv.nvmlDeviceGetMemoryInfo = broken
    p = gpu.probe(nv)
    assert not p.ok and p.reason == "NVML query failed: GPU is lost" and p.driver_version == "580.159"
    assert nv.state["shutdown"] == 1


def test_nominal_pcie_rate_from_nvml():
    g = gpu.probe(fake_nvml(1)).gpus[0]
    assert g.pcie_gbps == 63.0  # gen5 x16
    idle = gpu.GPUInfo(0, "GPU-x", "NVIDIA H200", 1, 1, (9, 0), pcie_gen_current=1, pcie_width_current=16,
                       pcie_gen_max=4, pcie_width_max=16)
    assert idle.pcie_gbps == 31.5  # the link's maximum, not the idle generation
    assert gpu.probe(fake_nvml(1, pcie_unsupported=True)).gpus[0].pcie_gbps == 63.0  # current unknown, max known
    assert gpu.GPUInfo(0, "GPU-y", "x", 1, 1, None).pcie_gbps is None
