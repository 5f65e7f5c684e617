"""`rollkv patches edit|export|check`: the patch queue as a git repository.

* ``edit DIR``: the pristine pinned tree as a git repository (one base commit), then one commit
  per patch applied with ``git am`` (author, date and message kept, committer date = author
  date), so the commits and the regenerated patches are stable.
* ``export DIR``: regenerate ``patches/*.patch``, ``patches/series`` and ``patches/manifest.json``
  from any git repository whose first commit is the pristine tree. File names are
  ``NNNN-kebab-subject.patch``; a commit with a trailer ``Rollkv-Patch: NNNN-name`` keeps that
  name (and number). Commits with the trailer ``Rollkv-Queue: lab`` (after every other) are the
  lab overlay: ``patches/lab/``, numbered apart, which only ``rollkv source --lab`` applies.
* ``check``: rebuild the queue from the pristine tree and ``patches/``, export it again and
  require a byte-for-byte identical result; verify the manifest.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rollkv_dist.commands import add_command
from rollkv_dist import log
from rollkv_dist.proc import run as run_process
from rollkv_dist.errors import PatchError, UsageError
from rollkv_dist.fetch import FetchSettings, extract_tree, fetch_sdist
from rollkv_dist.pin import PIN, UpstreamPin
from rollkv_dist.series import (
    LAB_DIR,
    MANIFEST_FILE,
    QUEUE_TRAILER,
    QUEUE_TRAILER_RE,
    TRAILER,
    TRAILER_RE,
    PATCH_NAME_RE,
    SERIES_FILE,
    Manifest,
    check_patches_match_manifest,
    explain_apply_failure,
    git_env,
    make_manifest,
    read_lab,
    read_series,
    verify_lab_tree,
    verify_tree,
)
from rollkv_dist.source import add_fetch_arguments, add_patches_argument
from rollkv_dist.util import atomic_path, atomic_write_text, default_patches_dir, sha256_bytes, staged_directory

BASE_DATE = "2000-01-01T00:00:00+0000"
FORMAT_PATCH_ARGS = (
    "format-patch", "--stdout", "--zero-commit", "--no-signature", "--no-numbered",
    "--full-index", "--no-renames", "--diff-algorithm=myers", "--no-color", "--binary",
)


def base_message(pin: UpstreamPin = PIN) -> str:
    return f"upstream llama.cpp {pin.llama_commit} ({pin.project} {pin.version})"


def _identity_env(tree: Path) -> dict[str, str]:
    env = git_env(tree)
    env.update(GIT_AUTHOR_NAME="rollkv", GIT_AUTHOR_EMAIL="rollkv@localhost",
               GIT_COMMITTER_NAME="rollkv", GIT_COMMITTER_EMAIL="rollkv@localhost")
    return env


def git(repo: Path, *args: str, env: Mapping[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[bytes]:
    proc = run_process(["git", *args], cwd=repo, env=dict(env or git_env(repo)), capture_output=True,
                       stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise PatchError(f"git {' '.join(args[:3])} failed in {repo}: "
                         f"{proc.stderr.decode(errors='replace').strip()}")
    return proc


def git_text(repo: Path, *args: str) -> str:
    return git(repo, *args).stdout.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- edit


def make_queue_repo(tree: Path, sdist: Path, patches_dir: Path, names: list[str],
                    pin: UpstreamPin = PIN, lab: list[str] | tuple[str, ...] = ()) -> None:
    """Turn the empty directory `tree` into the queue repository: base commit + one per patch, then one per
    patch of the lab overlay `lab` (patches/lab/)."""
    extract_tree(sdist, tree, pin)
    env = _identity_env(tree)
    git(tree, "-c", "init.defaultBranch=rollkv", "init", "-q", env=env)
    git(tree, "add", "--all", "--force", ".", env=env)
    base_env = dict(env, GIT_AUTHOR_DATE=BASE_DATE, GIT_COMMITTER_DATE=BASE_DATE)
    git(tree, "commit", "-q", "--no-verify", "-m", base_message(pin), env=base_env)
    git(tree, "tag", "rollkv-base", env=env)
    for n in [*names, *(f"{LAB_DIR}/{x}" for x in lab)]:
        patch = (patches_dir / n).absolute()
        proc = git(tree, "am", "-q", "--keep-cr", "--no-3way", "--whitespace=nowarn",
                   "--committer-date-is-author-date", str(patch), env=env, check=False)
        if proc.returncode != 0:
            split = tree / ".git" / "rebase-apply" / "patch"  # the diff git am split off the mail
            applied = split.read_text(errors="replace") if split.is_file() else ""
            git(tree, "am", "--abort", env=env, check=False)
            msg = explain_apply_failure(n, patch.read_text(errors="replace"),
                                        proc.stderr.decode(errors="replace")
                                        + proc.stdout.decode(errors="replace"), applied_text=applied)
            raise PatchError(f"{msg}: the patch must apply to the pinned tree without fuzz; "
                             f"fix it in a queue made without it, or drop it from the series")


# --------------------------------------------------------------------------- export


@dataclass(frozen=True)
class ExportedPatch:
    name: str
    commit: str
    content: bytes
    lab: bool = False  # a patch of the lab overlay (patches/lab/)


def kebab(subject: str, limit: int = 52) -> str:
    s = re.sub(r"^\[[^\]]*\]\s*", "", subject.strip())
    s = re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")
    if len(s) > limit:
        cut = s[:limit]
        s = cut.rsplit("-", 1)[0] if "-" in cut[limit // 2:] else cut
    return s.strip("-") or "patch"


def trailer_name(message: str) -> str | None:
    found = TRAILER_RE.findall(message)
    if not found:
        return None
    name = found[-1]
    if not name.endswith(".patch"):
        name += ".patch"
    if not PATCH_NAME_RE.match(name):
        raise UsageError(f"trailer '{TRAILER}: {found[-1]}' is not NNNN-kebab-name: "
                         f"fix the commit message")
    return name


def plan_names(commits: list[tuple[str, str, str | None]]) -> list[str]:
    """Names for (commit, subject, trailer name) in order.

    A trailer fixes the name; otherwise the number is the previous patch's plus one and the
    rest comes from the subject. Numbers must increase strictly.
    """
    names: list[str] = []
    prev = 0
    fixed = {int(t[:4]) for _, _, t in commits if t}
    for commit, subject, tname in commits:
        if tname:
            num = int(tname[:4])
            name = tname
        else:
            num = prev + 1
            if num in fixed:
                raise UsageError(
                    f"commit {commit[:12]} ({subject!r}) would be numbered {num:04d}, which a "
                    f"'{TRAILER}:' trailer of a later commit already uses: give this commit a "
                    f"trailer with a free number")
            name = f"{num:04d}-{kebab(subject)}.patch"
        if num <= prev:
            raise UsageError(
                f"commit {commit[:12]} ({subject!r}) has number {num:04d}, not above the "
                f"previous patch's {prev:04d}: patch numbers must increase along the series; "
                f"fix the '{TRAILER}:' trailers or reorder the commits")
        prev = num
        names.append(name)
    return names


def queue_commits(repo: Path) -> tuple[str, list[str]]:
    """(root commit, commits after it in order) of the repository at `repo`."""
    proc = git(repo, "rev-parse", "--is-inside-work-tree", check=False)
    if proc.returncode != 0:
        raise UsageError(f"{repo} is not a git repository: make one with "
                         f"`rollkv patches edit {repo}`")
    roots = git_text(repo, "rev-list", "--max-parents=0", "HEAD").split()
    if len(roots) != 1:
        raise UsageError(f"{repo} has {len(roots)} root commits; the queue needs exactly one "
                         f"(the pristine tree)")
    root = roots[0]
    merges = git_text(repo, "rev-list", "--min-parents=2", f"{root}..HEAD").split()
    if merges:
        raise UsageError(f"{repo} has merge commits ({merges[0][:12]}...): the queue must be "
                         f"linear; rebase it")
    commits = git_text(repo, "rev-list", "--reverse", "--topo-order", f"{root}..HEAD").split()
    return root, commits


def export_patches(repo: Path) -> list[ExportedPatch]:
    repo = repo.absolute()
    env = git_env(repo)
    _, commits = queue_commits(repo)
    dirty = git_text(repo, "status", "--porcelain", "--untracked-files=no").strip()
    if dirty:
        raise UsageError(f"{repo} has uncommitted changes ({dirty.splitlines()[0].strip()} ...):"
                         f" commit or stash them first; export reads commits only")
    info = []
    lab = []
    for c in commits:
        subject = git_text(repo, "log", "-1", "--format=%s", c).strip()
        message = git_text(repo, "log", "-1", "--format=%B", c)
        in_lab = QUEUE_TRAILER_RE.search(message) is not None
        if lab and not in_lab:
            raise UsageError(f"commit {c[:12]} ({subject!r}) follows a lab overlay commit ({lab[0][1]!r}) but is "
                             f"not one ('{QUEUE_TRAILER}: lab'): move the lab commits to the end of the queue")
        (lab if in_lab else info).append((c, subject, trailer_name(message)))
    out = []
    for group, is_lab in ((info, False), (lab, True)):
        for (c, subject, _), name in zip(group, plan_names(group), strict=True):
            content = git(repo, *FORMAT_PATCH_ARGS, "-1", c, env=env).stdout
            if b"\ndiff --git " not in content:
                raise UsageError(f"commit {c[:12]} ({subject!r}) changes nothing: drop it")
            out.append(ExportedPatch(name, c, content, is_lab))
    return out


def _states_at(repo: Path, rev: str, paths: list[str]) -> dict[str, str | None]:
    """sha256 (or symlink target) of each path in commit `rev`; None when absent."""
    states: dict[str, str | None] = {}
    if not paths:
        return states
    listing = git(repo, "ls-tree", "-r", "-z", rev, "--", *paths).stdout.split(b"\0")
    entries: dict[str, tuple[str, str]] = {}
    for item in listing:
        if not item:
            continue
        meta, path = item.split(b"\t", 1)
        mode, _type, oid = meta.decode().split()
        entries[path.decode("utf-8", errors="surrogateescape")] = (mode, oid)
    for p in paths:
        if p not in entries:
            states[p] = None
            continue
        mode, oid = entries[p]
        blob = git(repo, "cat-file", "blob", oid).stdout
        states[p] = ("symlink:" + blob.decode("utf-8", errors="replace")
                     if mode == "120000" else sha256_bytes(blob))
    return states


def _write_dir(repo: Path, out_dir: Path, patches: list[ExportedPatch], rev: str, pin: UpstreamPin) -> list[str]:
    """patches, series and a manifest of the files' states in commit `rev` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [p.name for p in patches]
    manifest = make_manifest([(p.name, p.content) for p in patches], lambda paths: _states_at(repo, rev, paths), pin)
    for old in out_dir.iterdir():
        if old.is_file() and PATCH_NAME_RE.match(old.name) and old.name not in names:
            old.unlink()
    for p in patches:
        with atomic_path(out_dir / p.name) as tmp:
            tmp.write_bytes(p.content)
    atomic_write_text(out_dir / SERIES_FILE, "".join(n + "\n" for n in names))
    atomic_write_text(out_dir / MANIFEST_FILE, manifest.to_json())
    return names


def write_queue(repo: Path, out_dir: Path, pin: UpstreamPin = PIN) -> list[str]:
    """Export the queue of `repo` into `out_dir`: patches, series, manifest (the files as the series leaves them),
    and the lab overlay's into out_dir/lab (the files as series + overlay leave them; the folder is removed where
    the queue has no lab commits). Returns the series' names."""
    patches = export_patches(repo)
    series = [p for p in patches if not p.lab]
    lab = [p for p in patches if p.lab]
    names = _write_dir(repo, out_dir, series, series[-1].commit if series else "HEAD", pin)
    lab_dir = out_dir / LAB_DIR
    if lab:
        _write_dir(repo, lab_dir, lab, "HEAD", pin)
    elif lab_dir.is_dir():
        for old in lab_dir.iterdir():
            if old.is_file() and (PATCH_NAME_RE.match(old.name) or old.name in (SERIES_FILE, MANIFEST_FILE)):
                old.unlink()
        if not any(lab_dir.iterdir()):
            lab_dir.rmdir()
    return names


# --------------------------------------------------------------------------- check


def compare_queues(expected: Path, actual: Path) -> list[str]:
    """Differences between two patch directories (series, manifest, *.patch), as messages."""
    def files(d: Path) -> set[str]:
        return {f.name for f in d.iterdir() if f.is_file() and
                (f.name in (SERIES_FILE, MANIFEST_FILE) or PATCH_NAME_RE.match(f.name))}

    exp, act = files(expected), files(actual)
    problems = []
    for name in sorted(exp - act):
        problems.append(f"{name}: would be generated but is missing from {actual}")
    for name in sorted(act - exp):
        problems.append(f"{name}: in {actual} but not generated by the series (stale file?)")
    for name in sorted(exp & act):
        a, b = (actual / name).read_bytes(), (expected / name).read_bytes()
        if a != b:
            diff = list(difflib.unified_diff(
                a.decode(errors="replace").splitlines(), b.decode(errors="replace").splitlines(),
                f"{actual.name}/{name}", f"regenerated/{name}", lineterm="", n=1))
            problems.append(f"{name} differs from its regeneration:\n" + "\n".join(diff[:20]))
    return problems


def check_queue(patches_dir: Path, fetch: FetchSettings, workdir: Path | None = None) -> int:
    names = read_series(patches_dir)
    lab = read_lab(patches_dir)
    manifest = Manifest.load(patches_dir)
    check_patches_match_manifest(patches_dir, names, manifest, fetch.pin)
    with log.step(f"Fetching {fetch.pin.project} {fetch.pin.version}"):
        sdist = fetch_sdist(fetch)
    tmp = Path(tempfile.mkdtemp(prefix="rollkv-check-", dir=workdir))
    try:
        tree = tmp / "tree"
        tree.mkdir()
        with log.step(f"Applying {len(names)} patches to the pristine tree with git am"
                      + (f", then the lab overlay's {len(lab)}" if lab else "")):
            make_queue_repo(tree, sdist, patches_dir, names, fetch.pin, lab)
        with log.step("Verifying the tree against the manifest" + (" and the lab overlay's" if lab else "")):
            if manifest is not None:
                res = verify_lab_tree(tree, patches_dir, lab, fetch.pin) if lab else verify_tree(tree, manifest)
                log.info(f"{res.status}: {res.checked} files")
        with log.step("Regenerating the queue and comparing byte for byte"):
            out = tmp / "patches"
            write_queue(tree, out, fetch.pin)
            if not names and manifest is None:
                # an empty series needs no manifest (export writes one, check does not insist)
                (out / MANIFEST_FILE).unlink()
            problems = compare_queues(out, patches_dir)
            if lab:
                problems += [f"{LAB_DIR}/{p}" for p in compare_queues(out / LAB_DIR, patches_dir / LAB_DIR)]
        if problems:
            raise PatchError(
                f"{patches_dir} differs from what the series regenerates:\n"
                + "\n".join(f"  - {p}" for p in problems)
                + "\nfix: `rollkv patches edit DIR` then `rollkv patches export DIR`, "
                  "and commit the result")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(f"{patches_dir} is up to date: {len(names)} patches"
             + (f" and the lab overlay's {len(lab)}" if lab else "") + " regenerate byte for byte")
    return 0


# --------------------------------------------------------------------------- commands


def _edit(args: argparse.Namespace) -> int:
    patches_dir = Path(args.patches) if args.patches else default_patches_dir()
    names = read_series(patches_dir)
    lab = read_lab(patches_dir)
    fetch = FetchSettings.resolve(cache_dir=args.cache_dir, sdist=args.sdist)
    target = Path(args.dir).absolute()
    with log.step(f"Fetching {fetch.pin.project} {fetch.pin.version}"):
        sdist = fetch_sdist(fetch)
    with staged_directory(target) as tmp:
        with log.step(f"Making the queue repository ({len(names)} patches"
                      + (f", then the lab overlay's {len(lab)}" if lab else "") + ")"):
            make_queue_repo(tmp, sdist, patches_dir, names, fetch.pin, lab)
    log.info(f"queue ready in {target}: base commit tagged rollkv-base, one commit per patch"
             + (f" (the last {len(lab)}: the lab overlay, trailer '{QUEUE_TRAILER}: lab')." if lab else "."))
    log.info(f"edit/commit there (git commit --amend, git rebase -i rollkv-base), then: "
             f"rollkv patches export {target}")
    return 0


def _export(args: argparse.Namespace) -> int:
    patches_dir = Path(args.patches) if args.patches else default_patches_dir()
    repo = Path(args.dir)
    with log.step(f"Exporting the queue of {repo} into {patches_dir}"):
        names = write_queue(repo, patches_dir)
        for n in names:
            log.info(n)
    log.info(f"{len(names)} patches, {SERIES_FILE} and {MANIFEST_FILE} written")
    return 0


def _check(args: argparse.Namespace) -> int:
    patches_dir = Path(args.patches) if args.patches else default_patches_dir()
    fetch = FetchSettings.resolve(cache_dir=args.cache_dir, sdist=args.sdist)
    return check_queue(patches_dir, fetch, Path(args.workdir) if args.workdir else None)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "patches", "patch queue: edit, export, check, rebase",
                    __doc__.split("\n\n")[1] if __doc__ else None,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="patches_command", metavar="ACTION", required=True,
                           parser_class=type(p))

    e = add_command(sub, "edit", "make DIR a git repo: pristine tree + one commit per patch", run=_edit)
    e.add_argument("dir", help="new or empty directory")
    add_patches_argument(e)
    add_fetch_arguments(e)

    x = add_command(sub, "export", "regenerate patches/ from the commits of a queue repo", run=_export)
    x.add_argument("dir", help="git repository whose first commit is the pristine tree")
    add_patches_argument(x)

    c = add_command(sub, "check", "verify that patches/ regenerates byte for byte", run=_check)
    add_patches_argument(c)
    add_fetch_arguments(c)
    c.add_argument("--workdir", help="where to put the temporary queue (default: system temp)")

    from rollkv_dist import rebase  # it builds on this module

    rebase.register(sub)
