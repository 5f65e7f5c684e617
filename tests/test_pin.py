"""The pin is one TOML file (rollkv_dist/pin.toml) that Python, Nix and the conda recipe read; a hand edit that
breaks it is an error naming the file and the field, not a wrong value in one of the three."""

from __future__ import annotations

import re

import pytest

from rollkv_dist.errors import UsageError
from rollkv_dist.pin import PIN, PIN_FILE, load_pin


def test_the_pin_file_is_the_pin():
    assert load_pin(PIN_FILE) == PIN
    assert PIN.sdist_filename == f"llama_cpp_python-{PIN.version}.tar.gz"
    assert re.fullmatch(r"[0-9a-f]{64}", PIN.sha256)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('sri = "', 'sri_hash = "'), "missing sri; unknown sri_hash"),
    (lambda t: t.replace(f'sha256 = "{PIN.sha256}"', 'sha256 = "abc"'), "sha256 = 'abc' is not of the form"),
    (lambda t: t.replace(f'version = "{PIN.version}"', "version = 36"), "version = 36 is not of the form"),
    (lambda t: t + "\nproject = \"again\"\n", "cannot read the pin"),
], ids=["renamed-field", "short-sha256", "not-a-string", "duplicate-key"])
def test_a_broken_pin_is_an_error_naming_the_field(tmp_path, edit, message):
    bad = tmp_path / "pin.toml"
    bad.write_text(edit(PIN_FILE.read_text()))
    with pytest.raises(UsageError, match=re.escape(message)):
        load_pin(bad)
    assert str(bad) in str(pytest.raises(UsageError, load_pin, bad).value)
