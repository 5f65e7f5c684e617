"""nox sessions and .ci/run: a test session never changes the machine (no apt-get); CI provides
Nix in .ci/run before the README's test command; the flake tests skip, with the reason printed,
where Nix is missing."""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class FakeSession:
    """Records what a session would run or install (nothing runs)."""

    def __init__(self, posargs=()):
        self.posargs = list(posargs)
        self.runs: list[tuple[str, ...]] = []
        self.installs: list[tuple[str, ...]] = []

    def error(self, msg):
        raise AssertionError(f"session stopped: {msg}")

    def skip(self, msg):
        raise AssertionError(f"session skipped: {msg}")

    def run(self, *args, **kwargs):
        self.runs.append(args)

    def install(self, *args, **kwargs):
        self.installs.append(args)

    def log(self, *a):
        pass


@pytest.fixture(scope="module")
def noxfile():
    pytest.importorskip("nox", reason="nox is in the dev extras")
    os.environ.setdefault("ROLLKV_NO_GPU_PROBE", "tests: no GPU probe")
    spec = importlib.util.spec_from_file_location("rollkv_noxfile", ROOT / "noxfile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("session_name", ["tests", "flake", "recipe"])
def test_test_sessions_change_nothing_outside_their_venv(noxfile, monkeypatch, session_name):
    # a machine without Nix and without ninja, as root with apt-get: the situation that made the
    # tests session run `apt-get install nix-bin` on the user's machine
    monkeypatch.setattr(noxfile.shutil, "which", lambda n: "/usr/bin/apt-get" if n == "apt-get" else None)
    monkeypatch.setattr(noxfile.os, "geteuid", lambda: 0)
    s = FakeSession()
    getattr(noxfile, session_name)(s)
    assert [r for r in s.runs if r[0] != "pytest"] == [], s.runs
    pytest_run = next(r for r in s.runs if r[0] == "pytest")
    assert "-rs" in pytest_run, "skip reasons (no Nix) must be printed in the summary"
    assert all(i[0] in ("-e", "ninja") for i in s.installs)


def test_no_session_changes_the_machine():
    """Not only the test sessions: no session (build, gpu_gates, smoke, channel, ...) runs apt-get."""
    text = (ROOT / "noxfile.py").read_text()
    assert "apt-get" not in text and "ensure_nix" not in text


def test_sessions_run_the_packaging_tests(noxfile):
    for name, files in (("flake", ["tests/test_flake_eval.py", "tests/test_build_definition.py",
                                   "tests/test_nix_launcher.py"]),
                        ("recipe", ["tests/test_recipe_render.py", "tests/test_recipe_build.py"])):
        s = FakeSession()
        getattr(noxfile, name)(s)
        pytest_run = next(r for r in s.runs if r[0] == "pytest")
        assert all(f in pytest_run for f in files), (name, pytest_run)


def test_flake_tests_skip_with_the_reason_when_nix_is_missing(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no nix-instantiate (and nothing else) on PATH
    p = subprocess.run([os.sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_flake_eval.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "SKIPPED" in p.stdout and "nix-instantiate not found" in p.stdout
    assert re.search(r"\d+ passed", p.stdout), "the tests that need no Nix still run"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    f = bin_dir / name
    f.write_text("#!/bin/bash\n" + body + "\n")
    f.chmod(f.stat().st_mode | stat.S_IEXEC)


def _ci_run(tmp_path: Path, with_nix: bool, venv_module: bool = True) -> list[str]:
    """.ci/run against stand-ins for apt-get, python3, nox (and nix-instantiate) and for the system Python
    (ROLLKV_CI_SYSTEM_PYTHON, whose `-m venv DIR` makes a venv of stand-ins): what it calls, in order; each
    nox call says which python3 it ran beside."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    rec = f'echo "$(basename "$0") $*" >> {calls}'
    _stub(bin_dir, "apt-get", rec)
    _stub(bin_dir, "nox", f'echo "nox $* [$(command -v python3) in $(pwd)]" >> {calls}')
    _stub(bin_dir, "python3", f'if [ "$*" = "-m site --user-base" ]; then echo {tmp_path}/ub; exit 0; fi\n'
                               f'if [ "$*" = "-V" ]; then echo "Python 3.11.7"; exit 0; fi\n{rec}')
    venv_py = ('if [ "$1" = -V ]; then echo "Python 3.11.2"; exit 0; fi\n'
               f'if [ "$1" = -c ]; then exit {0 if venv_module else 1}; fi\n'
               f'echo "system-python $*" >> {calls}\n'
               'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; '
               'printf \'export PATH="%s/bin:$PATH"\\n\' "$3" > "$3/bin/activate"; '
               f'printf \'#!/bin/bash\\necho "venv-python3 $*" >> {calls}\\n\' > "$3/bin/python3"; chmod +x "$3/bin/python3"; fi')
    _stub(tmp_path, "system-python", venv_py)
    if with_nix:
        _stub(bin_dir, "nix-instantiate", rec)
    for tool in ("bash", "dirname", "id", "basename", "env", "rm", "mkdir", "printf", "chmod", "tar", "pwd"):
        real = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if real and real.startswith("/"):
            os.symlink(real, bin_dir / tool)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
           "ROLLKV_CI_SYSTEM_PYTHON": str(tmp_path / "system-python")}
    p = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return calls.read_text().splitlines()


@pytest.mark.skipif(os.geteuid() != 0, reason=".ci/run installs Nix only as root, as CI runs")
def test_ci_installs_nix_then_runs_exactly_the_readme_command(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "    python3 -m pip install nox && nox -s tests\n" in readme
    dot_nox = ROOT / ".nox"
    had_nox = dot_nox.is_dir()
    calls = _ci_run(tmp_path, with_nix=False)
    second = tmp_path / "rollkv-ci-system-python"
    assert calls == ["apt-get update -qq", "apt-get install -y -qq nix-bin",
                     "python3 -m pip install nox", f"nox -s tests [{tmp_path / 'bin' / 'python3'} in {ROOT}]",
                     f"system-python -m venv {second / 'venv'}",
                     "venv-python3 -m pip install nox",
                     f"nox -s tests [{second / 'venv' / 'bin' / 'python3'} in {second / 'checkout'}]"]
    # the second run is in a copy of the checkout (its own .nox), and the checkout's .nox stays as it was
    assert (second / "checkout" / "noxfile.py").read_bytes() == (ROOT / "noxfile.py").read_bytes()
    assert not (second / "checkout" / ".nox").exists() and dot_nox.is_dir() == had_nox
    (tmp_path / "again").mkdir()
    again = _ci_run(tmp_path / "again", with_nix=True, venv_module=False)
    assert again[:2] == ["apt-get update -qq", "apt-get install -y -qq python3-venv"]
    assert [c.split(" [")[0] for c in again[2:]] == ["python3 -m pip install nox", "nox -s tests",
                                                     f"system-python -m venv {tmp_path / 'again' / 'rollkv-ci-system-python' / 'venv'}",
                                                     "venv-python3 -m pip install nox", "nox -s tests"]
