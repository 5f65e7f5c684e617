"""Long steps show progress, in the test suite too: the shared CPU build's lines reach the terminal
through pytest's capture (tests/conftest.py `shown`, also from an xdist worker), and a build run
through rollkv_dist.build.run_logged (rollkv build, the channel's build.sh) prints `what: N/M (P %),
elapsed` from ninja's lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from rollkv_dist.build import run_logged

REPO = Path(__file__).resolve().parent.parent
INNER = "ROLLKV_TEST_PROGRESS_INNER"


def test_inner_long_step(request):
    """Run by the outer test only: a long step's progress inside `shown`."""
    if not os.environ.get(INNER):
        return
    from conftest import shown

    from rollkv_dist import log

    with shown(request):
        bar = log.progress("build")
        bar.update(7, 10)
        bar.finish()


def test_a_long_steps_progress_reaches_the_terminal_under_xdist(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env[INNER] = "1"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                        "tests/test_progress_shown.py::test_inner_long_step"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(r"build: 7/10 \(70 %\), \d+\.\d s", p.stdout + p.stderr), p.stdout[-2000:] + p.stderr[-2000:]


def test_a_logged_build_shows_ninjas_progress(tmp_path, capsys):
    script = tmp_path / "build.sh"
    script.write_text("for i in 1 2 3 4; do echo \"[$i/4] Building CXX object x$i.o\"; done; pwd > where\n")
    run_logged(["bash", str(script)], tmp_path / "build.log", dict(os.environ), "build.sh for cpu",
               ninja_progress=True, cwd=tmp_path)
    err = capsys.readouterr().err
    assert re.search(r"build\.sh for cpu: 4/4 \(100 %\), \d+\.\d s", err), err
    assert (tmp_path / "where").read_text().strip() == str(tmp_path)
    assert "[4/4] Building CXX object x4.o" in (tmp_path / "build.log").read_text()
