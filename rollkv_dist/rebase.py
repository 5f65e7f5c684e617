"""`rollkv patches rebase DIR --onto VERSION --sha256 HEX`: the series replayed on another upstream release.

The queue is made on the pinned tree (as `patches edit` makes it), the other release's tree becomes a second
base commit in the same repository, and `git rebase` replays every patch onto it with a 3-way merge. It stops
at the first conflict and names the patch and the files; once resolved (`git rebase --continue` in DIR),
`rollkv patches rebase DIR --finish` exports the queue (patches, series, manifest) and moves the pin
(`rollkv_dist/pin.toml`): both go in one commit. `--check-only` replays without writing anything but
`--report` (a rehearsal).

The release's sdist is fetched by pip and verified by the sha256 given; its llama.cpp commit (the
submodule's HEAD recorded in the sdist) and version (CMakeLists.txt) become the new pin's.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollkv_dist.commands import add_command
from rollkv_dist import log
from rollkv_dist.errors import PatchError, UsageError
from rollkv_dist.fetch import FetchSettings, extract_tree, fetch_sdist
from rollkv_dist.patches import BASE_DATE, _identity_env, base_message, git, git_text, make_queue_repo, write_queue
from rollkv_dist.pin import PIN, PIN_FILE, UpstreamPin, load_pin
from rollkv_dist.series import LAB_DIR, read_lab, read_series
from rollkv_dist.util import atomic_write_text, default_patches_dir

ONTO_TAG = "rollkv-onto"
ONTO_PIN = "rollkv-onto.toml"  # in DIR/.git: the pin of the release the queue is being moved onto
_HUNK_RE = re.compile(rb"^@@ -[0-9,]+ \+[0-9,]+ @@")


def release_pin(sdist: Path, version: str, sha256: str, old: UpstreamPin = PIN) -> UpstreamPin:
    """The pin of another release of the same project: its llama.cpp commit is the submodule HEAD the sdist
    records (.git/modules/<tree>/HEAD), its version the tree's LLAMA_VERSION_MAJOR/MINOR/PATCH."""
    root = f"{old.project.replace('-', '_')}-{version}"
    head_name, cmake_name = f"{root}/.git/modules/{old.tree}/HEAD", f"{root}/{old.tree}/CMakeLists.txt"
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(sdist) as tf:
            for m in tf:
                if m.name in (head_name, cmake_name) and m.isfile():
                    f = tf.extractfile(m)
                    found[m.name] = f.read() if f else b""
                    if len(found) == 2:
                        break
    except (OSError, tarfile.TarError) as e:
        raise UsageError(f"{sdist}: not a readable sdist ({e})") from e
    head = found.get(head_name, b"").decode(errors="replace").strip()
    if not re.fullmatch(r"[0-9a-f]{40}", head):
        raise UsageError(f"{sdist}: no llama.cpp commit recorded ({head_name} missing or not a commit id): "
                         f"is {version} a release of {old.project} with {old.tree} vendored?")
    cmake = found.get(cmake_name, b"").decode(errors="replace")
    parts = [re.search(rf"set\(LLAMA_VERSION_{k}\s+([0-9]+)\)", cmake) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise UsageError(f"{sdist}: {cmake_name} does not set LLAMA_VERSION_MAJOR/MINOR/PATCH")
    sri = "sha256-" + base64.b64encode(bytes.fromhex(sha256)).decode()
    return dataclasses.replace(old, version=version, sha256=sha256, sri=sri, llama_commit=head[:9],
                               llama_version=".".join(p.group(1) for p in parts if p))


def pin_text(pin: UpstreamPin, template: str) -> str:
    """`template` (a pin.toml) with every value replaced by `pin`'s; its comments kept."""
    values = dataclasses.asdict(pin)
    out, seen = [], set()
    for line in template.splitlines(keepends=True):
        m = re.match(r'^([a-z0-9_]+) = "[^"]*"\s*$', line)
        if m and m.group(1) in values:
            seen.add(m.group(1))
            line = f'{m.group(1)} = "{values[m.group(1)]}"\n'
        out.append(line)
    if seen != set(values):
        raise UsageError(f"the pin template lacks {sorted(set(values) - seen)}")
    return "".join(out)


@dataclass
class PatchOutcome:
    name: str
    result: str  # same (the diff is unchanged), moved (only hunk positions changed), changed, dropped, conflict,
    # not reached
    lines_changed: int = 0  # diff lines (+/-) that differ from the patch's old diff
    files: list[str] = dataclasses.field(default_factory=list)  # the conflicting files
    upstream_lines: int = 0  # lines upstream changed between the two releases in the files the patch touches
    not_reached: bool = False  # after the first conflict: the replay stopped before it


def _diff_body(repo: Path, commit: str) -> list[bytes]:
    """The commit's diff without index lines, hunk positions kept apart."""
    raw = git(repo, "diff", "--no-color", "--no-renames", "--full-index", f"{commit}^", commit).stdout
    return [ln for ln in raw.splitlines() if not ln.startswith(b"index ")]


def _compare(repo: Path, old: str, new: str) -> tuple[str, int]:
    a, b = _diff_body(repo, old), _diff_body(repo, new)
    if a == b:
        return "same", 0
    strip = [[_HUNK_RE.sub(b"@@", ln) for ln in d] for d in (a, b)]
    if strip[0] == strip[1]:
        return "moved", 0
    sa, sb = set(strip[0]), set(strip[1])
    return "changed", sum(1 for ln in strip[0] if ln not in sb) + sum(1 for ln in strip[1] if ln not in sa)


def upstream_drift(repo: Path, commits: list[str]) -> list[int]:
    """Per commit of the old queue: the lines upstream changed (added + removed) between the two releases in the
    files that commit touches."""
    stat: dict[str, int] = {}
    for ln in git_text(repo, "diff", "--numstat", "--no-renames", "rollkv-base", ONTO_TAG).splitlines():
        a, d, path = ln.split("\t", 2)
        stat[path] = (int(a) if a.isdigit() else 0) + (int(d) if d.isdigit() else 0)
    out = []
    for c in commits:
        files = git_text(repo, "diff-tree", "--no-commit-id", "--name-only", "-r", "--no-renames", c).split()
        out.append(sum(stat.get(f, 0) for f in files))
    return out


def add_base(repo: Path, sdist: Path, pin: UpstreamPin) -> str:
    """The release's pristine tree as a root commit of `repo` (tagged ONTO_TAG), beside the queue's branch."""
    env = _identity_env(repo)
    with tempfile.TemporaryDirectory(prefix="rollkv-onto-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        extract_tree(sdist, tree, pin)
        ienv = dict(env, GIT_INDEX_FILE=str(Path(tmp) / "index"), GIT_WORK_TREE=str(tree))
        git(repo, "add", "--all", "--force", ".", env=ienv)
        tree_id = git(repo, "write-tree", env=ienv).stdout.decode().strip()
    base_env = dict(env, GIT_AUTHOR_DATE=BASE_DATE, GIT_COMMITTER_DATE=BASE_DATE)
    commit = git(repo, "commit-tree", tree_id, "-m", base_message(pin), env=base_env).stdout.decode().strip()
    git(repo, "tag", "-f", ONTO_TAG, commit, env=env)
    return commit


def rebase(repo: Path, old_sdist: Path, new_sdist: Path, new_pin: UpstreamPin, patches_dir: Path,
           old_pin: UpstreamPin = PIN) -> list[PatchOutcome]:
    """Make the queue in `repo` (empty), replay it onto the new release. Every patch's outcome; the last is a
    conflict when the replay stopped there (the repository is left mid-rebase for the user to resolve)."""
    series, lab = read_series(patches_dir), read_lab(patches_dir)
    names = [*series, *(f"{LAB_DIR}/{n}" for n in lab)]  # the lab overlay moves with the series
    with log.step(f"Making the queue on {old_pin.project} {old_pin.version} ({len(names)} patches)"):
        make_queue_repo(repo, old_sdist, patches_dir, series, old_pin, lab)
    env = _identity_env(repo)
    old_commits = git_text(repo, "rev-list", "--reverse", "rollkv-base..HEAD").split()
    with log.step(f"Adding {new_pin.project} {new_pin.version}'s tree (llama.cpp {new_pin.llama_commit})"):
        add_base(repo, new_sdist, new_pin)
    atomic_write_text(repo / ".git" / ONTO_PIN, pin_text(new_pin, PIN_FILE.read_text()))
    outcomes: list[PatchOutcome] = []
    with log.step(f"Replaying {len(names)} patches onto {new_pin.version} (git rebase, 3-way merge)"):
        proc = git(repo, "-c", "rebase.backend=merge", "rebase", "-q", "--committer-date-is-author-date",
                   "--empty=drop", "--onto", ONTO_TAG, "rollkv-base", env=env, check=False)
    done = git_text(repo, "rev-list", "--reverse", f"{ONTO_TAG}..HEAD").split()
    if proc.returncode != 0:
        stopped = (repo / ".git" / "rebase-merge" / "stopped-sha")
        sha = stopped.read_text().strip() if stopped.is_file() else \
            git_text(repo, "rev-parse", "REBASE_HEAD").strip()
        full = git_text(repo, "rev-parse", sha).strip()
        if full not in old_commits:
            raise PatchError(f"git rebase stopped in {repo} without a patch to blame: "
                             f"{proc.stderr.decode(errors='replace').strip()}")
        i = old_commits.index(full)
        for n, old, new in zip(names[:i], old_commits, done):
            outcomes.append(PatchOutcome(n, *_compare(repo, old, new)))
        files = git_text(repo, "diff", "--name-only", "--diff-filter=U").split()
        outcomes.append(PatchOutcome(names[i], "conflict", files=files))
        outcomes += [PatchOutcome(n, "not reached", not_reached=True) for n in names[i + 1:]]
        for o, lines in zip(outcomes, upstream_drift(repo, old_commits)):
            o.upstream_lines = lines
        return outcomes
    # a commit whose change the release already has is dropped: match the rest by subject
    subjects = {git_text(repo, "log", "-1", "--format=%s", c).strip(): c for c in done}
    for n, old in zip(names, old_commits):
        new = subjects.get(git_text(repo, "log", "-1", "--format=%s", old).strip())
        outcomes.append(PatchOutcome(n, *_compare(repo, old, new)) if new else PatchOutcome(n, "dropped"))
    for o, lines in zip(outcomes, upstream_drift(repo, old_commits)):
        o.upstream_lines = lines
    return outcomes


def finish(repo: Path, patches_dir: Path, pin_file: Path = PIN_FILE) -> list[str]:
    """Export the rebased queue into `patches_dir` and move the pin: the files of one commit."""
    onto = repo / ".git" / ONTO_PIN
    if not onto.is_file():
        raise UsageError(f"{repo} is not a queue being moved onto another release: run "
                         f"`rollkv patches rebase {repo} --onto VERSION --sha256 HEX` first")
    if (repo / ".git" / "rebase-merge").exists() or (repo / ".git" / "rebase-apply").exists():
        raise UsageError(f"{repo} is still mid-rebase: resolve the conflict, `git add` the files and "
                         f"`git rebase --continue` there, then run --finish again")
    new_pin = load_pin(onto)
    root = git_text(repo, "rev-list", "--max-parents=0", "HEAD").split()
    onto_commit = git_text(repo, "rev-parse", f"{ONTO_TAG}^{{commit}}").strip()
    if root != [onto_commit]:
        raise UsageError(f"{repo}: HEAD does not descend from {new_pin.version}'s tree alone ({ONTO_TAG})")
    with log.step(f"Exporting the queue on {new_pin.version} into {patches_dir}"):
        names = write_queue(repo, patches_dir, new_pin)
    atomic_write_text(pin_file, onto.read_text())
    log.info(f"the pin moved to {new_pin.project} {new_pin.version} (llama.cpp {new_pin.llama_commit}, "
             f"{new_pin.llama_version}) in {pin_file}; {len(names)} patches, series and manifest in {patches_dir}")
    log.info("commit both in one commit, then `rollkv patches check` and the gates")
    return names


def _run(args: argparse.Namespace) -> int:
    patches_dir = Path(args.patches) if args.patches else default_patches_dir()
    repo = Path(args.dir).absolute()
    if args.finish:
        finish(repo, patches_dir)
        return 0
    if not args.onto or not args.sha256:
        raise UsageError("--onto VERSION and --sha256 HEX are needed (the sha256 of that release's sdist: "
                         "`pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==VERSION -d D` "
                         "and sha256sum); or --finish after a resolved conflict")
    if not re.fullmatch(r"[0-9a-f]{64}", args.sha256):
        raise UsageError(f"--sha256 {args.sha256!r} is not 64 hex digits")
    if args.onto == PIN.version:
        raise UsageError(f"--onto {args.onto} is the pinned version already")
    if repo.exists() and any(repo.iterdir()):
        raise UsageError(f"{repo} is not empty: give a new or empty directory")
    repo.mkdir(parents=True, exist_ok=True)
    old_fetch = FetchSettings.resolve(cache_dir=args.cache_dir, sdist=args.sdist)
    with log.step(f"Fetching {PIN.project} {PIN.version} (the pin)"):
        old_sdist = fetch_sdist(old_fetch)
    guess = dataclasses.replace(PIN, version=args.onto, sha256=args.sha256)
    new_fetch = FetchSettings.resolve(cache_dir=args.cache_dir, sdist=args.onto_sdist, pin=guess)
    with log.step(f"Fetching {PIN.project} {args.onto}"):
        new_sdist = fetch_sdist(new_fetch)
    new_pin = release_pin(new_sdist, args.onto, args.sha256)
    outcomes = rebase(repo, old_sdist, new_sdist, new_pin, patches_dir)
    report = {"from": dataclasses.asdict(PIN), "onto": dataclasses.asdict(new_pin),
              "upstream_files_changed": len(git_text(repo, "diff", "--name-only", "rollkv-base", ONTO_TAG).split()),
              "patches": [dataclasses.asdict(o) for o in outcomes]}
    if args.report:
        atomic_write_text(Path(args.report), json.dumps(report, indent=1) + "\n")
    counts = {r: sum(o.result == r for o in outcomes)
              for r in ("same", "moved", "changed", "dropped", "conflict", "not reached")}
    log.info(", ".join(f"{v} {k}" for k, v in counts.items() if v) + f" of {len(read_series(patches_dir))} patches")
    for o in outcomes:
        if o.result not in ("same", "moved", "not reached"):
            log.info(f"{o.name}: {o.result}" + (f" ({o.lines_changed} diff lines)" if o.lines_changed else "")
                     + (f" in {', '.join(o.files)}" if o.files else ""))
    conflicts = [o for o in outcomes if o.result == "conflict"]
    if conflicts:
        c = conflicts[0]
        raise PatchError(f"{c.name} conflicts with {PIN.project} {args.onto} in {', '.join(c.files) or '(no file)'}: "
                         f"resolve it in {repo} (edit, `git add`, `git rebase --continue`), then "
                         f"`rollkv patches rebase {repo} --finish`")
    if args.check_only:
        log.info(f"--check-only: nothing written; the replayed queue is in {repo}")
        return 0
    finish(repo, patches_dir)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from rollkv_dist.source import add_fetch_arguments, add_patches_argument

    r = add_command(sub, "rebase", "replay the series onto another llama-cpp-python release, move the pin",
                    __doc__.split("\n\n")[1] if __doc__ else None, _run)
    r.add_argument("dir", help="new or empty directory for the queue (with --finish: the queue being moved)")
    r.add_argument("--onto", metavar="VERSION", help="the llama-cpp-python release to move onto")
    r.add_argument("--sha256", metavar="HEX", help="sha256 of that release's sdist (verified)")
    r.add_argument("--onto-sdist", metavar="FILE", help="a local copy of that release's sdist (verified)")
    r.add_argument("--finish", action="store_true", help="after a resolved conflict: export and move the pin")
    r.add_argument("--check-only", action="store_true", help="replay and report, write neither patches nor pin")
    r.add_argument("--report", metavar="FILE", help="write each patch's outcome as JSON")
    add_patches_argument(r)
    add_fetch_arguments(r)
