"""The test suite must not hide what a new user hits: a failed fetch is a failure, not a skip,
and a local sdist given through $ROLLKV_SDIST is used by the fetch of the shared CPU build
(tests/conftest.py) that the integration and recipe tests use."""

from __future__ import annotations

import os
import re
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


WALL_TIME_ASSERT = r"assert [^#]*(elapsed|took|secs|seconds|duration|wall)[^#]*<"


def test_no_test_asserts_on_wall_time():
    """A busy machine is no failure: speed is shown by benchmarks and reports, not by timed asserts."""
    import re

    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for p in sorted((REPO / "tests").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(WALL_TIME_ASSERT, line) and "WALL_TIME_ASSERT" not in line]
    assert not found, found


def test_every_extraction_goes_through_the_guarded_helper():
    """tarfile's data extraction filter is missing on Debian 12's Python 3.11.2: every extraction of the package
    and of the tests is rollkv_dist.util.extract_all's (its behaviour there: tests/test_extract.py)."""
    calls = [f"{p.relative_to(REPO)}"
             for base in (REPO / "rollkv_dist", REPO / "tests")
             for p in sorted(base.glob("*.py")) if p.name not in ("test_suite_honesty.py", "test_extract.py")
             for line in p.read_text().splitlines() if ".extractall(" in line]
    assert calls == ["rollkv_dist/util.py", "rollkv_dist/util.py"], calls


def test_the_python_floor_is_one_fact():
    import rollkv_dist

    floor = ".".join(map(str, rollkv_dist.PYTHON_FLOOR))
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'requires-python = ">={floor}"' in pyproject
    assert f"Python {floor}+" in (REPO / "README.md").read_text()
    p = subprocess.run([sys.executable, "-c", "import sys; sys.version_info = (3, 9, 18, 'final', 0); "
                        "import rollkv_dist"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and f"rollkv needs Python {floor} or newer" in p.stderr, p.stderr


def test_no_skip_reason_names_a_developers_path():
    """A skip says what to set, not where one developer kept a file."""
    import re

    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted((REPO / "tests").glob("*.py"))
             if p.name != "test_suite_honesty.py"
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "reason=" in line and re.search(r"""reason=[^\n]*['"][^'"]*(/tmp/|/home/|/root/)""", line)]
    assert not found, found


def test_reports_hold_results_not_scripts():
    """Every report folder has its README (commands, commit, GPU, driver, date) and no copy of a script: the
    scripts live in rollkv_dist/gates/ or tests/gpu/ and a report names them (issue 27, item 3)."""
    reports = REPO / "reports"
    tops = [p for p in sorted(reports.iterdir()) if p.is_dir()]
    assert tops and all((p / "README.md").is_file() for p in tops), [p.name for p in tops]
    scripts = [p.relative_to(REPO).as_posix() for p in sorted(reports.rglob("*"))
               if p.is_file() and p.suffix in (".sh", ".py", ".cu", ".cpp", ".c")]
    assert scripts == [], scripts


def test_the_patch_table_lists_the_series_as_it_is():
    """docs/patches.md has one row per patch of patches/series, in order, with the patch's own subject."""
    from rollkv_dist.series import read_series

    series = read_series(REPO / "patches")
    rows = re.findall(r"^\| `(\d{4})` \| \*\*(.+?)\*\*\.", (REPO / "docs" / "patches.md").read_text(), re.M)
    assert [n for n, _ in rows] == [name[:4] for name in series]
    for (_, subject), name in zip(rows, series):
        header = (REPO / "patches" / name).read_text().split("\n---\n", 1)[0]
        assert f"Subject: [PATCH] {subject}" in " ".join(header.split()), (name, subject)
