"""Interrupting a real `rollkv` process (SIGINT or SIGTERM to that one process, not its group)
while it runs a long child: every process it started, and everything those started, is gone
when rollkv exits, and no partial output is left.

The long children are stand-ins placed where rollkv looks for the real ones: a slow cmake that
starts a ninja that starts two "compilers" (on PATH), a slow pip that starts a build-backend
helper and has written part of the download (`python -m pip`, through PYTHONPATH), and a
llama-server that never becomes healthy and starts a helper (the gates, with a fake pynvml).
Every process that descends from rollkv carries a marker in its environment; after rollkv exits
the test looks for any live process with that marker in /proc.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _rollkv_tool_helpers import make_build_tree

REPO = Path(__file__).resolve().parent.parent
MARK = "ROLLKV_INTERRUPT_TEST_MARK"

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="needs /proc (Linux)")

SLEEPER = "import time; time.sleep(300)"
# a process that records its pid, starts `n` sleeping children (which record theirs) and sleeps
SPAWNER = """
import os, subprocess, sys, time
pids = os.environ["STANDIN_PIDS"]
def note(pid):
    with open(pids, "a") as f:
        f.write(f"{{pid}}\\n")
note(os.getpid())
for _ in range({n}):
    note(subprocess.Popen([sys.executable, "-c", {sleeper!r}]).pid)
print("[1/100] Building CXX object ggml.o", flush=True)
time.sleep(300)
"""

FAKE_CMAKE = f"""#!{sys.executable}
import os, subprocess, sys, time
args = sys.argv[1:]
if args[:1] == ["--version"]:
    print("cmake version 3.25.1"); sys.exit(0)
if args[:1] == ["-C"]:  # configure with rollkv.cmake: -C CACHE -S TREE -B BUILD ...
    build = args[args.index("-B") + 1]
    os.makedirs(build, exist_ok=True)
    with open(os.path.join(build, "rollkv-programs.txt"), "w") as f:
        f.write("llama-server")
    print("-- Configuring done"); sys.exit(0)
slow = os.environ.get("STANDIN_SLOW", "build")
if args[:1] == ["--build"] and slow == "install":
    os.makedirs(os.path.join(args[1], "bin"), exist_ok=True); sys.exit(0)
if args[0].startswith("-DROLLKV_BUILD_DIR="):  # the install script: -D.. -DCMAKE_INSTALL_PREFIX=P -P ..
    if slow != "install":
        sys.exit(0)
    # part of a program already copied under $DESTDIR$P, then a slow copy
    dest = os.environ["DESTDIR"] + args[1].split("=", 1)[1] + "/bin"
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "llama-server"), "wb") as f:
        f.write(b"#!/bin/sh\\n# the first bytes")
# the slow step: a ninja (or cmake's copy) that runs two compilers (helpers)
with open(os.environ["STANDIN_PIDS"], "a") as f:
    f.write(f"{{os.getpid()}}\\n")
ninja = subprocess.Popen([sys.executable, "-c", {SPAWNER.format(n=2, sleeper=SLEEPER)!r}])
ninja.wait()
"""

FAKE_PIP = SPAWNER.replace('print("[1/100] Building CXX object ggml.o", flush=True)', """
import pathlib
args = sys.argv[1:]
out = pathlib.Path(args[args.index("-d") + 1])
(out / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"the first megabytes of a download")
print("Downloading llama_cpp_python-0.3.36.tar.gz (76.6 MB)", flush=True)
""")

FAKE_SERVER = f"""#!{sys.executable}
import os, subprocess, sys, time
if "--help" in sys.argv:
    print("--kv-residency-mode --vram-target --kv-compute-reserve"); sys.exit(0)
""" + SPAWNER.format(n=1, sleeper=SLEEPER)

FAKE_PYNVML = """
class _Mem:
    total, free = 143 << 30, 140 << 30
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlSystemGetDriverVersion(): return "580.159"
def nvmlSystemGetCudaDriverVersion(): return 13000
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetMemoryInfo(h): return _Mem()
def nvmlDeviceGetUUID(h): return "GPU-fake-0000"
def nvmlDeviceGetName(h): return "NVIDIA H200"
def nvmlDeviceGetCudaComputeCapability(h): return (9, 0)
"""


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _marked_alive(mark: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries the marker."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"{MARK}={mark}".encode() not in (d / "environ").read_bytes().split(b"\0"):
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            found.append(int(d.name))
    return found


def _interrupt(tmp_path: Path, argv: list[str], ready: int, sig: int = signal.SIGINT,
               extra_env: dict[str, str] | None = None, pythonpath: Path | None = None) -> tuple[int, str]:
    """Start `rollkv argv`, wait until `ready` stand-in processes run, send `sig` to rollkv alone;
    returns (exit status, stderr) once rollkv exited and asserts that nothing it started survives."""
    mark = uuid.uuid4().hex
    pids = tmp_path / "standin-pids"
    env = dict(os.environ, **(extra_env or {}))
    env.update({MARK: mark, "STANDIN_PIDS": str(pids),
                "PYTHONPATH": os.pathsep.join(str(p) for p in (pythonpath, REPO) if p)})
    err = tmp_path / "rollkv.err"
    with open(err, "w") as ef:
        # rollkv as started from a terminal: SIGINT at its default disposition. A test run that is itself a
        # background job of a non-interactive shell (`.ci/run &`) has SIGINT ignored, children inherit that,
        # and Python then installs no KeyboardInterrupt handler: the SIGINT cases would wait out their timeout
        p = subprocess.Popen([sys.executable, "-m", "rollkv_dist", *argv], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=ef, stdin=subprocess.DEVNULL,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 60
            while not (pids.is_file() and len(pids.read_text().split()) >= ready):
                assert p.poll() is None, err.read_text()
                assert time.monotonic() < deadline, f"stand-ins did not start: {err.read_text()}"
                time.sleep(0.1)
            time.sleep(0.3)
            assert len(_marked_alive(mark)) >= ready + 1  # rollkv and its descendants run
            p.send_signal(sig)  # to rollkv only: its children are in their own sessions
            rc = p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    left = _marked_alive(mark)
    for pid in left:  # clean up before failing, so a failure does not leak processes
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"still running after rollkv exited: {left}"
    return rc, err.read_text()


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@pytest.fixture
def tree(tmp_path):
    return make_build_tree(tmp_path)


@pytest.mark.parametrize("slow", ["build", "install"])
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_build_stops_cmake_ninja_and_compilers(tmp_path, tree, sig, code, slow):
    """`slow`: the step that is interrupted, ninja's build or the install script (which has
    already written part of a program into its DESTDIR staging folder)."""
    bin_dir = tmp_path / "bin"
    _exe(bin_dir / "cmake", FAKE_CMAKE)
    _exe(bin_dir / "ninja", "#!/bin/sh\necho 1.11.1\n")
    prefix = tmp_path / "out" / "prefix"
    rc, err = _interrupt(tmp_path, ["build", "--source", str(tree), "--prefix", str(prefix),
                                    "--build-dir", str(tmp_path / "b"), "-j", "2"],
                         ready=4, sig=sig, extra_env={"PATH": f"{bin_dir}:{os.environ['PATH']}",
                                                      "STANDIN_SLOW": slow})
    assert rc == code, err
    assert ("terminated" if sig == signal.SIGTERM else "interrupted") in err
    assert _leftovers(tmp_path / "out") == [], "a prefix (or its staging folder) was left"
    log = (tmp_path / "b" / "rollkv-build.log").read_text()
    assert ("-P " in log) == (slow == "install"), "the interrupt did not come in the intended step"


@pytest.fixture
def fake_pip(tmp_path) -> Path:
    d = tmp_path / "fakepip"
    (d / "pip").mkdir(parents=True)
    (d / "pip" / "__init__.py").write_text("")
    (d / "pip" / "__main__.py").write_text(FAKE_PIP.format(n=1, sleeper=SLEEPER))
    return d


def test_interrupted_source_stops_pip_and_leaves_nothing(tmp_path, fake_pip):
    cache, target = tmp_path / "cache", tmp_path / "out" / "src"
    rc, err = _interrupt(tmp_path, ["source", str(target)], ready=2, pythonpath=fake_pip,
                         extra_env={"ROLLKV_CACHE": str(cache), "ROLLKV_SDIST": ""})
    assert rc == 130, err
    assert _leftovers(cache / "sdist") == [], "a partial download (.fetch-*) was left in the cache"
    assert _leftovers(tmp_path / "out") == []


def test_interrupted_pack_leaves_no_archive(tmp_path, fake_pip):
    out = tmp_path / "out" / "rollkv-src.tar.xz"
    out.parent.mkdir()
    rc, err = _interrupt(tmp_path, ["pack", str(out)], ready=2, pythonpath=fake_pip,
                         extra_env={"ROLLKV_CACHE": str(tmp_path / "cache"), "ROLLKV_SDIST": ""})
    assert rc == 130, err
    assert _leftovers(out.parent) == [], "pack's temporary tree or archive was left"


def test_interrupted_gate_stops_the_server_and_writes_no_report(tmp_path):
    build = tmp_path / "build"
    _exe(build / "bin" / "llama-server", FAKE_SERVER)
    nvml = tmp_path / "nvml"
    nvml.mkdir()
    (nvml / "pynvml.py").write_text(FAKE_PYNVML)
    gemma = tmp_path / "gemma.gguf"
    gemma.write_bytes(b"GGUF")
    reports = tmp_path / "reports"
    rc, err = _interrupt(tmp_path, ["gates", "--build", str(build), "--gates", "needle", "--gemma", str(gemma),
                                    "--work", str(tmp_path / "work"), "--reports", str(reports)],
                         ready=2, pythonpath=nvml)
    assert rc == 130, err
    assert not reports.exists(), "a report of an interrupted gate was written"


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_channel_stops_conda_build(tmp_path, sig, code):
    """`rollkv channel` runs conda-build (or the recipe's build.sh, a whole llama.cpp build)
    through the same process runner: an interrupt leaves none of its processes running."""
    bin_dir = tmp_path / "bin"
    _exe(bin_dir / "conda-build", f"#!{sys.executable}\n" + SPAWNER.format(n=2, sleeper=SLEEPER))
    rc, err = _interrupt(tmp_path, ["channel", str(tmp_path / "channel"), "--builder", "conda-build",
                                    "--variant", "cpu", "--patches", str(REPO / "patches"),
                                    "--source-url", "file:///srv/rollkv-test.tar.gz"],
                         ready=3, sig=sig, extra_env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert rc == code, err
    assert ("terminated" if sig == signal.SIGTERM else "interrupted") in err
