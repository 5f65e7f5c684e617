"""The test suite must not hide what a new user hits: a failed fetch is a failure, not a skip,
and a local sdist given through $ROLLKV_SDIST is used by the fetch of the shared CPU build
(tests/conftest.py) that the integration and recipe tests use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rollkv_dist.pin import PIN

REPO = Path(__file__).resolve().parent.parent


def test_a_failing_fetch_fails_the_model_tests(tmp_path):
    bogus = tmp_path / PIN.sdist_filename
    bogus.write_bytes(b"not the pinned sdist")
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLKV_LLAMA_TREE", "PYTEST_ADDOPTS")}
    env.update(ROLLKV_SDIST=str(bogus), ROLLKV_CACHE=str(tmp_path / "cache"), TMPDIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        "tests/test_models.py::test_tiny_f16_is_finite_and_scaled"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0, p.stdout[-2000:]
    assert "skipped" not in p.stdout.splitlines()[-1], p.stdout[-2000:]
    assert "HashMismatchError" in p.stdout and "$ROLLKV_SDIST" in p.stdout


def test_integration_fetch_honours_rollkv_sdist(tmp_path, monkeypatch):
    # the fetch of the shared CPU build (tests/conftest.py), used by the integration and recipe tests
    from conftest import fetch_settings

    monkeypatch.setenv("ROLLKV_CACHE", str(tmp_path / "empty-user-cache"))
    monkeypatch.setenv("ROLLKV_SDIST", str(tmp_path / "local" / PIN.sdist_filename))
    s = fetch_settings(tmp_path / "work")
    assert s.sdist == tmp_path / "local" / PIN.sdist_filename
