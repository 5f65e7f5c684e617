"""rollkv fetch: cache location, sha256 checks, pip invocation, extraction of the tree."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import stat
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from _rollkv_tool_helpers import make_mini_sdist

from rollkv_dist.errors import FetchError, HashMismatchError
from rollkv_dist.fetch import FetchSettings, extract_tree, fetch_sdist
from rollkv_dist.pin import PIN
from rollkv_dist.util import cache_dir


def test_cache_dir_resolution():
    assert cache_dir({"HOME": "/h"}) == Path("/h/.cache/rollkv")
    assert cache_dir({"HOME": "/h", "XDG_CACHE_HOME": "/x"}) == Path("/x/rollkv")
    assert cache_dir({"HOME": "/h", "XDG_CACHE_HOME": "/x", "ROLLKV_CACHE": "/c"}) == Path("/c")


def test_settings_resolve_is_frozen_and_uses_env(tmp_path):
    s = FetchSettings.resolve(env={"ROLLKV_CACHE": str(tmp_path), "ROLLKV_SDIST": "/s/x.tar.gz"})
    assert s.cache_dir == tmp_path
    assert s.sdist == Path("/s/x.tar.gz")
    assert s.cached_sdist == tmp_path / "sdist" / PIN.sdist_filename
    with pytest.raises(AttributeError):
        s.cache_dir = Path("/elsewhere")  # type: ignore[misc]


def test_bad_cached_file_is_deleted_and_named(tmp_path):
    s = FetchSettings.resolve(cache_dir=tmp_path, env={})
    s.cached_sdist.parent.mkdir(parents=True)
    s.cached_sdist.write_bytes(b"truncated download")
    actual = hashlib.sha256(b"truncated download").hexdigest()
    with pytest.raises(HashMismatchError) as ei:
        fetch_sdist(s)
    msg = str(ei.value)
    assert PIN.sha256 in msg and actual in msg
    assert "run the command again" in msg
    assert not s.cached_sdist.exists()
    assert ei.value.exit_code == 4


def test_given_sdist_with_wrong_hash_is_refused_but_kept(tmp_path):
    bogus = tmp_path / PIN.sdist_filename
    bogus.write_bytes(b"not the pinned sdist")
    s = FetchSettings.resolve(cache_dir=tmp_path / "c", sdist=bogus, env={})
    with pytest.raises(HashMismatchError):
        fetch_sdist(s)
    assert bogus.exists(), "a file the user gave is never deleted"
    assert not s.cached_sdist.exists()


def test_given_sdist_is_cached_then_reused(tmp_path):
    sdist, pin = make_mini_sdist(tmp_path)
    s = FetchSettings(cache_dir=tmp_path / "c", pin=pin, sdist=sdist)
    got = fetch_sdist(s)
    assert got == s.cached_sdist and got.read_bytes() == sdist.read_bytes()
    sdist.unlink()
    assert fetch_sdist(dataclasses.replace(s, sdist=None)) == got  # served from the cache now
    assert [p.name for p in got.parent.iterdir()] == [got.name], "no temp dirs left"
    with pytest.raises(FetchError, match="--sdist .* does not exist"):
        fetch_sdist(s)  # a file the user names must exist, cache or not


def test_given_sdist_comes_before_a_good_cache(tmp_path):
    sdist, pin = make_mini_sdist(tmp_path)
    s = FetchSettings(cache_dir=tmp_path / "c", pin=pin, sdist=sdist)
    fetch_sdist(s)  # cache now good
    sdist.write_bytes(b"a corrupt local copy")
    with pytest.raises(HashMismatchError, match="--sdist"):
        fetch_sdist(s)
    assert sdist.read_bytes() == b"a corrupt local copy", "a given file is never deleted"


def test_good_given_sdist_repairs_a_corrupt_cache(tmp_path):
    sdist, pin = make_mini_sdist(tmp_path)
    s = FetchSettings(cache_dir=tmp_path / "c", pin=pin, sdist=sdist)
    s.cached_sdist.parent.mkdir(parents=True)
    s.cached_sdist.write_bytes(b"truncated")
    got = fetch_sdist(s)
    assert got.read_bytes() == sdist.read_bytes() == s.cached_sdist.read_bytes()
    assert [p.name for p in s.cached_sdist.parent.iterdir()] == [pin.sdist_filename]


def test_rollkv_sdist_may_name_a_directory(tmp_path):
    sdist, pin = make_mini_sdist(tmp_path)
    s = FetchSettings.resolve(env={"ROLLKV_SDIST": str(tmp_path), "ROLLKV_CACHE": str(tmp_path / "c")},
                              pin=pin)
    assert fetch_sdist(s).read_bytes() == sdist.read_bytes()
    empty = tmp_path / "empty"
    empty.mkdir()
    s = FetchSettings.resolve(env={"ROLLKV_SDIST": str(empty), "ROLLKV_CACHE": str(tmp_path / "c2")},
                              pin=pin)
    with pytest.raises(FetchError) as ei:
        fetch_sdist(s)
    assert "$ROLLKV_SDIST" in str(ei.value) and "is a directory without mini_pkg-1.0.tar.gz" in str(ei.value)


def _fake_python(tmp_path: Path, body: str) -> str:
    """A stand-in for `python -m pip download ...`: records argv, then runs `body`."""
    script = tmp_path / "fakepython"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import sys, pathlib, json
        args = sys.argv[1:]
        pathlib.Path(__file__).with_name("argv.json").write_text(json.dumps(args))
        req = pathlib.Path(args[args.index("-r") + 1]).read_text()
        pathlib.Path(__file__).with_name("req.txt").write_text(req)
        out = pathlib.Path(args[args.index("-d") + 1])
        """) + textwrap.dedent(body))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_pip_is_called_with_a_hash_pinned_requirements_file(tmp_path):
    sdist, pin = make_mini_sdist(tmp_path)
    body = f"""
        import shutil
        print("Downloading {pin.sdist_filename} (1.0 kB)")
        shutil.copy({str(sdist)!r}, out / {pin.sdist_filename!r})
        """
    s = FetchSettings(cache_dir=tmp_path / "c", pin=pin, python=_fake_python(tmp_path, body))
    got = fetch_sdist(s)
    assert got.read_bytes() == sdist.read_bytes()
    import json

    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:3] == ["-m", "pip", "download"]
    for flag in ("--no-deps", "--require-hashes"):
        assert flag in argv
    # only the pinned project is a source distribution: the build tools pip installs to prepare
    # its metadata must come as wheels (":all:" made pip compile CMake from source)
    assert argv[argv.index("--no-binary") + 1] == pin.project
    assert ":all:" not in argv
    assert (tmp_path / "req.txt").read_text().strip() == pin.requirement


def test_pip_download_with_wrong_content_leaves_nothing(tmp_path):
    _, pin = make_mini_sdist(tmp_path)
    body = f"""
        (out / {pin.sdist_filename!r}).write_bytes(b"evil")
        """
    s = FetchSettings(cache_dir=tmp_path / "c", pin=pin, python=_fake_python(tmp_path, body))
    with pytest.raises(HashMismatchError) as ei:
        fetch_sdist(s)
    assert hashlib.sha256(b"evil").hexdigest() in str(ei.value)
    assert not s.cached_sdist.exists()
    assert list(s.cached_sdist.parent.iterdir()) == []


def test_pip_hash_failure_becomes_hash_mismatch(tmp_path):
    _, pin = make_mini_sdist(tmp_path)
    got = "ab" * 32
    body = f"""
        print("ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE.")
        print("    Expected sha256 {pin.sha256}")
        print("         Got        {got}")
        sys.exit(1)
        """
    s = FetchSettings(cache_dir=tmp_path / "c", pin=pin, python=_fake_python(tmp_path, body))
    with pytest.raises(HashMismatchError) as ei:
        fetch_sdist(s)
    assert got in str(ei.value) and pin.sha256 in str(ei.value)


def test_pip_failure_names_the_fix(tmp_path):
    _, pin = make_mini_sdist(tmp_path)
    body = """
        print("ERROR: Could not find a version that satisfies the requirement")
        sys.exit(1)
        """
    s = FetchSettings(cache_dir=tmp_path / "c", pin=pin, python=_fake_python(tmp_path, body))
    with pytest.raises(FetchError) as ei:
        fetch_sdist(s)
    assert not isinstance(ei.value, HashMismatchError)
    assert "--sdist" in str(ei.value) and "Could not find" in str(ei.value)


def test_extract_takes_only_the_tree_and_drops_the_gitlink(tmp_path):
    sdist, pin = make_mini_sdist(tmp_path)
    dest = tmp_path / "tree"
    dest.mkdir()
    n = extract_tree(sdist, dest, pin)
    names = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert names == sorted(["CMakeLists.txt", "src/a.c", "src/b.c", "include/x.h", ".gitignore",
                            "models/vocab.gguf"])
    assert n == 6
    assert not (dest / ".git").exists() and not (dest / "setup.py").exists()


def test_extract_refuses_path_traversal(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        ti = tarfile.TarInfo("mini_pkg-1.0/vendor/llama.cpp/../../../escape.txt")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(buf.getvalue())
    _, pin = make_mini_sdist(tmp_path)
    dest = tmp_path / "t"
    dest.mkdir()
    with pytest.raises(FetchError, match="unsafe"):
        extract_tree(bad, dest, pin)
    assert not (tmp_path / "escape.txt").exists()


def test_progress_survives_pip_deleting_its_temporary_folders(tmp_path):
    """pip creates and deletes build environments under TMPDIR while rollkv polls the download's
    size: a folder vanishing mid-poll must not stop the fetch (it killed pip in 12 of 13 tries)."""
    sdist, pin = make_mini_sdist(tmp_path)
    body = f"""
        import os, shutil, time
        tmp = pathlib.Path(os.environ["TMPDIR"])
        t0, i = time.monotonic(), 0
        while time.monotonic() - t0 < 3:
            d = tmp / f"pip-build-env-{{i}}"
            for j in range(30):
                p = d.joinpath(*[f"s{{k}}" for k in range(j % 6)], f"d{{j}}")
                p.mkdir(parents=True, exist_ok=True)
                (p / {pin.sdist_filename!r}).write_text("x")
            shutil.rmtree(d)
            i += 1
        shutil.copy({str(sdist)!r}, out / {pin.sdist_filename!r})
        """
    s = FetchSettings(cache_dir=tmp_path / "c", pin=pin, python=_fake_python(tmp_path, body))
    assert fetch_sdist(s).read_bytes() == sdist.read_bytes()
    assert [p.name for p in s.cached_sdist.parent.iterdir()] == [pin.sdist_filename]


def test_downloaded_bytes_reads_pips_unpack_folder(tmp_path):
    from rollkv_dist.fetch import downloaded_bytes

    out, tmp = tmp_path / "out", tmp_path / "tmp"
    (tmp / "pip-unpack-x").mkdir(parents=True)
    out.mkdir()
    (tmp / "pip-unpack-x" / "f.tar.gz").write_bytes(b"x" * 1000)
    assert downloaded_bytes(tmp, out, "f.tar.gz") == 1000
    assert downloaded_bytes(tmp_path / "gone", out, "f.tar.gz") == 0
