"""`rollkv doctor` without NVML (this CI machine has no GPU) and with a fake probe."""

from __future__ import annotations

import json
import resource

from rollkv_dist import cli, doctor, gpu


def test_doctor_without_gpu_prints_nvml_reason(monkeypatch, capsys):
    monkeypatch.setattr(gpu, "probe", lambda: gpu.GPUProbe(reason="NVML init failed: NVML Shared Library Not Found"))
    assert doctor.run(type("A", (), {"json": False})()) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "no NVIDIA GPU found: NVML init failed: NVML Shared Library Not Found"
    assert "locked-memory limit (RLIMIT_MEMLOCK)" in out
    for tool in ("nvcc:", "cmake:", "ninja:", "cc:", "c++:"):
        assert any(line.startswith(tool) for line in out.splitlines()), tool


def test_doctor_json_and_memlock(monkeypatch, capsys):
    monkeypatch.setattr(gpu, "probe", lambda: gpu.GPUProbe(reason="NVML found 0 devices"))
    doctor.run(type("A", (), {"json": True})())
    d = json.loads(capsys.readouterr().out)
    assert d["gpu"]["gpus"] == [] and d["gpu"]["reason"] == "NVML found 0 devices"
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert d["memlock"]["unlimited"] == (soft == resource.RLIM_INFINITY)
    assert "pinned" in d["memlock"]["note"]
    assert set(d["tools"]) == {"nvcc", "cmake", "ninja", "cc", "c++"}


def test_doctor_renders_gpus():
    g = gpu.GPUInfo(0, "GPU-1234", "NVIDIA H200", 143771 << 20, 143000 << 20, (9, 0), "0000:1B:00.0", 5, 16, 5, 16)
    d = doctor.collect(gpu.GPUProbe(gpus=[g], driver_version="580.159", cuda_driver_version="13.0"))
    text = doctor.render(d)
    assert "driver 580.159, CUDA driver API 13.0" in text
    assert "GPU 0 GPU-1234: NVIDIA H200, 143771 MiB (143000 MiB free), cc 9.0, PCIe gen5 x16 (max gen5 x16)" in text


def test_tool_version_missing_tool():
    assert doctor.tool_version(["definitely-not-a-tool-rollkv", "--version"]) is None


def test_doctor_is_a_cli_command(monkeypatch, capsys):
    monkeypatch.setattr(gpu, "probe", lambda: gpu.GPUProbe(reason="NVML found 0 devices"))
    assert cli.main(["doctor"]) == 0
    assert "no NVIDIA GPU found: NVML found 0 devices" in capsys.readouterr().out
