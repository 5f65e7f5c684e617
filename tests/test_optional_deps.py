"""A missing optional dependency is a usage error that names the extra to install, not an internal
error; the extras named are pyproject.toml's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollkv_dist.errors import UsageError
from rollkv_dist.util import OPTIONAL_MODULES, optional_import

REPO = Path(__file__).resolve().parent.parent


def test_the_extras_are_pyprojects():
    text = (REPO / "pyproject.toml").read_text()
    block = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    for module, (dist, extra) in OPTIONAL_MODULES.items():
        section = block.split(f"\n{extra} = [", 1)[1].split("]", 1)[0]
        assert f'"{dist}"' in section, (module, dist, extra)


@pytest.mark.parametrize("module", sorted(OPTIONAL_MODULES))
def test_a_missing_module_names_its_extra(module, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    dist, extra = OPTIONAL_MODULES[module]
    with pytest.raises(UsageError, match=rf"needs {dist}, from the `{extra}` extra: pip install 'rollkv-dist\[{extra}\]'"):
        optional_import(module, "something")


def test_rollkv_channel_without_jinja2_is_a_usage_error(tmp_path):
    """What a newcomer hit: `rollkv channel` after a plain `pip install -e .` (jinja2 missing)."""
    code = ("import sys; sys.modules['jinja2'] = None; from rollkv_dist.cli import main; "
            f"sys.exit(main(['channel', {str(tmp_path / 'ch')!r}, '--variant', 'cpu']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ROLLKV_CACHE": str(tmp_path / "c")})
    assert p.returncode == UsageError.exit_code, p.stderr[-2000:]
    assert "internal error" not in p.stderr
    assert "pip install -e '.[channel]'" in p.stderr, p.stderr[-2000:]
