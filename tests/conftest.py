"""The one CPU build of the pinned tree per test session, shared by the tool integration test
(tests/test_tool_integration.py) and the recipe test (tests/test_recipe_build.py).

fetch -> `rollkv source` (patches/series) -> `rollkv pack` -> unpack -> `rollkv build` (CPU,
ROLLKV_PROGRAMS), about 12 minutes on 2 cores. The build dir is keyed by the unpacked tree's
content hash: with ROLLKV_TEST_WORKDIR=DIR the work stays between sessions and an unchanged
tree reuses its build. The recipe test runs recipe/build.sh against the same tree and build
dir, so CI compiles llama.cpp once (it checks that ninja had nothing left to do).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from rollkv_dist.build import BuildSettings, run_build
from rollkv_dist.fetch import FetchSettings
from rollkv_dist.pack import PackSettings, run_pack
from rollkv_dist.series import PROVENANCE_FILE
from rollkv_dist.source import SourceSettings, prepare_source
from rollkv_dist.util import extract_all, sha256_file

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"

# The caches a test session uses instead of the caller's (ROLLKV_CACHE, XDG_CACHE_HOME, PIP_CACHE_DIR):
# a run of the suite never changes the user's files. ROLLKV_TEST_USER_CACHES=1 keeps the caller's.
CACHE_VARS = ("ROLLKV_CACHE", "XDG_CACHE_HOME", "PIP_CACHE_DIR")
KEEP_USER_CACHES = "ROLLKV_TEST_USER_CACHES"
_session_caches: Path | None = None


def pytest_configure(config):
    """Own caches for this session (each xdist worker too), made before any test imports a setting.
    A hash-valid pinned sdist in the caller's rollkv cache is copied in (read, never written), so the
    shared CPU build does not download it again."""
    global _session_caches
    if os.environ.get(KEEP_USER_CACHES) == "1":
        return
    from rollkv_dist.pin import PIN
    from rollkv_dist.util import cache_dir

    users = cache_dir(os.environ) / "sdist" / PIN.sdist_filename
    _session_caches = Path(tempfile.mkdtemp(prefix="rollkv-test-caches-"))
    for var in CACHE_VARS:
        (_session_caches / var.lower()).mkdir()
        os.environ[var] = str(_session_caches / var.lower())
    if users.is_file() and sha256_file(users) == PIN.sha256:
        mine = cache_dir(os.environ) / "sdist" / PIN.sdist_filename
        mine.parent.mkdir(parents=True)
        shutil.copyfile(users, mine)


def pytest_unconfigure(config):
    if _session_caches is not None:
        shutil.rmtree(_session_caches, ignore_errors=True)


def fetch_settings(work: Path) -> FetchSettings:
    """The user's settings when they name a local copy ($ROLLKV_SDIST: used as given, so a bad
    one fails the fetch instead of being replaced by a download) or their cache holds a
    hash-valid sdist; else pip into a clean cache under `work` (still honouring $ROLLKV_SDIST)."""
    user = FetchSettings.resolve()
    cached = user.cached_sdist
    if user.sdist is not None or (cached.is_file() and sha256_file(cached) == user.pin.sha256):
        return user
    keep = {k: v for k, v in os.environ.items() if k == "ROLLKV_SDIST"}
    return FetchSettings.resolve(cache_dir=work / "cache", env=keep)


def tree_key(tree: Path) -> str:
    """Hash of every file of the tree but the provenance (which carries a creation time)."""
    h = hashlib.sha256()
    for p in sorted(tree.rglob("*")):
        if p.is_file() and p.name != PROVENANCE_FILE:
            h.update(str(p.relative_to(tree)).encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def shown(request):
    """A long step's output on the terminal while pytest captures the rest (an xdist worker's stderr
    reaches it): rollkv's own step lines and its `build: N/M (P %), elapsed` progress, so the minutes of
    the CPU build are not silence."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        yield


@pytest.fixture(scope="session")
def cpu_build(tmp_path_factory, request):
    env_work = os.environ.get("ROLLKV_TEST_WORKDIR")
    work = Path(env_work) if env_work else tmp_path_factory.mktemp("rollkv-cpu")
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("src", "unpacked", "prefix", "rollkv-src.tar.xz"):
        p = work / stale
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    fetch = fetch_settings(work)
    src = work / "src"
    archive = work / "rollkv-src.tar.xz"
    with shown(request):
        print("\nthe shared CPU build of the pinned tree (about 12 min on 2 cores): fetch, patch, pack, build",
              file=sys.stderr, flush=True)
        prepare_source(SourceSettings(target=src, patches_dir=PATCHES, without=(), fetch=fetch))
        run_pack(PackSettings.resolve(str(archive), str(src), str(PATCHES)))
    (work / "unpacked").mkdir()
    with tarfile.open(archive) as tf:
        extract_all(tf, work / "unpacked")
    tree = work / "unpacked" / "rollkv-src"
    # The archive's entries carry one fixed mtime, so a build dir may only be reused for the
    # very same files (ninja would not see changed ones): key it by the tree's content.
    build_dir = work / f"build-{tree_key(tree)}"
    settings = BuildSettings.resolve(tree, work / "prefix", jobs=2, build_dir=build_dir)
    with shown(request):
        info_path = run_build(settings)
    return {"work": work, "src": src, "tree": tree, "archive": archive, "build_dir": build_dir,
            "prefix": work / "prefix", "info": json.loads(info_path.read_text()),
            "targets": json.loads(info_path.read_text())["targets"], "fetch": fetch}


@pytest.fixture(scope="session")
def tiny_model(cpu_build):
    from rollkv_dist.smoke import tiny_model as write

    return write(cpu_build["work"], cpu_build["tree"])


@pytest.fixture(autouse=True)
def _shared_build_on_one_worker(request):
    """A test of the shared build must be in the xdist group `llama-cpu-build`: nox runs the suite
    on two workers (`-n 2 --dist loadgroup`) and a session fixture lives per worker, so a test
    outside the group would make a second worker build llama.cpp again."""
    if "cpu_build" in request.fixturenames and not any(
            m.args[:1] == ("llama-cpu-build",) for m in request.node.iter_markers("xdist_group")):
        pytest.fail(f"{request.node.nodeid} uses the shared llama.cpp build: mark it "
                    "@pytest.mark.xdist_group(\"llama-cpu-build\") (tests/conftest.py)")
