"""Small helpers shared by the rollkv commands: hashing, locations, staging directories, and
atomic outputs (a unique temporary name next to the target, renamed into place on success and
removed on failure or interrupt, so two writers never share a file and nothing half-written is
left under a final name)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from pathlib import Path

from rollkv_dist.errors import RollkvError, TargetError, UsageError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The user cache: $ROLLKV_CACHE, else $XDG_CACHE_HOME/rollkv, else ~/.cache/rollkv."""
    env = os.environ if env is None else env
    if env.get("ROLLKV_CACHE"):
        return Path(env["ROLLKV_CACHE"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "rollkv"
    home = env.get("HOME")
    return (Path(home) if home else Path.home()) / ".cache" / "rollkv"


def repo_root() -> Path | None:
    """The checkout this package lives in (an editable install), if there is one."""
    here = Path(__file__).resolve().parent.parent
    if (here / "patches" / "series").is_file() and (here / "rollkv_dist").is_dir():
        return here
    return None


def git_head(repo: Path | None) -> str | None:
    """`git rev-parse HEAD` of a checkout, with `-dirty` when tracked files differ; None without git."""
    if repo is None or not (repo / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        from rollkv_dist.proc import run  # proc imports nothing of rollkv; util is imported first

        head = run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                   timeout=10, stdin=subprocess.DEVNULL)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        dirty = run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                    capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def default_patches_dir(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Path:
    """Where `patches/` is: $ROLLKV_PATCHES, else ./patches, else the checkout of this package."""
    env = os.environ if env is None else env
    if env.get("ROLLKV_PATCHES"):
        return Path(env["ROLLKV_PATCHES"]).expanduser()
    cwd = Path.cwd() if cwd is None else cwd
    if (cwd / "patches" / "series").is_file():
        return cwd / "patches"
    root = repo_root()
    if root is not None:
        return root / "patches"
    raise UsageError(
        "cannot find the patch series (patches/series): run rollkv from the repository root, "
        "or pass --patches DIR, or set ROLLKV_PATCHES"
    )


def resolve_jobs(jobs: int | None) -> int:
    """-j/--jobs: a number >= 1, or None for all CPUs (0 is refused rather than read as "all")."""
    if jobs is not None and jobs < 1:
        raise UsageError(f"-j/--jobs {jobs}: give a number of parallel jobs >= 1, or leave "
                         f"-j out to use all {os.cpu_count() or 1} CPUs")
    return jobs if jobs is not None else (os.cpu_count() or 1)


def check_empty_target(target: Path) -> None:
    """Refuse a target that exists and is not an empty directory."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise TargetError(f"{target} exists and is not a directory: choose a new path")
    if target.is_dir() and any(target.iterdir()):
        raise TargetError(
            f"{target} is not empty: choose a new directory or remove it first "
            f"(rollkv never writes into an existing tree)"
        )


def is_enospc(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_error(where: Path | None, exc: OSError) -> TargetError:
    """TargetError for ENOSPC/EDQUOT while writing under `where` (None: the place is unknown,
    and no path is named rather than a wrong one)."""
    if where is None:
        return TargetError(f"disk full ({exc.strerror}): free some space or choose a target on "
                           f"another filesystem (run with --debug to see where it happened)")
    try:
        probe = where
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        free_text = f"{free / 2**20:.0f} MiB free"
    except OSError:
        free_text = "free space unknown"
    return TargetError(
        f"disk full while writing under {where} ({exc.strerror}; {free_text}): "
        f"free some space or choose a target on another filesystem"
    )


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A new private directory in `parent` (created if needed); TargetError when that fails."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as exc:
        if is_enospc(exc):
            raise disk_full_error(parent, exc) from exc
        raise TargetError(f"cannot create a directory in {parent}: {exc.strerror}: "
                          f"choose a writable location") from exc


@contextlib.contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `target`; rename it to `target` on success.

    On any failure the temporary directory is removed, so nothing half-written is left.
    Disk-full errors become a TargetError.
    """
    target = target.absolute()
    check_empty_target(target)
    tmp = make_temp_dir(target.parent, f".{target.name}.rollkv-")
    try:
        try:
            yield tmp
        except OSError as exc:
            if is_enospc(exc):
                raise disk_full_error(target, exc) from exc
            raise
        os.chmod(tmp, 0o755)
        if target.is_dir():
            # Checked empty above; a concurrent writer would make rmdir fail, which is right.
            target.rmdir()
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(target: Path, *, replace: bool = True, mode: int | None = None) -> Iterator[Path]:
    """Yield a unique temporary path in `target`'s directory; rename it to `target` on success.

    The temporary file exists (empty) when the block starts; write it under any name-taking API.
    On success it gets `mode` (default: 0o666 minus the umask, like a new file) and is renamed
    to `target` atomically: with replace=False an existing target is refused (TargetError), even
    one another writer created meanwhile. On any failure or interrupt the temporary file is
    removed; disk-full errors become a TargetError naming the target's directory.
    """
    target = Path(target).absolute()
    parent = target.parent
    if target.is_dir():
        raise TargetError(f"{target} is a directory: give the path of a file to write")
    if not replace and (target.exists() or target.is_symlink()):
        raise TargetError(f"{target} exists: choose a new name or remove it first")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".rollkv-tmp", dir=parent)
    except OSError as exc:
        if is_enospc(exc):
            raise disk_full_error(parent, exc) from exc
        raise TargetError(f"cannot write in {parent} ({exc.strerror}): choose a writable "
                          f"location") from exc
    os.close(fd)
    tmp = Path(name)
    try:
        try:
            yield tmp
            os.chmod(tmp, (0o666 & ~_umask()) if mode is None else mode)
            if replace:
                os.replace(tmp, target)
            else:
                try:
                    os.link(tmp, target)  # no-clobber rename: fails if the target appeared
                except OSError as exc:
                    if is_enospc(exc):
                        raise
                    if isinstance(exc, FileExistsError) or target.exists():
                        raise TargetError(f"{target} was created by someone else while rollkv "
                                          f"wrote it: choose a new name") from None
                    os.replace(tmp, target)  # a filesystem without hard links
        except OSError as exc:
            if is_enospc(exc):
                raise disk_full_error(parent, exc) from exc
            raise
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(target: Path, text: str, **kwargs: bool) -> None:
    """Write `text` to `target` through atomic_path."""
    with atomic_path(target, **kwargs) as tmp:
        tmp.write_text(text)


class UnsafeArchiveError(RollkvError, code=6):
    """An archive member that would land outside the destination (or is a device)."""


def extract_all(tf: tarfile.TarFile, dest: Path, members: Iterable[tarfile.TarInfo] | None = None) -> None:
    """Every extraction of rollkv's: tarfile's "data" filter where this Python has it (3.10.12+, 3.11.4+,
    3.12+), else (Debian 12's 3.11.2, for one) the same refusals checked here first: an absolute or `..`
    name, a device or FIFO, a link that points outside `dest`. Nothing is extracted when a member is refused."""
    chosen = list(tf.getmembers() if members is None else members)
    if hasattr(tarfile, "data_filter"):
        tf.extractall(dest, members=chosen, filter="data")
        return
    root = Path(os.path.abspath(dest))
    for m in chosen:
        target = Path(os.path.abspath(root / m.name))
        bad = (m.name.startswith("/") or ".." in Path(m.name).parts or m.isdev() or m.isfifo()
               or root not in (target, *target.parents))
        if m.issym() or m.islnk():
            link = Path(os.path.abspath((target.parent if m.issym() else root) / m.linkname))
            bad = bad or m.linkname.startswith("/") or root not in (link, *link.parents)
        if bad:
            raise UnsafeArchiveError(f"refusing archive member {m.name!r} (it would land outside {root}, or is a "
                                     f"device or a link out of it)")
    tf.extractall(dest, members=chosen)


# modules of the optional extras (pyproject.toml [project.optional-dependencies]): module -> (distribution, extra)
OPTIONAL_MODULES = {
    "jinja2": ("jinja2", "channel"),
    "yaml": ("pyyaml", "channel"),
    "conda_package_handling.api": ("conda-package-handling", "channel"),
    "rattler": ("py-rattler", "channel"),
}


def optional_import(module: str, what: str) -> Any:
    """Import a module of an optional extra; missing, it is a UsageError with the line that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        dist, extra = OPTIONAL_MODULES[module]
        raise UsageError(f"{what} needs {dist}, from the `{extra}` extra: pip install 'rollkv-dist[{extra}]' "
                         f"(in a checkout: pip install -e '.[{extra}]')") from exc
