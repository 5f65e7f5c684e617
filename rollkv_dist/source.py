"""`rollkv source DIR`: the pinned llama.cpp tree with the patch series applied and verified."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rollkv_dist.commands import add_command
from rollkv_dist import __version__, log
from rollkv_dist.fetch import FetchSettings, extract_tree, fetch_sdist
from rollkv_dist.pin import PIN
from rollkv_dist.errors import UsageError
from rollkv_dist.series import (
    LAB_DIR,
    LAB_KEY,
    PROVENANCE_FILE,
    Manifest,
    apply_series,
    check_patches_match_manifest,
    pin_info,
    read_lab,
    read_series,
    select_series,
    from_patch_on,
    tree_provenance,
    verify_lab_tree,
    verify_tree,
)
from rollkv_dist.util import check_empty_target, default_patches_dir, git_head, sha256_file, staged_directory

PROVENANCE_SCHEMA = 1


@dataclass(frozen=True)
class SourceSettings:
    target: Path
    patches_dir: Path
    without: tuple[str, ...]
    fetch: FetchSettings
    lab: bool = False  # the lab overlay (patches/lab/) on top of the series: comparison builds only

    @classmethod
    def resolve(
        cls,
        target: str | os.PathLike[str],
        patches_dir: str | os.PathLike[str] | None = None,
        without: tuple[str, ...] | list[str] = (),
        cache_dir: str | os.PathLike[str] | None = None,
        sdist: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        before: str | None = None,
        lab: bool = False,
    ) -> SourceSettings:
        """`before`: the series as it stood before that patch (it and every later patch left out). `lab`: the lab
        overlay on top of the whole series."""
        pdir = Path(patches_dir) if patches_dir else default_patches_dir(env)
        check_lab_selection(pdir, lab, bool(without or before))
        if before:
            without = (*without, *from_patch_on(read_series(pdir), before))
        return cls(
            target=Path(target).absolute(),
            patches_dir=pdir.absolute(),
            without=tuple(dict.fromkeys(without)),
            fetch=FetchSettings.resolve(cache_dir=cache_dir, sdist=sdist, env=env),
            lab=lab,
        )


def check_lab_selection(patches_dir: Path, lab: bool, leaves_out: bool) -> None:
    """--lab needs an overlay, and the whole series under it (it was written on top of every patch)."""
    if not lab:
        return
    if leaves_out:
        raise UsageError("--lab applies the lab overlay on top of the whole series: leave out --without/--before")
    if not read_lab(patches_dir):
        raise UsageError(f"--lab: {patches_dir / LAB_DIR} has no overlay (no series file or an empty one)")


def read_provenance(tree: Path) -> dict | None:
    """The tree's provenance; None where it has none (or an unreadable one)."""
    return tree_provenance(Path(tree)) or None


def prepare_source(settings: SourceSettings) -> Path:
    """Fetch, extract, patch, verify, record provenance; the tree appears at target atomically."""
    check_empty_target(settings.target)
    names = read_series(settings.patches_dir)
    applied = select_series(names, settings.without)
    lab = read_lab(settings.patches_dir) if settings.lab else []
    manifest = Manifest.load(settings.patches_dir)
    check_patches_match_manifest(settings.patches_dir, names, manifest, settings.fetch.pin)

    with log.step(f"Fetching {PIN.project} {PIN.version} (sha256 {PIN.sha256[:12]}...)"):
        sdist = fetch_sdist(settings.fetch)
        log.info(f"sdist: {sdist}")

    with staged_directory(settings.target) as tmp:
        with log.step(f"Extracting {PIN.tree} (llama.cpp {PIN.llama_commit})"):
            n = extract_tree(sdist, tmp, settings.fetch.pin)
            log.info(f"{n} files")
        with log.step(f"Applying {len(applied)} patches"
                      + (f" (without {', '.join(settings.without)})" if settings.without else "")):
            for name in applied:
                log.info(name)
            apply_series(tmp, settings.patches_dir, applied)
        if lab:
            with log.step(f"Applying the lab overlay's {len(lab)} patches (a comparison build, not the product)"):
                for name in lab:
                    log.info(f"{LAB_DIR}/{name}")
                apply_series(tmp, settings.patches_dir / LAB_DIR, lab)
        with log.step("Verifying against patches/manifest.json" + (f" and {LAB_DIR}/manifest.json" if lab else "")):
            if manifest is None:
                status, checked, skipped = "empty-series", 0, ()
            else:
                res = (verify_lab_tree(tmp, settings.patches_dir, lab, settings.fetch.pin) if lab
                       else verify_tree(tmp, manifest, settings.without))
                status, checked, skipped = res.status, res.checked, res.skipped
            log.info(f"{status}: {checked} files checked"
                     + (f", {len(skipped)} skipped (touched by excluded patches)" if skipped else ""))
        provenance = {
            "schema": PROVENANCE_SCHEMA,
            "tool": {"name": "rollkv", "version": __version__},
            "rollkv_commit": git_head(settings.patches_dir.parent),
            "pin": pin_info(settings.fetch.pin),
            "series": applied,
            "excluded": list(settings.without),
            LAB_KEY: lab,
            "patches": {n: sha256_file(settings.patches_dir / n) for n in applied}
            | {f"{LAB_DIR}/{n}": sha256_file(settings.patches_dir / LAB_DIR / n) for n in lab},
            "manifest": {
                "status": status,
                "checked_files": checked,
                "skipped_files": list(skipped),
                "note": ("files touched by excluded patches were not verified"
                         if skipped else ""),
            },
            "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    log.info(f"source tree ready: {settings.target}")
    return settings.target


def add_fetch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", help="cache for the sdist (default: $ROLLKV_CACHE, "
                   "$XDG_CACHE_HOME/rollkv or ~/.cache/rollkv)")
    p.add_argument("--sdist", help="use this local copy of the pinned sdist (checked against the "
                   "pin) instead of downloading; also $ROLLKV_SDIST")


def add_selection_arguments(p: argparse.ArgumentParser) -> None:
    """--without and --before: which patches of the series a tree leaves out."""
    p.add_argument("--without", action="append", metavar="PATCH",
                   help="leave this patch out of the series (repeatable); files it touches are "
                        "not verified against the manifest")
    p.add_argument("--before", metavar="PATCH",
                   help="the series as it stood before PATCH: it and every later patch left out (the gates' "
                        "baseline without the compute-reserve patch is --before 0089-rolling-kv-compute-reserve.patch)")
    p.add_argument("--lab", action="store_true",
                   help=f"apply the lab overlay (patches/{LAB_DIR}/: switches for comparison builds) on top of the "
                        "whole series; never for a package")


def add_patches_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--patches", metavar="DIR", help="patch queue directory (default: "
                   "$ROLLKV_PATCHES, ./patches, or the checkout's patches/)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "source", "fetch the pinned llama.cpp, apply the patch series, verify",
                    "Fetch the pinned sdist, extract vendor/llama.cpp into DIR, apply patches/series (and with "
                    "--lab the lab overlay), verify against patches/manifest.json and write DIR/{PROVENANCE_FILE}. DIR must not exist or be empty.",
                    lambda a: prepare_source(SourceSettings.resolve(
                        target=a.dir, patches_dir=a.patches, without=a.without or (), cache_dir=a.cache_dir,
                        sdist=a.sdist, before=a.before, lab=a.lab)))
    p.add_argument("dir", help="target directory (new or empty)")
    add_selection_arguments(p)
    add_patches_argument(p)
    add_fetch_arguments(p)
