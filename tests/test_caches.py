"""A test run never changes the caller's caches: the session's own (tests/conftest.py) stand in for
$ROLLKV_CACHE, $XDG_CACHE_HOME and $PIP_CACHE_DIR unless ROLLKV_TEST_USER_CACHES=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conftest

from rollkv_dist.fetch import FetchSettings

REPO = Path(__file__).resolve().parent.parent
PROBE = "PROBE_WRITE_CACHES"  # set by the outer test: the inner one writes where a test's defaults point


def test_a_tests_defaults_point_into_the_session_caches():
    if os.environ.get(conftest.KEEP_USER_CACHES) == "1":
        assert conftest._session_caches is None
        return
    root = conftest._session_caches
    assert root is not None and root.is_dir()
    for var in conftest.CACHE_VARS:
        assert Path(os.environ[var]).parent == root, var
    assert root in FetchSettings.resolve().cache_dir.parents
    if os.environ.get(PROBE):  # the inner run: what a careless test would do with the defaults
        for var in conftest.CACHE_VARS:
            (Path(os.environ[var]) / "written-by-a-test").write_text("x")
        (FetchSettings.resolve().cache_dir / "sdist").mkdir(parents=True, exist_ok=True)


def test_a_run_leaves_the_callers_caches_untouched(tmp_path):
    callers = {var: tmp_path / var.lower() for var in conftest.CACHE_VARS}
    for d in callers.values():
        d.mkdir()
    (callers["ROLLKV_CACHE"] / "mine").write_text("the user's file\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", conftest.KEEP_USER_CACHES)}
    env.update({var: str(d) for var, d in callers.items()}, **{PROBE: "1"})
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_caches.py::test_a_tests_defaults_point_into_the_session_caches"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:]
    assert sorted(str(x.relative_to(tmp_path)) for x in tmp_path.rglob("*")) == sorted(
        [*(var.lower() for var in conftest.CACHE_VARS), "rollkv_cache/mine"])
    assert (callers["ROLLKV_CACHE"] / "mine").read_text() == "the user's file\n"
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("rollkv-test-caches-*/*/written-by-a-test"))
