"""Fetch the pinned upstream sdist through pip, cache it, verify it, extract the llama.cpp tree.

pip is the only client that talks to a package index; which index it uses is pip's own
configuration. The requirement goes through a requirements file with ``--require-hashes``,
and rollkv checks the sha256 again itself before anything uses the file.

Note on speed: ``pip download`` of an sdist always prepares the package metadata (it installs
the build backend in an isolated environment and asks it for metadata); pip has no flag to
skip that, even with ``--no-deps`` (a long-standing open pip issue). For this sdist it costs a
few seconds, and it happens only on a cache miss.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rollkv_dist import log
from rollkv_dist.errors import FetchError, HashMismatchError, TargetError
from rollkv_dist.pin import PIN, UpstreamPin
from rollkv_dist.util import cache_dir as default_cache_dir
from rollkv_dist.util import disk_full_error, is_enospc, sha256_file


@dataclass(frozen=True)
class FetchSettings:
    cache_dir: Path
    pin: UpstreamPin = PIN
    python: str = sys.executable
    sdist: Path | None = None
    """A local copy of the sdist to use instead of downloading (checked against the pin)."""

    @classmethod
    def resolve(
        cls,
        cache_dir: str | os.PathLike[str] | None = None,
        sdist: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        pin: UpstreamPin = PIN,
    ) -> FetchSettings:
        env = os.environ if env is None else env
        cdir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir(env)
        local = sdist or env.get("ROLLKV_SDIST") or None
        return cls(
            cache_dir=cdir.absolute(),
            pin=pin,
            sdist=Path(local).expanduser().absolute() if local else None,
        )

    @property
    def cached_sdist(self) -> Path:
        return self.cache_dir / "sdist" / self.pin.sdist_filename


def verify_sha256(path: Path, expected: str, *, delete: bool, what: str = "file") -> None:
    """Raise HashMismatchError if `path` does not hash to `expected` (deleting it if asked)."""
    actual = sha256_file(path)
    if actual == expected:
        return
    if delete:
        path.unlink(missing_ok=True)
        fix = ("the bad file was deleted; run the command again to download a fresh copy "
               "(if it fails again, the index serves a different file than pinned in "
               "rollkv_dist/pin.py)")
    else:
        fix = "use the genuine sdist of the pinned version"
    raise HashMismatchError(
        f"{what} {path} has sha256 {actual}, expected {expected} (pinned): {fix}"
    )


def _pip_download(settings: FetchSettings, workdir: Path) -> Path:
    pin = settings.pin
    req = workdir / "requirements.txt"
    req.write_text(pin.requirement + "\n")
    out_dir = workdir / "out"
    pip_tmp = workdir / "tmp"
    out_dir.mkdir()
    pip_tmp.mkdir()
    logfile = workdir / "pip.log"
    cmd = [
        settings.python, "-m", "pip", "download",
        "--no-deps", "--no-binary", ":all:", "--require-hashes",
        "--no-cache-dir", "--progress-bar", "off", "--disable-pip-version-check",
        "-r", str(req), "-d", str(out_dir),
    ]
    env = dict(os.environ, TMPDIR=str(pip_tmp), PIP_NO_INPUT="1")
    bar = log.progress(f"downloading {pin.sdist_filename}", unit="bytes")
    size_re = re.compile(r"\(([\d.]+)\s*(kB|MB|GB)\)")
    scale = {"kB": 1e3, "MB": 1e6, "GB": 1e9}
    with open(logfile, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env)
        last = -1
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                total = None
                m = size_re.search(logfile.read_text(errors="replace"))
                if m:
                    total = float(m.group(1)) * scale[m.group(2)]
                sizes = [p.stat().st_size for p in pip_tmp.rglob(pin.sdist_filename)
                         if p.is_file()]
                sizes += [p.stat().st_size for p in out_dir.glob(pin.sdist_filename)]
                done = max(sizes, default=0)
                if done != last and done > 0:
                    last = done
                    bar.update(done, total)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            bar.finish()
    output = logfile.read_text(errors="replace")
    if proc.returncode != 0:
        if "DO NOT MATCH THE HASHES" in output:
            got = re.search(r"Got\s+([0-9a-f]{64})", output)
            raise HashMismatchError(
                f"pip downloaded {pin.sdist_filename} with sha256 "
                f"{got.group(1) if got else '(unknown)'}, expected {pin.sha256} (pinned): "
                f"nothing was kept; check which index pip uses (pip config list) or pass "
                f"--sdist FILE with the genuine sdist"
            )
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise FetchError(
            f"pip could not download {pin.requirement.split(' ')[0]} "
            f"(exit {proc.returncode}):\n{tail}\n"
            f"fix: check network access and pip's index configuration, or pass --sdist FILE "
            f"(or set ROLLKV_SDIST) to a local copy of {pin.sdist_filename}"
        )
    got = out_dir / pin.sdist_filename
    if not got.is_file():
        raise FetchError(
            f"pip finished but {pin.sdist_filename} is not in its output: "
            f"pass --sdist FILE with a local copy"
        )
    return got


def fetch_sdist(settings: FetchSettings) -> Path:
    """Return the path of the verified sdist in the cache, downloading it if needed."""
    pin = settings.pin
    dest = settings.cached_sdist
    if dest.is_file():
        verify_sha256(dest, pin.sha256, delete=True, what="cached sdist")
        log.detail(f"using cached {dest}")
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent))
    except OSError as exc:
        if is_enospc(exc):
            raise disk_full_error(dest.parent, exc) from exc
        raise TargetError(
            f"cannot write the cache {dest.parent} ({exc.strerror}): set ROLLKV_CACHE to a "
            f"writable directory"
        ) from exc
    try:
        if settings.sdist is not None:
            if not settings.sdist.is_file():
                raise FetchError(f"--sdist {settings.sdist} does not exist: give the path of "
                                 f"{pin.sdist_filename}")
            verify_sha256(settings.sdist, pin.sha256, delete=False, what="given sdist")
            got = work / pin.sdist_filename
            shutil.copyfile(settings.sdist, got)
        else:
            got = _pip_download(settings, work)
        verify_sha256(got, pin.sha256, delete=True, what="downloaded sdist")
        os.replace(got, dest)
    except OSError as exc:
        if is_enospc(exc):
            raise disk_full_error(dest.parent, exc) from exc
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _safe_member_name(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not name.startswith("/") and ".." not in parts


def extract_tree(sdist: Path, dest: Path, pin: UpstreamPin = PIN) -> int:
    """Extract `pin.tree` from the sdist into `dest` (which must exist). Returns the file count.

    This is "the pristine tree": the files of the tree, minus the dangling `.git` gitlink.
    """
    prefix = f"{pin.sdist_root}/{pin.tree}/"
    selected: list[tarfile.TarInfo] = []
    try:
        tf = tarfile.open(sdist, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise FetchError(f"cannot read {sdist}: {exc}: delete it and fetch again") from exc
    with tf:
        for m in tf:
            if not m.name.startswith(prefix):
                continue
            rel = m.name[len(prefix):].rstrip("/")
            if not rel or ".git" in Path(rel).parts:
                # The sdist carries llama.cpp's submodule gitlink (`.git`, a file pointing
                # into llama-cpp-python's repository). It is dangling once extracted and
                # would make git and CMake treat the tree as a broken repository: drop it.
                continue
            if not _safe_member_name(rel) or m.isdev():
                raise FetchError(f"refusing unsafe member {m.name!r} in {sdist}")
            if m.islnk():
                if not m.linkname.startswith(prefix):
                    raise FetchError(f"refusing hard link {m.name!r} in {sdist}")
                m.linkname = m.linkname[len(prefix):]
            m.name = rel
            selected.append(m)
        if not selected:
            raise FetchError(f"{sdist} has no {prefix}: is it the pinned sdist?")
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, members=selected, filter="data")
        else:  # Python without extraction filters; names were checked above
            tf.extractall(dest, members=selected)
    return sum(1 for m in selected if m.isfile())
