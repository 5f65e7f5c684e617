"""Fetch the pinned upstream sdist through pip, cache it, verify it, extract the llama.cpp tree.

pip is the only client that talks to a package index; which index it uses is pip's own
configuration. The requirement goes through a requirements file with ``--require-hashes``,
and rollkv checks the sha256 again itself before anything uses the file.

Note on speed: ``pip download`` of an sdist always prepares the package metadata (it installs
the build backend in an isolated environment and asks it for metadata); pip has no flag to
skip that, even with ``--no-deps`` (a long-standing open pip issue). For this sdist it costs a
few seconds, and it happens only on a cache miss. Only the pinned project is forced to a
source distribution (``--no-binary <project>``): ``--no-binary :all:`` also applies to the
build tools pip installs for that metadata step, and on a cold pip cache pip then compiles
CMake from source (more than 10 minutes).

A local copy (``--sdist FILE`` or ``$ROLLKV_SDIST``, a file or a directory holding it) comes
before the cache: it is checked against the pin and, when good, replaces a missing or corrupt
cached copy.
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

from rollkv_dist import log, proc
from rollkv_dist.errors import FetchError, HashMismatchError, TargetError
from rollkv_dist.pin import PIN, UpstreamPin
from rollkv_dist.util import atomic_path, disk_full_error, extract_all, is_enospc, sha256_file
from rollkv_dist.util import cache_dir as default_cache_dir


@dataclass(frozen=True)
class FetchSettings:
    cache_dir: Path
    pin: UpstreamPin = PIN
    python: str = sys.executable
    sdist: Path | None = None
    """A local copy of the sdist to use instead of downloading (checked against the pin)."""
    sdist_origin: str = "--sdist"
    """Where `sdist` came from, for messages: '--sdist' or '$ROLLKV_SDIST'."""

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
            sdist_origin="--sdist" if sdist else "$ROLLKV_SDIST",
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
               "rollkv_dist/pin.toml)")
    else:
        fix = "use the genuine sdist of the pinned version"
    raise HashMismatchError(
        f"{what} {path} has sha256 {actual}, expected {expected} (pinned): {fix}"
    )


def pip_command(settings: FetchSettings, requirements: Path, out_dir: Path) -> list[str]:
    """`pip download` of exactly the pinned sdist: hash-checked, no dependencies, and only the
    pinned project forced to a source distribution (the metadata step's build tools come as
    wheels)."""
    return [
        settings.python, "-m", "pip", "download",
        "--no-deps", "--no-binary", settings.pin.project, "--require-hashes",
        "--no-cache-dir", "--progress-bar", "off", "--disable-pip-version-check",
        "-r", str(requirements), "-d", str(out_dir),
    ]


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # pip creates and deletes its temporary folders while we look
        return 0


def downloaded_bytes(pip_tmp: Path, out_dir: Path, filename: str) -> int:
    """Bytes of `filename` pip has written so far: in the output folder, or in one of pip's
    own temporary folders one level below `pip_tmp` (pip-unpack-*), which pip deletes at any
    moment. Never raises: a progress display must not stop the download."""
    sizes = [_file_size(out_dir / filename)]
    try:
        with os.scandir(pip_tmp) as it:
            for entry in it:
                sizes.append(_file_size(Path(entry.path) / filename))
    except OSError:
        pass
    return max(sizes)


def _pip_download(settings: FetchSettings, workdir: Path) -> Path:
    pin = settings.pin
    req = workdir / "requirements.txt"
    req.write_text(pin.requirement + "\n")
    out_dir = workdir / "out"
    pip_tmp = workdir / "tmp"
    out_dir.mkdir()
    pip_tmp.mkdir()
    logfile = workdir / "pip.log"
    cmd = pip_command(settings, req, out_dir)
    env = dict(os.environ, TMPDIR=str(pip_tmp), PIP_NO_INPUT="1")
    bar = log.progress(f"downloading {pin.sdist_filename}", unit="bytes")
    size_re = re.compile(r"\(([\d.]+)\s*(kB|MB|GB)\)")
    scale = {"kB": 1e3, "MB": 1e6, "GB": 1e9}
    with open(logfile, "w") as lf:
        with proc.running(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          env=env) as p:
            last = -1
            try:
                while p.poll() is None:
                    time.sleep(0.5)
                    m = size_re.search(logfile.read_text(errors="replace"))
                    total = float(m.group(1)) * scale[m.group(2)] if m else None
                    done = downloaded_bytes(pip_tmp, out_dir, pin.sdist_filename)
                    if done != last and done > 0:
                        last = done
                        bar.update(done, total)
            finally:
                bar.finish()
    output = logfile.read_text(errors="replace")
    if p.returncode != 0:
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
            f"(exit {p.returncode}):\n{tail}\n"
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


def local_sdist(settings: FetchSettings) -> Path:
    """The verified local copy named by --sdist / $ROLLKV_SDIST (a file, or a directory that
    holds the pinned file name)."""
    pin, given, origin = settings.pin, settings.sdist, settings.sdist_origin
    assert given is not None
    path = given / pin.sdist_filename if given.is_dir() else given
    if given.is_dir() and not path.is_file():
        raise FetchError(f"{origin} {given} is a directory without {pin.sdist_filename}: "
                         f"put the pinned sdist there or give the file's path")
    if not path.is_file():
        raise FetchError(f"{origin} {given} does not exist: give the path of "
                         f"{pin.sdist_filename} (or of a directory holding it)")
    verify_sha256(path, pin.sha256, delete=False, what=f"{origin} file")
    return path


def _cache_is_good(dest: Path, sha256: str) -> bool:
    try:
        return dest.is_file() and sha256_file(dest) == sha256
    except OSError:
        return False


def fetch_sdist(settings: FetchSettings) -> Path:
    """Return the path of the verified sdist, downloading it into the cache if needed.

    A local copy (--sdist / $ROLLKV_SDIST) wins over the cache: it is verified, and copied into
    the cache when the cached file is missing or bad (a cache that cannot be written is only a
    warning then). Without one, a cached copy is verified (a bad one is deleted and named) and
    otherwise pip downloads the file.
    """
    pin = settings.pin
    dest = settings.cached_sdist
    if settings.sdist is not None:
        given = local_sdist(settings)
        if _cache_is_good(dest, pin.sha256):
            log.detail(f"using {given} (the cached copy {dest} is the same file)")
            return dest
        try:
            with atomic_path(dest) as tmp:
                shutil.copyfile(given, tmp)
        except (OSError, TargetError) as exc:
            log.warn(f"cannot put {given.name} into the cache {dest.parent} ({exc}); using {given}")
            return given
        log.detail(f"using {given} (copied into the cache {dest})")
        return dest
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
        extract_all(tf, dest, selected)
    return sum(1 for m in selected if m.isfile())
