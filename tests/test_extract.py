"""rollkv_dist.util.extract_all on a Python without tarfile's extraction filters (Debian 12's 3.11.2):
the same members extract, and the same unsafe ones are refused before anything is written."""

from __future__ import annotations

import io
import tarfile

import pytest

from rollkv_dist.util import UnsafeArchiveError, extract_all


def _archive(path, members):
    with tarfile.open(path, "w") as tf:
        for name, kind, data in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                ti.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
                ti.linkname = data
                tf.addfile(ti)
    return path


@pytest.fixture(params=["this python", "no filters (3.11.2)"])
def python(request, monkeypatch):
    if request.param != "this python":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
        real = tarfile.TarFile.extractall

        def old_extractall(self, path=".", members=None, *, numeric_owner=False, **kw):
            if kw:  # 3.11.2 has no filter argument
                raise TypeError(f"TarFile.extractall() got an unexpected keyword argument {next(iter(kw))!r}")
            return real(self, path, members, numeric_owner=numeric_owner, filter="fully_trusted") \
                if hasattr(tarfile, "fully_trusted_filter") else real(self, path, members, numeric_owner=numeric_owner)

        monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
    return request.param


def test_a_plain_archive_extracts(tmp_path, python):
    a = _archive(tmp_path / "a.tar", [("top/x.txt", "file", b"x\n"), ("top/sub/y.txt", "file", b"y\n"),
                                      ("top/link", "sym", "x.txt")])
    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(a) as tf:
        extract_all(tf, out)
    assert (out / "top" / "sub" / "y.txt").read_bytes() == b"y\n"
    assert (out / "top" / "link").resolve() == (out / "top" / "x.txt").resolve()


@pytest.mark.parametrize("members", [
    [("ok.txt", "file", b"1"), ("../evil.txt", "file", b"2")],
    [("ok.txt", "file", b"1"), ("out", "sym", "/etc/passwd")],
    [("up", "sym", "../../outside")],
], ids=["dotdot", "symlink-absolute", "symlink-up"])
def test_unsafe_members_are_refused_with_nothing_written(tmp_path, python, members):
    a = _archive(tmp_path / "a.tar", members)
    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(a) as tf, pytest.raises((UnsafeArchiveError, tarfile.FilterError)
                                              if hasattr(tarfile, "FilterError") else UnsafeArchiveError):
        extract_all(tf, out)
    if python != "this python":  # the helper's own check runs before any member is written
        assert list(out.iterdir()) == []
    assert not (tmp_path / "evil.txt").exists()


def test_an_absolute_name_never_lands_outside(tmp_path, python):
    """The data filter makes /abs.txt relative; without it the helper refuses it."""
    a = _archive(tmp_path / "a.tar", [("/abs.txt", "file", b"3")])
    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(a) as tf:
        if python == "this python" and hasattr(tarfile, "data_filter"):
            extract_all(tf, out)
            assert (out / "abs.txt").read_bytes() == b"3"
        else:
            with pytest.raises(UnsafeArchiveError):
                extract_all(tf, out)
            assert list(out.iterdir()) == []
