"""nox parametrization over gates x GPUs, and the no-GPU skip; nvidia-smi fallback probe."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollkv_dist import gpu
from rollkv_dist.gates.runner import DEFAULT_GATES
from rollkv_dist.series import read_series

ROOT = Path(__file__).resolve().parents[1]
nox = pytest.importorskip("nox")


@pytest.fixture(scope="module")
def nf():
    """The noxfile, imported once (nox warns when sessions are registered twice)."""
    old = os.environ.get("ROLLKV_NO_GPU_PROBE")
    os.environ["ROLLKV_NO_GPU_PROBE"] = "NVML init failed: Driver Not Loaded"
    try:
        spec = importlib.util.spec_from_file_location("rollkv_noxfile_under_test", ROOT / "noxfile.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            del os.environ["ROLLKV_NO_GPU_PROBE"]
        else:
            os.environ["ROLLKV_NO_GPU_PROBE"] = old
    return mod


def two_gpus():
    return gpu.GPUProbe(gpus=[gpu.GPUInfo(i, f"GPU-{i}", "NVIDIA H200", 1, 1, (9, 0)) for i in range(2)],
                        driver_version="580.159")


MULTI = ("boot-beyond", "resident-parity", "speed")  # the gates with an all-GPU run


def test_params_gate_x_gpu_x_artifact_ids(nf):
    params = nf.gpu_params(two_gpus(), artifacts=("source", "conda", "nix"))
    ids = [p.id for p in params]
    assert len(ids) == 2 * len(DEFAULT_GATES) * 3 + len(MULTI) * 3
    assert "needle-H200-0-conda" in ids and "boot-repro-H200-1-nix" in ids and len(set(ids)) == len(ids)
    assert params[ids.index("curve-H200-1-source")].args == ("curve", "GPU-1", "source")
    assert params[ids.index("resident-parity-H200-0-conda")].args == ("resident-parity", "GPU-0", "conda")
    # two or more GPUs: an all-GPU entry per gate that has such a run, after the per-GPU ones
    assert ids[-len(MULTI) * 3:] == [f"{g}-all-{a}" for g in MULTI for a in ("source", "conda", "nix")]
    assert params[ids.index("speed-all-conda")].args == ("speed", "all", "conda")


def test_one_gpu_has_no_all_gpu_entries(nf):
    one = gpu.GPUProbe(gpus=two_gpus().gpus[:1])
    assert not [p.id for p in nf.gpu_params(one, artifacts=("source",)) if "-all-" in p.id]


def test_the_all_gpu_entry_runs_rollkv_gates_with_split_gpus(nf, tmp_path, monkeypatch):
    built(tmp_path, monkeypatch)
    args = nf._gate_args(RecordingSession(), "resident-parity", "all")
    assert args[args.index("--gpu") + 1:args.index("--gpu") + 3] == ["all", "--split-gpus"]
    assert "--split-gpus" not in nf._gate_args(RecordingSession(), "resident-parity", "GPU-0")


def test_artifacts_follow_the_machine(nf):
    assert nf.ARTIFACTS[:2] == ("source", "conda")
    assert ("nix" in nf.ARTIFACTS) == bool(shutil.which("nix"))


def test_conda_artifact_installs_from_the_channel(nf, tmp_path, monkeypatch):
    monkeypatch.setattr(nf, "WORK", tmp_path / "work")
    monkeypatch.setattr(nf, "CHANNEL", tmp_path / "work" / "channel")
    s = RecordingSession()
    prefix = nf.artifact_prefix(s, "conda")
    assert prefix == tmp_path / "work" / "artifacts" / "conda-cpu"  # no GPU: the CPU variant
    assert s.runs == [("rollkv", "channel", str(tmp_path / "work" / "channel"), "--variant", "cpu",
                       "--install", str(prefix))]
    s = RecordingSession()
    assert nf.artifact_prefix(s, "nix") == tmp_path / "work" / "artifacts" / "nix-result"
    assert s.runs == [("nix", "build", ".#cpu", "-o", str(tmp_path / "work" / "artifacts" / "nix-result"))]


def test_params_without_gpu(nf):
    params = nf.gpu_params(gpu.GPUProbe(reason="NVML found 0 devices"))
    assert [(p.id, p.args) for p in params] == [("no-gpu", (None, None, None))]
    assert nf.PROBE.reason == "NVML init failed: Driver Not Loaded"


def _nox(*args):
    exe = shutil.which("nox")
    cmd = [exe] if exe else [sys.executable, "-m", "nox"]
    env = dict(os.environ, ROLLKV_NO_GPU_PROBE="NVML init failed: Driver Not Loaded")
    return subprocess.run([*cmd, "-f", str(ROOT / "noxfile.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_nox_lists_sessions_and_skips_gpu_gates_cleanly():
    p = _nox("-l")
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    for s in ("* tests", "- lint", "- build", "- gpu_gates(no-gpu)", "- curve"):
        assert s in out, s
    p = _nox("-s", "gpu_gates", "--no-venv")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "skipped: no NVIDIA GPU found: NVML init failed: Driver Not Loaded" in out


def test_nvidia_smi_fallback_parses():
    line = ("0, GPU-abc, NVIDIA H200, 143771, 143000, 9.0, 00000000:1B:00.0, 5, 16, 5, 16, 580.159\n"
            "1, GPU-def, NVIDIA H200, 143771, 100, 9.0, 00000000:2B:00.0, [N/A], 16, 5, 16, 580.159\n")

    def run(cmd, **kw):
        assert cmd[0] == "nvidia-smi" and cmd[1].startswith("--query-gpu=")
        return subprocess.CompletedProcess(cmd, 0, line, "")

    p = gpu.probe_nvidia_smi(run=run)
    assert [g.uuid for g in p.gpus] == ["GPU-abc", "GPU-def"] and p.driver_version == "580.159"
    assert p.gpus[0].memory_total == 143771 << 20 and p.gpus[0].compute_capability == (9, 0)
    assert p.gpus[1].pcie_gen_current is None and p.gpus[1].pcie_width_current == 16

    def fail(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 9, "NVIDIA-SMI has failed because it couldn't communicate", "")

    q = gpu.probe_nvidia_smi(run=fail)
    assert not q.gpus and "couldn't communicate" in q.reason


class RecordingSession:
    """Stands in for nox.Session in _gate_args: records the commands it would run."""

    def __init__(self, posargs=()):
        self.runs, self.posargs = [], list(posargs)

    def run(self, *args, **kw):
        self.runs.append(args)

    def log(self, *a, **kw):
        pass

    def error(self, msg):
        raise AssertionError(msg)


def built(tmp_path, monkeypatch) -> None:
    """ROLLKV_BUILD: a prefix with the series' llama-server (nox builds nothing for it)."""
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "llama-server").write_text("")
    monkeypatch.setenv("ROLLKV_BUILD", str(prefix))


def test_resident_ab_builds_the_pin_without_any_patch(nf, tmp_path, monkeypatch):
    built(tmp_path, monkeypatch)
    monkeypatch.delenv("ROLLKV_UPSTREAM_BUILD", raising=False)
    monkeypatch.setattr(nf, "WORK", tmp_path / "work")
    s = RecordingSession()
    args = nf._gate_args(s, "resident-ab", "GPU-0")
    series = read_series(ROOT / "patches")
    assert len(series) >= 8
    src = str(tmp_path / "work" / "src-upstream")
    source_cmd = next(r for r in s.runs if r[:2] == ("rollkv", "source"))
    assert source_cmd[2] == src and [a for a in source_cmd[3:] if a != "--without"] == series
    build_cmd = next(r for r in s.runs if r[:2] == ("rollkv", "build"))
    assert build_cmd[build_cmd.index("--source") + 1] == src
    up = str(tmp_path / "work" / "prefix-upstream")
    assert build_cmd[build_cmd.index("--prefix") + 1] == up
    assert args[args.index("--upstream-build") + 1] == up and "--baseline-build" not in args


def test_boot_repro_builds_the_series_before_the_compute_reserve_patch(nf, tmp_path, monkeypatch):
    """The baseline is the series before the patch whose role is the compute reserve (read from the series,
    not a file name prefix): the patches after it build on it, so leaving it out alone does not apply
    (tests/test_tool_integration.py applies both on the pinned tree)."""
    built(tmp_path, monkeypatch)
    monkeypatch.delenv("ROLLKV_BASELINE_BUILD", raising=False)
    monkeypatch.setattr(nf, "WORK", tmp_path / "work")
    s = RecordingSession()
    args = nf._gate_args(s, "boot-repro", "GPU-0")
    source_cmd = next(r for r in s.runs if r[:2] == ("rollkv", "source"))
    assert source_cmd[2:] == (str(tmp_path / "work" / "src-before-0089"), "--before",
                              "0089-rolling-kv-compute-reserve.patch")
    assert args[args.index("--baseline-build") + 1] == str(tmp_path / "work" / "prefix-before-0089")


def test_upstream_build_from_the_environment_is_not_rebuilt(nf, tmp_path, monkeypatch):
    built(tmp_path, monkeypatch)
    monkeypatch.setenv("ROLLKV_UPSTREAM_BUILD", "/opt/upstream")
    monkeypatch.setattr(nf, "WORK", tmp_path / "work")
    s = RecordingSession()
    args = nf._gate_args(s, "resident-ab", "GPU-0")
    assert s.runs == [] and args[args.index("--upstream-build") + 1] == "/opt/upstream"


def test_rollkv_gates_selects_the_gates(nf):
    assert nf.gate_selection({}) == (tuple(DEFAULT_GATES), None)
    assert nf.gate_selection({"ROLLKV_GATES": "all"}) == (tuple(DEFAULT_GATES), None)
    assert nf.gate_selection({"ROLLKV_GATES": " engine, resident-parity "}) == (("engine", "resident-parity"), None)
    gates, err = nf.gate_selection({"ROLLKV_GATES": "engine,spede"})
    assert gates == () and "spede" in err and all(g in err for g in DEFAULT_GATES)
    gates, err = nf.gate_selection({"ROLLKV_GATES": ","})
    assert gates == () and "names no gate" in err
    params = nf.gpu_params(two_gpus(), ("engine", "speed"), ("source",))
    assert [p.id for p in params] == ["engine-H200-0-source", "speed-H200-0-source",
                                      "engine-H200-1-source", "speed-H200-1-source", "speed-all-source"]
    assert [p.id for p in nf.gpu_params(two_gpus(), (), ("source",), err)] == ["bad-selection"]


def test_rollkv_artifacts_selects_the_artifacts(nf):
    assert nf.artifact_selection({}) == (nf.ARTIFACTS, None)
    assert nf.artifact_selection({"ROLLKV_ARTIFACTS": "all"}) == (nf.ARTIFACTS, None)
    assert nf.artifact_selection({"ROLLKV_ARTIFACTS": " source , conda"}) == (("source", "conda"), None)
    arts, err = nf.artifact_selection({"ROLLKV_ARTIFACTS": "source,snap"})
    assert arts == () and "snap" in err and "source" in err
    arts, err = nf.artifact_selection({"ROLLKV_ARTIFACTS": ","})
    assert arts == () and "(none)" in err
    params = nf.gpu_params(two_gpus(), ("speed",), ("conda", "source"))
    assert [p.id for p in params] == ["speed-H200-0-conda", "speed-H200-0-source",
                                      "speed-H200-1-conda", "speed-H200-1-source", "speed-all-conda",
                                      "speed-all-source"]


# nox itself, on a machine with two (stand-in) GPUs: the probe is replaced before nox loads the noxfile
FAKE_GPUS_NOX = """
import sys
from rollkv_dist import gpu
gpu.probe = lambda: gpu.GPUProbe(gpus=[gpu.GPUInfo(i, f"GPU-{i}", "NVIDIA H200", 1, 1, (9, 0)) for i in range(2)])
import nox.__main__
sys.argv = ["nox", *sys.argv[1:]]
nox.__main__.main()
"""


def _nox_two_gpus(*args, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("ROLLKV_NO_GPU_PROBE", "ROLLKV_GATES", "ROLLKV_ARTIFACTS")}
    e.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", FAKE_GPUS_NOX, "-f", str(ROOT / "noxfile.py"), *args],
                          capture_output=True, text=True, env=e, cwd=ROOT, timeout=120)


def test_nox_lists_only_the_gates_of_rollkv_gates():
    p = _nox_two_gpus("-l", ROLLKV_GATES="engine,resident-parity", ROLLKV_ARTIFACTS="source")
    assert p.returncode == 0, p.stderr
    listed = re.findall(r"^[-*] gpu_gates\(([^)]+)\)", p.stdout + p.stderr, re.M)
    assert listed == ["engine-H200-0-source", "resident-parity-H200-0-source",
                      "engine-H200-1-source", "resident-parity-H200-1-source", "resident-parity-all-source"]
    p = _nox_two_gpus("-l")
    assert p.returncode == 0, p.stderr
    listed = re.findall(r"^[-*] gpu_gates\(([^)]+)\)", p.stdout + p.stderr, re.M)
    arts = ("source", "conda", *(("nix",) if shutil.which("nix") else ()))
    assert listed == [f"{g}-H200-{i}-{a}" for i in (0, 1) for g in DEFAULT_GATES for a in arts] + [
        f"{g}-all-{a}" for g in MULTI for a in arts]


def test_nox_gpu_gates_with_an_unknown_gate_fails_naming_the_known_ones():
    p = _nox_two_gpus("-s", "gpu_gates", "--no-venv", ROLLKV_GATES="engine,nope")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "ROLLKV_GATES='engine,nope': unknown gate(s) nope; known: " + ", ".join(DEFAULT_GATES) in out
    assert "Running session gpu_gates(bad-selection)" in out and "rollkv gates" not in out
