"""The patch series: `patches/series`, the patch files, and `patches/manifest.json`.

The manifest records the sha256 of every file the series touches, as it is after applying
the whole series to the pinned tree, plus the sha256 of every patch. Applying is strict
(`git apply`: no fuzz), and the result is checked against the manifest, so a patch that
lands at an offset on a different tree, or a patch edited by hand after the last export,
is caught ("byte-identical-verified").

It is also the series tool of the recipe and the flake, which have no rollkv installed: it
imports only the standard library and rollkv_dist's pin, errors, util and proc, so

    PYTHONPATH=<dir holding rollkv_dist> python3 -m rollkv_dist.series COMMAND ...

runs in a conda build environment and in the Nix sandbox. Commands: `apply TREE QUEUE` (apply
the series unless the tree already carries it, then verify against the manifest),
`verify TREE QUEUE`, `build-commit TREE QUEUE` (the LLAMA_BUILD_COMMIT of every build),
`record [--tree TREE] QUEUE PREFIX KEY=VALUE...` (the applied series with its patches and
build-info.txt in PREFIX/share/rollkv-llamafile, which recipe/run_test.sh reads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rollkv_dist.errors import PatchError, RollkvError, UsageError
from rollkv_dist.pin import PIN, UpstreamPin
from rollkv_dist.proc import run as run_process
from rollkv_dist.util import sha256_file

MANIFEST_SCHEMA = 1
SERIES_FILE = "series"
MANIFEST_FILE = "manifest.json"
PROVENANCE_FILE = "ROLLKV-PROVENANCE.json"
APPLIED_STAMP = ".rollkv-series-applied"
RECORD_DIR = "share/rollkv-llamafile"
PATCH_NAME_RE = re.compile(r"^(\d{4})-[a-z0-9][a-z0-9-]*\.patch$")
# a commit's (and its patch's) `Rollkv-Patch: NNNN-name` trailer fixes the patch's name
TRAILER = "Rollkv-Patch"
TRAILER_RE = re.compile(rf"^{TRAILER}:\s*(\S+)\s*$", re.MULTILINE | re.IGNORECASE)
# patches/lab: the lab overlay, switches for comparison builds that only `rollkv source --lab` applies (on top of
# the series; never built into a package). A queue repository's commit with the trailer `Rollkv-Queue: lab` is one
# of its patches; they come after every patch of the series
LAB_DIR = "lab"
QUEUE_TRAILER = "Rollkv-Queue"
QUEUE_TRAILER_RE = re.compile(rf"^{QUEUE_TRAILER}:\s*lab\s*$", re.MULTILINE | re.IGNORECASE)
# roles of patches the tooling must find in the series by what they do, never by number:
# the two-pass compute reserve, which the gates' baseline build leaves out (boot-repro)
COMPUTE_RESERVE_ROLE = "rolling-kv-compute-reserve"

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class FileDiff:
    old_path: str | None
    new_path: str | None
    hunks: list[tuple[int, str]] = field(default_factory=list)
    """(old start line, hunk header) per hunk, in order."""

    @property
    def paths(self) -> list[str]:
        return sorted({p for p in (self.old_path, self.new_path) if p})


def _strip_prefix(path: str) -> str | None:
    path = path.split("\t", 1)[0].strip()
    if path.startswith('"') and path.endswith('"'):
        path = path[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
        path = path.encode("latin-1", "replace").decode("utf-8", "replace")
    if path == "/dev/null":
        return None
    if path[:2] in ("a/", "b/"):
        return path[2:]
    return path


def parse_patch(text: str) -> list[FileDiff]:
    """The per-file sections of a git-style patch: paths and hunk headers."""
    files: list[FileDiff] = []
    cur: FileDiff | None = None
    for line in text.splitlines():
        if line.startswith("diff --git "):
            rest = line[len("diff --git "):]
            old = new = None
            if " b/" in rest:
                a, b = rest.rsplit(" b/", 1)
                old, new = _strip_prefix(a), b
            cur = FileDiff(old, new)
            files.append(cur)
        elif cur is None:
            continue
        elif line.startswith("--- "):
            cur.old_path = _strip_prefix(line[4:])
        elif line.startswith("+++ "):
            cur.new_path = _strip_prefix(line[4:])
        elif line.startswith("rename from ") or line.startswith("copy from "):
            cur.old_path = line.split(" from ", 1)[1]
        elif line.startswith("rename to ") or line.startswith("copy to "):
            cur.new_path = line.split(" to ", 1)[1]
        elif line.startswith("new file mode"):
            cur.old_path = None
        elif line.startswith("deleted file mode"):
            cur.new_path = None
        elif line.startswith("@@ "):
            m = _HUNK_RE.match(line)
            if m:
                cur.hunks.append((int(m.group(1)), line.split("@@")[1].strip()))
    return files


def read_series(patches_dir: Path) -> list[str]:
    """Patch names listed in `patches/series`, in order (blank lines and # comments ignored)."""
    series = patches_dir / SERIES_FILE
    if not series.is_file():
        raise UsageError(f"{series} does not exist: pass --patches DIR pointing at a patch "
                         f"queue (an empty series file is valid)")
    names = []
    try:
        text = series.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = series.read_bytes()[:exc.start].count(b"\n") + 1
        raise PatchError(f"{series} is not UTF-8 text (byte {exc.start}, line {line}): write the series "
                         f"as one UTF-8 patch file name per line") from exc
    except OSError as exc:
        raise PatchError(f"cannot read {series} ({exc.strerror}): fix its permissions") from exc
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.append(line)
    seen = set()
    for n in names:
        if n in seen:
            raise PatchError(f"{series} lists {n} twice: remove the duplicate line")
        seen.add(n)
        if not (patches_dir / n).is_file():
            raise PatchError(f"{series} lists {n} but {patches_dir / n} does not exist: "
                             f"restore the file or regenerate with `rollkv patches export`")
    return names


def read_lab(patches_dir: Path) -> list[str]:
    """The lab overlay's patches (`patches/lab/series`), in order; [] where the queue has no overlay."""
    lab = patches_dir / LAB_DIR
    return read_series(lab) if (lab / SERIES_FILE).is_file() else []


def patch_with_role(patches_dir: Path, role: str) -> str | None:
    """The series entry that plays `role` (e.g. COMPUTE_RESERVE_ROLE): the patch whose
    `Rollkv-Patch:` trailer names it (`NNNN-<role>`), else the one whose file is `NNNN-<role>.patch`;
    None when the series has none. Two patches with one role are an error."""
    names = read_series(patches_dir)
    found = []
    for n in names:
        header = (patches_dir / n).read_bytes().split(b"\ndiff --git ", 1)[0].decode("utf-8", errors="replace")
        trailer = TRAILER_RE.findall(header)
        tagged = trailer[-1].removesuffix(".patch") if trailer else n.removesuffix(".patch")
        if tagged.split("-", 1)[-1] == role:
            found.append(n)
    if len(found) > 1:
        raise PatchError(f"{patches_dir / SERIES_FILE}: {', '.join(found)} all claim the role {role!r}: "
                         f"give one of them another name")
    return found[0] if found else None


def from_patch_on(names: list[str] | tuple[str, ...], first: str) -> tuple[str, ...]:
    """`first` and every patch after it: what `--before first` leaves out. The patches after a patch were
    written on top of it, so leaving one out alone need not apply (without the compute-reserve patch 0089,
    0090 does not)."""
    if first not in names:
        raise UsageError(f"--before {first}: no such patch in the series (series: {', '.join(names) or 'empty'})")
    return tuple(names[list(names).index(first):])


def select_series(names: list[str], without: tuple[str, ...]) -> list[str]:
    """The series minus the excluded patches; each excluded name must be in the series."""
    for w in without:
        if w not in names:
            raise UsageError(f"--without {w}: no such patch in the series "
                             f"(series: {', '.join(names) or 'empty'})")
    return [n for n in names if n not in without]


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class PatchEntry:
    name: str
    sha256: str
    files: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    pin: dict[str, str]
    patches: tuple[PatchEntry, ...]
    files: dict[str, str | None]

    def to_json(self) -> str:
        data = {
            "schema": MANIFEST_SCHEMA,
            "pin": self.pin,
            "series": [
                {"name": p.name, "sha256": p.sha256, "files": list(p.files)} for p in self.patches
            ],
            "files": {k: self.files[k] for k in sorted(self.files)},
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> Manifest:
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"a JSON {type(data).__name__}, expected an object")
            if data.get("schema") != MANIFEST_SCHEMA:
                raise ValueError(f"schema {data.get('schema')!r}, expected {MANIFEST_SCHEMA}")
            patches = tuple(
                PatchEntry(p["name"], p["sha256"], tuple(p["files"])) for p in data["series"]
            )
            return cls(pin=dict(data["pin"]), patches=patches, files=dict(data["files"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PatchError(f"{where} is not a valid rollkv manifest ({type(exc).__name__}: {exc}): "
                             f"regenerate it with `rollkv patches export`") from exc

    @classmethod
    def load(cls, patches_dir: Path) -> Manifest | None:
        path = patches_dir / MANIFEST_FILE
        if not path.is_file():
            return None
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PatchError(f"{path} is not UTF-8 JSON: regenerate it with `rollkv patches export`") from exc
        return cls.from_json(text, str(path))


def pin_info(pin: UpstreamPin = PIN) -> dict[str, str]:
    return {
        "project": pin.project,
        "version": pin.version,
        "sha256": pin.sha256,
        "tree": pin.tree,
        "llama_commit": pin.llama_commit,
    }


def file_state(tree: Path, rel: str) -> str | None:
    p = tree / rel
    if p.is_symlink():
        return "symlink:" + os.readlink(p)
    if p.is_file():
        return sha256_file(p)
    return None


def make_manifest(patches: list[tuple[str, bytes]],
                  file_states: Callable[[list[str]], dict[str, str | None]],
                  pin: UpstreamPin = PIN) -> Manifest:
    """The one manifest writer: each patch's sha256 and touched files, and file_states(paths), the
    state (sha256, `symlink:` target, or None for absent) of every touched file after the whole
    series (`rollkv patches export` reads them from the queue's HEAD commit)."""
    entries = []
    all_files: set[str] = set()
    for name, content in patches:
        files: set[str] = set()
        for fd in parse_patch(content.decode("utf-8", errors="replace")):
            files.update(fd.paths)
        entries.append(PatchEntry(name, hashlib.sha256(content).hexdigest(), tuple(sorted(files))))
        all_files |= files
    return Manifest(pin=pin_info(pin), patches=tuple(entries), files=file_states(sorted(all_files)))


@dataclass(frozen=True)
class VerifyResult:
    status: str
    checked: int
    skipped: tuple[str, ...]
    packed_out: tuple[str, ...] = ()  # touched files a `rollkv pack` archive leaves out (absent by design)


def check_patches_match_manifest(patches_dir: Path, names: list[str],
                                 manifest: Manifest | None, pin: UpstreamPin = PIN) -> None:
    """The series files must be the ones the manifest was written for."""
    if manifest is None:
        if names:
            raise PatchError(f"{patches_dir / MANIFEST_FILE} is missing but the series has "
                             f"{len(names)} patches: run `rollkv patches export`")
        return
    if manifest.pin != pin_info(pin):
        raise PatchError(f"{patches_dir / MANIFEST_FILE} was written for another pin "
                         f"({manifest.pin.get('project')} {manifest.pin.get('version')}): "
                         f"rebase the series on the current pin and export again")
    listed = [p.name for p in manifest.patches]
    if listed != names:
        raise PatchError(f"patches/series ({', '.join(names) or 'empty'}) differs from the "
                         f"manifest ({', '.join(listed) or 'empty'}): run `rollkv patches export`")
    for p in manifest.patches:
        actual = sha256_file(patches_dir / p.name)
        if actual != p.sha256:
            raise PatchError(f"{p.name} has sha256 {actual} but the manifest says {p.sha256}: "
                             f"the patch was edited by hand; regenerate it with "
                             f"`rollkv patches edit` + `rollkv patches export`")


def verify_tree(tree: Path, manifest: Manifest, excluded: tuple[str, ...] = (),
                packed_out: tuple[str, ...] = (), overlaid: tuple[str, ...] = ()) -> VerifyResult:
    """Compare the touched files of `tree` with the manifest.

    Files touched by an excluded patch are skipped (they legitimately differ). Files in `packed_out` (those a
    `rollkv pack` archive leaves out, as its provenance lists them) are skipped when absent. Files in `overlaid`
    (the lab overlay's) are another manifest's to check (verify_lab_tree).
    """
    skip: set[str] = set()
    for p in manifest.patches:
        if p.name in excluded:
            skip.update(p.files)
    bad = []
    checked = 0
    left_out = []
    for rel, expected in sorted(manifest.files.items()):
        if rel in skip or rel in overlaid:
            continue
        actual = file_state(tree, rel)
        if rel in packed_out and actual is None:
            left_out.append(rel)
            continue
        checked += 1
        if actual != expected:
            bad.append(f"{rel} (expected {expected or 'absent'}, found {actual or 'absent'})")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise PatchError(f"patched tree differs from the manifest: {shown}: the patches applied "
                         f"to a different tree than the pin, or the manifest is stale "
                         f"(`rollkv patches check` tells which)")
    status = "byte-identical-verified" if not skip else "verified-except-excluded"
    return VerifyResult(status=status, checked=checked, skipped=tuple(sorted(skip)), packed_out=tuple(left_out))


def verify_lab_tree(tree: Path, patches_dir: Path, lab: list[str] | tuple[str, ...], pin: UpstreamPin = PIN) -> VerifyResult:
    """A tree carrying the series and the lab overlay's `lab` patches: the files the overlay touches against
    patches/lab/manifest.json, the others against patches/manifest.json."""
    lab_dir = patches_dir / LAB_DIR
    manifest = Manifest.load(patches_dir)
    lab_manifest = Manifest.load(lab_dir)
    if manifest is None or lab_manifest is None:
        raise PatchError(f"{patches_dir} has no {MANIFEST_FILE} or {lab_dir} has none: run `rollkv patches export`")
    check_patches_match_manifest(lab_dir, list(lab), lab_manifest, pin)
    base = verify_tree(tree, manifest, overlaid=tuple(lab_manifest.files))
    top = verify_tree(tree, lab_manifest)
    return VerifyResult(status=base.status, checked=base.checked + top.checked, skipped=())


# --------------------------------------------------------------------------- applying


def git_env(tree: Path) -> dict[str, str]:
    """Environment that keeps git from discovering a repository above `tree`, and from
    reading the user's or system's configuration (reproducible output)."""
    env = dict(os.environ)
    env["GIT_CEILING_DIRECTORIES"] = str(Path(tree).absolute().parent)
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(k, None)
    return env


def diff_offset(patch_text: str, applied_text: str | None) -> int | None:
    """Lines of `patch_text` before the part git was given (`git am` numbers the lines of the diff
    it split off the mail; `git apply` those of the file itself: applied_text None means 0).
    None when the applied part cannot be found in the file."""
    if applied_text is None:
        return 0
    want = applied_text.splitlines()[:5]
    lines = patch_text.splitlines()
    if not want:
        return None
    for start in range(len(lines) - len(want) + 1):
        if lines[start:start + len(want)] == want:
            return start
    return None


def explain_apply_failure(name: str, patch_text: str, stderr: str, applied_text: str | None = None) -> str:
    """One message naming the patch, the file and the hunk that failed.

    applied_text: what git actually read when it is not the whole file (git am's split-off diff),
    so that git's line numbers can be given as lines of the patch file."""
    diffs = parse_patch(patch_text)
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    m = re.search(r"patch failed: (.+):(\d+)", stderr)
    if m:
        path, line = m.group(1), int(m.group(2))
        hunk_desc = f"the hunk at line {line} of {path}"
        for fd in diffs:
            if path in fd.paths:
                for i, (start, header) in enumerate(fd.hunks, 1):
                    if start == line:
                        hunk_desc = f"hunk #{i} (@@ {header} @@)"
                        break
        return f"patch {name} does not apply: file {path}, {hunk_desc}: context not found"
    for pat, what in (
        (r"error: (.+?): does not exist in (?:index|working directory)", "file missing"),
        (r"error: (.+?): No such file or directory", "file missing"),
        (r"error: (.+?): already exists in working directory", "file already exists"),
        (r"error: (.+?): patch does not apply", "does not apply"),
    ):
        m = re.search(pat, stderr)
        if m:
            return f"patch {name} does not apply: file {m.group(1)}, {what}"
    m = re.search(r"corrupt patch at line (\d+)", stderr)
    if m:
        offset = diff_offset(patch_text, applied_text)
        if offset is None:
            return f"patch {name} is corrupt at line {m.group(1)} of its diff (git's numbering)"
        return f"patch {name} is corrupt at line {int(m.group(1)) + offset} of the patch file"
    detail = lines[-1] if lines else "git apply failed"
    return f"patch {name} does not apply: {detail}"


def apply_patch(tree: Path, patch: Path) -> None:
    """Apply one patch strictly (no fuzz) with git apply; PatchError names patch/file/hunk."""
    proc = run_process(
        ["git", "apply", "--whitespace=nowarn", str(patch.absolute())],
        cwd=tree, env=git_env(tree), capture_output=True, text=True, stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        msg = explain_apply_failure(patch.name, patch.read_text(errors="replace"), proc.stderr)
        raise PatchError(f"{msg}: rebase the patch on the pinned tree (`rollkv patches edit DIR`,"
                         f" fix the commit, `rollkv patches export DIR`)")


def apply_series(tree: Path, patches_dir: Path, names: list[str]) -> None:
    for n in names:
        apply_patch(tree, patches_dir / n)


# --------------------------------------------------------------------------- builds


def build_commit(applied: list[str] | tuple[str, ...], excluded: list[str] | tuple[str, ...] = (),
                 pin: UpstreamPin = PIN, lab: list[str] | tuple[str, ...] = ()) -> str:
    """LLAMA_BUILD_COMMIT of a build: '0c1e57098+rollkv.<patches applied>[-without-0089][-lab-0001]'."""
    commit = f"{pin.llama_commit}+rollkv.{len(applied)}"
    if excluded:
        commit += "-without-" + "-".join(x.split("-", 1)[0] for x in excluded)
    if lab:
        commit += "-lab-" + "-".join(x.split("-", 1)[0] for x in lab)
    return commit


def series_digest(patches_dir: Path, names: list[str] | tuple[str, ...]) -> str:
    """8 hex digits naming the series' content (names, order, patch bytes): the conda build
    string carries it, so a changed series is a different package file."""
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0" + sha256_file(patches_dir / n).encode() + b"\n")
    return h.hexdigest()[:8]


def package_version(n_patches: int, pin: UpstreamPin = PIN) -> str:
    """The conda package version: upstream llama.cpp's version and commit, and the series
    length, e.g. 0.5.0.dev+0c1e57098.rollkv8 (the programs say 0.5.0-dev)."""
    return f"{pin.llama_version}.dev+{pin.llama_commit}.rollkv{n_patches}"


PACKED_OUT_KEY = "packed_out"  # provenance of a `rollkv pack` archive: the touched files it leaves out
LAB_KEY = "lab"  # provenance of a tree made with `rollkv source --lab`: the overlay's patches it carries


def tree_provenance(tree: Path) -> dict:
    """A tree's provenance (`rollkv source`, `rollkv pack`): {} where it has none or an unreadable one."""
    prov = tree / PROVENANCE_FILE
    try:
        data = json.loads(prov.read_text()) if prov.is_file() else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def tree_packed_out(tree: Path) -> tuple[str, ...]:
    """The touched files a packed tree leaves out, as its provenance lists them (none for other trees)."""
    return tuple(tree_provenance(tree).get(PACKED_OUT_KEY, ()))


def tree_series(tree: Path, patches_dir: Path) -> tuple[list[str], list[str]]:
    """(applied, excluded) of a tree: its provenance (`rollkv source`, `rollkv pack`) when it
    has one, else the queue's series."""
    data = tree_provenance(tree)
    if data:
        return list(data.get("series", [])), list(data.get("excluded", []))
    return read_series(patches_dir), []


def tree_lab(tree: Path) -> list[str]:
    """The lab overlay's patches a tree carries, as its provenance lists them ([] for others)."""
    return list(tree_provenance(tree).get(LAB_KEY, []))


def apply_queue(tree: Path, patches_dir: Path, out=print) -> VerifyResult | None:
    """The queue applied to `tree` (skipped when the tree already carries exactly this series,
    by provenance or by an earlier apply), then verified; PatchError on any mismatch."""
    names = read_series(patches_dir)
    manifest = Manifest.load(patches_dir)
    check_patches_match_manifest(patches_dir, names, manifest)
    stamp = tree / APPLIED_STAMP
    series_bytes = (patches_dir / SERIES_FILE).read_bytes()
    applied, excluded = tree_series(tree, patches_dir)
    if stamp.is_file():
        if stamp.read_bytes() != series_bytes:
            raise PatchError(f"{tree} was patched with a different series: start from a fresh tree")
        out(f"series: already applied to {tree}")
    elif (tree / PROVENANCE_FILE).is_file():
        lab = tree_lab(tree)
        if lab:
            raise PatchError(f"{tree} carries the lab overlay ({', '.join(lab)}), which comparison builds "
                             f"take and packages never: start from a tree made without --lab")
        if applied != names or excluded:
            raise PatchError(f"{tree} carries the series {applied} (excluded {excluded}), "
                             f"not {names}: start from a fresh tree")
        out(f"series: {tree} carries it already ({PROVENANCE_FILE})")
    else:
        for n in names:
            out(f"series: applying {n}")
            apply_patch(tree, patches_dir / n)
        stamp.write_bytes(series_bytes)
    if manifest is None:
        out("series: empty series, nothing to verify")
        return None
    result = verify_tree(tree, manifest, packed_out=tree_packed_out(tree))
    left = f"; left out by the pack: {', '.join(result.packed_out)}" if result.packed_out else ""
    out(f"series: {result.status} ({result.checked} files{left})")
    return result


def record_series(prefix: Path, patches_dir: Path, names: list[str], info: dict[str, str]) -> Path:
    """PREFIX/share/rollkv-llamafile: patches/ (the applied series as a queue: `series` and
    its patches) and build-info.txt."""
    info = {"llama_commit": PIN.llama_commit, **info}
    share = prefix / RECORD_DIR
    (share / "patches").mkdir(parents=True, exist_ok=True)
    (share / "patches" / SERIES_FILE).write_text("".join(n + "\n" for n in names))
    for n in names:
        shutil.copyfile(patches_dir / n, share / "patches" / n)
    (share / "build-info.txt").write_text("".join(f"{k}={v}\n" for k, v in info.items()))
    return share


def read_record(prefix: Path) -> tuple[list[str], dict[str, str]]:
    """What record_series wrote under PREFIX (the series and build-info.txt); ([], {}) where nothing."""
    share = prefix / RECORD_DIR
    series = read_series(share / "patches") if (share / "patches" / SERIES_FILE).is_file() else []
    info: dict[str, str] = {}
    if (share / "build-info.txt").is_file():
        for ln in (share / "build-info.txt").read_text().splitlines():
            k, sep, v = ln.partition("=")
            if sep:
                info[k.strip()] = v.strip()
    return series, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollkv_dist.series",
                                 description="patch series tool of the recipe and the flake")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("apply", "verify", "build-commit"):
        p = sub.add_parser(cmd)
        p.add_argument("tree", type=Path)
        p.add_argument("queue", type=Path)
    p = sub.add_parser("record")
    p.add_argument("queue", type=Path)
    p.add_argument("prefix", type=Path)
    p.add_argument("--tree", type=Path, help="the built tree (its provenance names the series)")
    p.add_argument("info", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "apply":
            apply_queue(args.tree, args.queue)
        elif args.cmd == "verify":
            manifest = Manifest.load(args.queue)
            check_patches_match_manifest(args.queue, read_series(args.queue), manifest)
            if manifest is None:
                print("series: empty series, nothing to verify")
            else:
                res = verify_tree(args.tree, manifest, packed_out=tree_packed_out(args.tree))
                print(f"series: {res.status} ({res.checked} files)")
        elif args.cmd == "build-commit":
            print(build_commit(*tree_series(args.tree, args.queue)))
        else:
            names = (tree_series(args.tree, args.queue)[0] if args.tree
                     else read_series(args.queue))
            info = dict(kv.split("=", 1) for kv in args.info)
            prov = args.tree / PROVENANCE_FILE if args.tree else None
            if prov is not None and prov.is_file():  # the rollkv commit the tree was made from
                commit = json.loads(prov.read_text()).get("rollkv_commit")
                if commit:
                    info.setdefault("rollkv_commit", str(commit))
            print(record_series(args.prefix, args.queue, names, info))
    except RollkvError as exc:
        print(f"series: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
