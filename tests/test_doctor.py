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


def _h200(free_mib: int = 143000):
    g = gpu.GPUInfo(0, "GPU-1234", "NVIDIA H200", 143771 << 20, free_mib << 20, (9, 0), "0000:1B:00.0", 5, 16, 5, 16)
    return gpu.GPUProbe(gpus=[g], driver_version="580.159", cuda_driver_version="13.0")


def test_doctor_sizes_the_gates_largest_host_tail_against_host_memory(monkeypatch):
    monkeypatch.setattr(doctor, "host_memory", lambda: {"total_mib": 128000, "available_mib": 60000})
    monkeypatch.setattr(doctor, "memlock", lambda: {"soft": 8 << 20, "hard": 8 << 20, "soft_str": "8192 KiB",
                                                    "hard_str": "8192 KiB", "unlimited": False, "note": "n"})
    d = doctor.collect(_h200())
    rows = {(t["model"], t["kv_type"]): t for t in d["host_tails"]}
    big = rows[("qwen2.5-14b-1m", "f16")]
    # 48 layers x 8 KV heads x 128 x (K+V) x 2 bytes = 192 KiB per cell; 1048576 cells = 196608 MiB (ENGINE.md)
    assert big["n_ctx"] == 1048576 and big["kv_mib"] == 196608
    weights_mib = doctor.shape_case("qwen2.5-14b-1m", 1048576).weights_bytes // doctor.MiB
    assert 14000 < weights_mib < 16000  # the 14969 MiB Q8_0 file the gates write, less its header and vocab
    assert abs(big["min_tail_mib"] - (196608 - (143000 - weights_mib))) <= 1
    assert big["fits_host"] is False and big["within_memlock"] is False
    q8 = rows[("qwen2.5-14b-1m", "q8_0")]
    assert q8["kv_mib"] == 196608 * 17 // 32 and q8["min_tail_mib"] < big["min_tail_mib"]
    small = rows[("qwen2-1.5b", "f16")]
    assert small["min_tail_mib"] == 0 and small["fits_host"] is True and small["within_memlock"] is True
    text = doctor.render(d)
    # patch 0101: the tail is pinned as cells come into use: the cells the GPU and the available memory hold
    within = int(((143000 - weights_mib) * doctor.MiB + 60000 * doctor.MiB) / (192 * 1024))
    assert abs(big["cells_within_host"] - within) <= 8 and big["cells_within_host"] < 1048576
    assert small["cells_within_host"] == 131072
    assert (f"host tail: qwen2.5-14b-1m -c 1048576 f16 KV (196608 MiB) on GPU 0: at least {big['min_tail_mib']} MiB "
            f"-> boots (pinned as cells come into use); a prompt past about {big['cells_within_host']} cells fails for "
            f"host memory (the whole context NEEDS {big['min_tail_mib'] - 60000} MiB MORE HOST MEMORY), above the "
            "locked-memory limit") in text
    assert "host tail: qwen2-1.5b -c 131072 f16 KV (3584 MiB) on GPU 0: at least 0 MiB -> fits host memory" in text


def test_doctor_tail_shrinks_with_free_gpu_memory():
    a = doctor.shape_case("qwen2.5-14b-1m", 1048576)
    assert a.min_tail_bytes(80000 << 20) - a.min_tail_bytes(100000 << 20) == 20000 << 20
    assert a.min_tail_bytes(10 << 20) == a.kv_bytes()  # weights alone do not fit: the whole KV is tail


def test_doctor_model_and_ctx_go_together(tmp_path):
    from rollkv_dist.errors import UsageError

    for kw in ({"model": str(tmp_path / "m.gguf"), "ctx": None}, {"model": None, "ctx": 4096}):
        try:
            doctor.run(type("A", (), {"json": False, **kw})())
        except UsageError as e:
            assert "--model and --ctx go together" in str(e)
        else:
            raise AssertionError(f"{kw}: no UsageError")
    try:
        doctor.run(type("A", (), {"json": False, "model": str(tmp_path / "missing.gguf"), "ctx": 4096})())
    except UsageError as e:
        assert "no such file" in str(e)
    else:
        raise AssertionError("missing model: no UsageError")
