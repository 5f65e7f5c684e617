"""`rollkv pack OUT.tar.xz`: the patched source, trimmed to what a build needs, as one archive.

The archive builds on a GPU host with no network (`rollkv build --source DIR`, CPU or CUDA):
everything the CMake configure of the pinned tree reads with tests, examples, the app and the
web UI off stays; documentation, media, test data, other GPU vendors' backends, the UI sources
and all vocab files but `models/ggml-vocab-qwen2.gguf` (the tokenizer the random-weight model
writer uses) go. `gguf-py/` stays for the same writer. The archive also carries
ROLLKV-PROVENANCE.json and the patch queue (`patches/`), and is reproducible: sorted entries,
fixed owner and mtime ($SOURCE_DATE_EPOCH or 2000-01-01). `--with-tests` keeps upstream's `tests/`
(3 MB: test-llama-archs, which writes the archs gate's models, and test-backend-ops), for a
device build configured with `--cmake-arg=-DLLAMA_BUILD_TESTS=ON`.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollkv_dist.commands import add_command
from rollkv_dist import log
from rollkv_dist.errors import TargetError, UsageError
from rollkv_dist.fetch import FetchSettings
from rollkv_dist.pin import PIN
from rollkv_dist.series import (
    LAB_DIR,
    MANIFEST_FILE,
    PACKED_OUT_KEY,
    SERIES_FILE,
    Manifest,
    from_patch_on,
    read_series,
    tree_lab,
)
from rollkv_dist.source import (
    PROVENANCE_FILE,
    SourceSettings,
    add_fetch_arguments,
    add_patches_argument,
    add_selection_arguments,
    check_lab_selection,
    prepare_source,
    read_provenance,
)
from rollkv_dist.util import atomic_path, default_patches_dir

# Paths (relative to the tree root, '/'-separated) that are left out. A pattern matches a
# path or any of its parent directories. KEEP wins over DROP.
DROP = (
    "docs", "media", "benches", "examples", "pocs", "tests", "app", "ci", "skills",
    "conversion", "requirements", "requirements.txt", "convert_*.py", "build-xcframework.sh",
    "flake.nix", "CMakePresets.json", ".devops", ".github",
    "models",
    "tools/ui/src", "tools/ui/tests", "tools/ui/static", "tools/ui/package-lock.json",
    "tools/server/tests", "tools/server/bench", "tools/mtmd/tests", "tools/mtmd/test-*",
    "gguf-py/tests",
    # ggml backends of other vendors/platforms: only added when their GGML_<NAME> is ON
    "ggml/src/ggml-vulkan", "ggml/src/ggml-metal", "ggml/src/ggml-sycl", "ggml/src/ggml-opencl",
    "ggml/src/ggml-hexagon", "ggml/src/ggml-cann", "ggml/src/ggml-webgpu",
    "ggml/src/ggml-openvino", "ggml/src/ggml-et", "ggml/src/ggml-virtgpu",
    "ggml/src/ggml-zdnn", "ggml/src/ggml-zendnn", "ggml/src/ggml-musa", "ggml/src/ggml-hip",
    # build outputs that may sit in a tree (rollkv build's default build dirs)
    "build", "build-*", ".git",
    "**/__pycache__", "**/*.pyc",
)
KEEP = (
    "models/ggml-vocab-qwen2.gguf",
)
TESTS = "tests"  # kept with --with-tests (what a build with LLAMA_BUILD_TESTS=ON reads)
PATCHES_DIR_IN_ARCHIVE = "patches"
DEFAULT_EPOCH = 946684800  # 2000-01-01T00:00:00Z


def _matches(rel: str, pattern: str) -> bool:
    if pattern.startswith("**/"):
        return any(fnmatch.fnmatchcase(part, pattern[3:]) for part in rel.split("/"))
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        if fnmatch.fnmatchcase("/".join(parts[:i]), pattern):
            return True
    return False


def is_dropped(rel: str, keep: tuple[str, ...] = KEEP) -> bool:
    """Whether `rel` is left out: a DROP pattern matches it or a parent, unless it is in `keep`,
    inside one of them or a parent of one. Build outputs (`**/` patterns) go everywhere."""
    if any(_matches(rel, p) for p in DROP if p.startswith("**/")):
        return True
    if any(rel == k or k.startswith(rel + "/") or rel.startswith(k + "/") for k in keep):
        return False
    return any(_matches(rel, p) for p in DROP)


def iter_kept(tree: Path, keep: tuple[str, ...] = KEEP) -> Iterator[tuple[Path, str]]:
    """(path, relative name) of every kept file, directory and symlink, sorted, top-down."""
    def walk(d: Path, prefix: str) -> Iterator[tuple[Path, str]]:
        for entry in sorted(d.iterdir(), key=lambda p: p.name):
            rel = f"{prefix}{entry.name}"
            if is_dropped(rel, keep):
                continue
            yield entry, rel
            if entry.is_dir() and not entry.is_symlink():
                yield from walk(entry, rel + "/")
    yield from walk(tree, "")


@dataclass(frozen=True)
class PackSettings:
    out: Path
    source: Path | None
    """An existing tree; None: make one (fetch + series) in a temporary directory first."""
    patches_dir: Path
    without: tuple[str, ...]
    fetch: FetchSettings
    mtime: int
    root_name: str
    keep: tuple[str, ...] = KEEP  # paths kept although DROP matches them (KEEP, plus TESTS with --with-tests)
    lab: bool = False  # the lab overlay on top of the series (a comparison build's tree)

    @classmethod
    def resolve(cls, out: str, source: str | None, patches_dir: str | None = None,
                without: tuple[str, ...] = (), cache_dir: str | None = None,
                sdist: str | None = None, with_tests: bool = False, before: str | None = None,
                lab: bool = False) -> PackSettings:
        outp = Path(out).absolute()
        if not outp.name.endswith(".tar.xz"):
            raise UsageError(f"{out}: the archive name must end in .tar.xz")
        if outp.exists():
            raise TargetError(f"{outp} exists: choose a new name or remove it first")
        if source and (without or before or lab):
            raise UsageError("--without, --before and --lab apply when pack makes the source itself; "
                             "make the tree with `rollkv source --without/--before/--lab ...` instead")
        pdir = (Path(patches_dir) if patches_dir else default_patches_dir()).absolute()
        check_lab_selection(pdir, lab, bool(without or before))
        if before:
            without = (*without, *from_patch_on(read_series(pdir), before))
        epoch = int(os.environ.get("SOURCE_DATE_EPOCH", DEFAULT_EPOCH))
        return cls(out=outp, source=Path(source).absolute() if source else None,
                   patches_dir=pdir, without=tuple(without),
                   fetch=FetchSettings.resolve(cache_dir=cache_dir, sdist=sdist),
                   mtime=epoch, root_name=outp.name[: -len(".tar.xz")],
                   keep=KEEP + ((TESTS,) if with_tests else ()), lab=lab)


def _normalise(ti: tarfile.TarInfo, mtime: int) -> tarfile.TarInfo:
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.mtime = mtime
    ti.mode = (0o755 if ti.isdir() or ti.mode & 0o100 else 0o644) if not ti.issym() else ti.mode
    return ti


def packed_provenance(path: Path, patches_dir: Path, keep: tuple[str, ...]) -> bytes:
    """The tree's provenance plus `packed_out`: the files the series touches that this archive leaves out (a
    patch to upstream's tests/ in an archive without --with-tests), which the build's check of the patched tree
    then expects absent."""
    data = json.loads(path.read_text())
    manifest = Manifest.load(patches_dir)
    data[PACKED_OUT_KEY] = sorted(rel for rel in (manifest.files if manifest else {}) if is_dropped(rel, keep))
    return (json.dumps(data, indent=2) + "\n").encode()


def write_archive(tree: Path, patches_dir: Path, out: Path, root: str, mtime: int,
                  keep: tuple[str, ...] = KEEP) -> int:
    """Write the trimmed tree (plus patches/) to `out`; returns the number of files."""
    if not (tree / "CMakeLists.txt").is_file():
        raise UsageError(f"{tree} is not a llama.cpp source tree (no CMakeLists.txt)")
    if not (tree / PROVENANCE_FILE).is_file():
        raise UsageError(f"{tree} has no {PROVENANCE_FILE}: make the tree with `rollkv source`")
    count = 0
    # a unique temporary name next to OUT, renamed to OUT only when complete (and only if no
    # one else created OUT meanwhile): two packs never share a file, an interrupt leaves nothing
    with atomic_path(out, replace=False) as tmp, \
            tarfile.open(tmp, "w:xz", preset=9, format=tarfile.PAX_FORMAT) as tf:
        tf.add(tree, arcname=root, recursive=False,
               filter=lambda ti: _normalise(ti, mtime))
        for path, rel in iter_kept(tree, keep):
            if rel == PATCHES_DIR_IN_ARCHIVE or rel.startswith(PATCHES_DIR_IN_ARCHIVE + "/"):
                continue
            if rel == PROVENANCE_FILE:  # with the touched files this archive leaves out, for the build's check
                blob = packed_provenance(path, patches_dir, keep)
                ti = _normalise(tf.gettarinfo(path, arcname=f"{root}/{rel}"), mtime)
                ti.size = len(blob)
                tf.addfile(ti, io.BytesIO(blob))
                count += 1
                continue
            tf.add(path, arcname=f"{root}/{rel}", recursive=False,
                   filter=lambda ti: _normalise(ti, mtime))
            count += path.is_file()
        names = read_series(patches_dir)
        pfiles = [SERIES_FILE, *names]
        if (patches_dir / MANIFEST_FILE).is_file():
            pfiles.append(MANIFEST_FILE)
        tf.add(patches_dir, arcname=f"{root}/{PATCHES_DIR_IN_ARCHIVE}", recursive=False,
               filter=lambda ti: _normalise(ti, mtime))
        lab = tree_lab(tree)
        if lab:  # a lab tree carries its overlay, as the tree carries its series
            tf.add(patches_dir / LAB_DIR, arcname=f"{root}/{PATCHES_DIR_IN_ARCHIVE}/{LAB_DIR}", recursive=False,
                   filter=lambda ti: _normalise(ti, mtime))
            pfiles += [f"{LAB_DIR}/{f}" for f in (SERIES_FILE, MANIFEST_FILE, *lab)]
        for f in sorted(pfiles):
            tf.add(patches_dir / f, arcname=f"{root}/{PATCHES_DIR_IN_ARCHIVE}/{f}",
                   filter=lambda ti: _normalise(ti, mtime))
            count += 1
    return count


def make_parents(out: Path) -> list[Path]:
    """The missing folders above `out`, made (outermost first); what was made, for removal if the pack fails."""
    missing, d = [], out.parent
    while not d.exists() and not d.is_symlink():
        missing.append(d)
        d = d.parent
    if not d.is_dir():
        raise TargetError(f"{out}: {d} is not a folder")
    for m in reversed(missing):
        m.mkdir()
    if missing:
        log.info(f"made {missing[0]} for the archive")
    return missing


def run_pack(settings: PackSettings) -> Path:
    tmpdir = None
    made = make_parents(settings.out)
    packed = False
    try:
        if settings.source is None:
            tmpdir = Path(tempfile.mkdtemp(prefix=".rollkv-pack-", dir=settings.out.parent))
            tree = prepare_source(SourceSettings(
                target=tmpdir / "src", patches_dir=settings.patches_dir,
                without=settings.without, fetch=settings.fetch, lab=settings.lab))
        else:
            tree = settings.source
        prov = read_provenance(tree) or {}
        with log.step(f"Packing {tree} into {settings.out.name}"):
            n = write_archive(tree, settings.patches_dir, settings.out, settings.root_name,
                              settings.mtime, settings.keep)
        size = settings.out.stat().st_size
        log.info(f"{settings.out}: {n} files, {size / 1e6:.1f} MB "
                 f"({PIN.project} {PIN.version}, series of {len(prov.get('series', []))})")
        print(f"{settings.out}\t{size}")
        packed = True
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
        if made and not packed:  # nothing half-done: the folders made for a pack that failed go too
            shutil.rmtree(made[-1], ignore_errors=True)
    return settings.out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "pack", "archive the patched, trimmed source for offline builds",
                    "Write OUT.tar.xz: the patched llama.cpp tree trimmed to what builds need, with "
                    "ROLLKV-PROVENANCE.json and patches/. Without --source the tree is made first, as "
                    "`rollkv source` would.",
                    lambda a: run_pack(PackSettings.resolve(a.out, a.source, a.patches, tuple(a.without or ()),
                                                            a.cache_dir, a.sdist, a.with_tests, a.before, a.lab)))
    p.add_argument("out", help="archive to write (NAME.tar.xz; NAME becomes the top folder)")
    p.add_argument("--source", help="existing tree made by `rollkv source`")
    add_selection_arguments(p)
    p.add_argument("--with-tests", action="store_true",
                   help="keep upstream's tests/ (test-llama-archs for the archs gate; build with "
                        "--cmake-arg=-DLLAMA_BUILD_TESTS=ON)")
    add_patches_argument(p)
    add_fetch_arguments(p)
