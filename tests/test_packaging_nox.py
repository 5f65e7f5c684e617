"""noxfile.ensure_nix: installs Debian's nix-bin for the flake tests, or stops the session saying why."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class SessionStopped(Exception):
    pass


class FakeSession:
    def __init__(self):
        self.runs: list[tuple[tuple[str, ...], dict]] = []

    def error(self, msg):
        raise SessionStopped(msg)

    def run(self, *args, **kwargs):
        self.runs.append((args, kwargs))


@pytest.fixture(scope="module")
def noxfile():
    pytest.importorskip("nox", reason="nox is in the dev extras")
    os.environ.setdefault("ROLLKV_NO_GPU_PROBE", "tests: no GPU probe")
    spec = importlib.util.spec_from_file_location("rollkv_noxfile", ROOT / "noxfile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _which(present: set[str]):
    return lambda name: f"/usr/bin/{name}" if name in present else None


def test_nothing_to_do_when_nix_is_there(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile.shutil, "which", _which({"nix-instantiate", "apt-get"}))
    s = FakeSession()
    noxfile.ensure_nix(s)
    assert s.runs == []


def test_no_apt_get_stops_the_session(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile.shutil, "which", _which(set()))
    with pytest.raises(SessionStopped, match="no apt-get"):
        noxfile.ensure_nix(FakeSession())


def test_not_root_stops_the_session(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile.shutil, "which", _which({"apt-get"}))
    monkeypatch.setattr(noxfile.os, "geteuid", lambda: 1000)
    with pytest.raises(SessionStopped, match="needs root"):
        noxfile.ensure_nix(FakeSession())


def test_installs_nix_bin_as_root(noxfile, monkeypatch):
    installed: set[str] = {"apt-get"}
    monkeypatch.setattr(noxfile.shutil, "which", lambda n: f"/usr/bin/{n}" if n in installed else None)
    monkeypatch.setattr(noxfile.os, "geteuid", lambda: 0)
    s = FakeSession()
    s.run = lambda *a, **k: (s.runs.append((a, k)), installed.add("nix-instantiate") if "install" in a else None)
    noxfile.ensure_nix(s)
    commands = [a for a, _ in s.runs]
    assert commands[0][:2] == ("apt-get", "update")
    assert commands[1][:2] == ("apt-get", "install") and "nix-bin" in commands[1]
    assert all(k.get("external") is True for _, k in s.runs)


def test_install_that_leaves_no_nix_instantiate_stops(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile.shutil, "which", _which({"apt-get"}))
    monkeypatch.setattr(noxfile.os, "geteuid", lambda: 0)
    with pytest.raises(SessionStopped, match="still not on PATH"):
        noxfile.ensure_nix(FakeSession())


def test_sessions_run_the_packaging_tests(noxfile):
    import inspect

    assert "ensure_nix(session)" in inspect.getsource(noxfile.tests)
    assert "tests/test_flake_eval.py" in inspect.getsource(noxfile.flake)
    assert "ensure_nix(session)" in inspect.getsource(noxfile.flake)
    src = inspect.getsource(noxfile.recipe)
    for f in ("tests/test_recipe_render.py", "tests/test_recipe_build.py"):
        assert f in src
