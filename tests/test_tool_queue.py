"""Patch queue (edit/export/check) and `rollkv source`, on a small synthetic pinned tree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _rollkv_tool_helpers import empty_queue, git, mini_fetch

from rollkv_dist.errors import PatchError, TargetError, UsageError
from rollkv_dist.fetch import fetch_sdist
from rollkv_dist.patches import (
    base_message,
    check_queue,
    kebab,
    make_queue_repo,
    plan_names,
    write_queue,
)
from rollkv_dist.series import from_patch_on
from rollkv_dist.source import PROVENANCE_FILE, SourceSettings, prepare_source
from rollkv_dist.util import sha256_bytes

RESERVE = "0089-rolling-kv-compute-reserve.patch"


def _queue(tmp_path: Path):
    """A queue repo from the mini pin with two commits, exported into patches/."""
    fetch, repo = empty_queue(tmp_path)
    (repo / "src" / "a.c").write_text((repo / "src" / "a.c").read_text()
                                      .replace("int a5 = 5;", "int a5 = 55; /* rollkv */"))
    (repo / "src" / "new.c").write_text("int n;\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Position window: first change",
        "-m", "Why: the window needs it.")
    (repo / "src" / "b.c").write_text("int b = 2;\n")
    git(repo, "commit", "-q", "-am", "Two-pass compute reserve",
        "-m", f"Rollkv-Patch: {RESERVE[:-6]}")
    patches = tmp_path / "patches"
    names = write_queue(repo, patches, fetch.pin)
    return fetch, repo, patches, names


def test_edit_makes_a_base_commit_of_the_pristine_tree(tmp_path):
    fetch = mini_fetch(tmp_path)
    sdist = fetch_sdist(fetch)
    pdir = tmp_path / "p"
    pdir.mkdir()
    (pdir / "series").write_text("")
    repo = tmp_path / "r"
    repo.mkdir()
    make_queue_repo(repo, sdist, pdir, [], fetch.pin)
    assert git(repo, "log", "--format=%s").strip() == base_message(fetch.pin)
    assert base_message(fetch.pin) == "upstream llama.cpp abc1234 (mini-pkg 1.0)"
    # ignored files (the tree's own .gitignore says *.gguf) are in the base commit too
    assert "models/vocab.gguf" in git(repo, "ls-files").split()
    assert git(repo, "status", "--porcelain") == ""


def test_export_names_series_and_manifest(tmp_path):
    fetch, _, patches, names = _queue(tmp_path)
    assert names == ["0001-position-window-first-change.patch", RESERVE]
    assert (patches / "series").read_text() == "".join(n + "\n" for n in names)
    first = (patches / names[0]).read_text()
    assert first.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] Position window: first change" in first
    assert "Why: the window needs it." in first
    manifest = json.loads((patches / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["src/a.c", "src/b.c", "src/new.c"]
    assert manifest["pin"]["sha256"] == fetch.pin.sha256
    assert [p["name"] for p in manifest["series"]] == names


def test_export_then_check_round_trip(tmp_path):
    fetch, _, patches, _ = _queue(tmp_path)
    assert check_queue(patches, fetch) == 0


def test_edit_of_an_exported_queue_regenerates_identically(tmp_path):
    fetch, _, patches, names = _queue(tmp_path)
    repo2 = tmp_path / "repo2"
    repo2.mkdir()
    make_queue_repo(repo2, fetch_sdist(fetch), patches, names, fetch.pin)
    # git am kept author and date
    assert git(repo2, "log", "-1", "--format=%an %aI").strip() == "Dev 2026-01-02T03:04:05+00:00"
    out = tmp_path / "again"
    assert write_queue(repo2, out, fetch.pin) == names
    for f in [*names, "series", "manifest.json"]:
        assert (out / f).read_bytes() == (patches / f).read_bytes(), f


def test_check_finds_a_stale_file_and_a_reordered_series(tmp_path):
    fetch, _, patches, names = _queue(tmp_path)
    (patches / "0042-stale.patch").write_text("old\n")
    with pytest.raises(PatchError, match="0042-stale.patch"):
        check_queue(patches, fetch)
    (patches / "0042-stale.patch").unlink()
    (patches / "series").write_text("".join(n + "\n" for n in reversed(names)))
    with pytest.raises(PatchError, match="differs from the manifest"):
        check_queue(patches, fetch)


def test_check_finds_a_patch_that_no_longer_regenerates(tmp_path):
    fetch, _, patches, names = _queue(tmp_path)
    # a hand edit that still applies (a note where git am ignores text), with the manifest
    # hash updated to match: the regenerated patch differs byte for byte
    p = patches / names[1]
    p.write_text(p.read_text().replace("\n---\n", "\n---\nhand-written note\n", 1))
    m = json.loads((patches / "manifest.json").read_text())
    import hashlib

    m["series"][1]["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    (patches / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    with pytest.raises(PatchError, match=f"{names[1]} differs"):
        check_queue(patches, fetch)


def test_empty_series_is_valid(tmp_path):
    fetch = mini_fetch(tmp_path)
    sdist = fetch_sdist(fetch)
    p = tmp_path / "p"
    p.mkdir()
    (p / "series").write_text("")
    repo = tmp_path / "r"
    repo.mkdir()
    make_queue_repo(repo, sdist, p, [], fetch.pin)
    assert write_queue(repo, p, fetch.pin) == []
    assert (p / "series").read_text() == ""
    assert check_queue(p, fetch) == 0
    (p / "manifest.json").unlink()  # a bare empty series file is a valid queue too
    assert check_queue(p, fetch) == 0


def test_export_refuses_uncommitted_changes(tmp_path):
    fetch, repo, patches, _ = _queue(tmp_path)
    (repo / "src" / "b.c").write_text("dirty\n")
    with pytest.raises(UsageError, match="uncommitted"):
        write_queue(repo, patches, fetch.pin)


def test_kebab_and_numbering():
    assert kebab("[PATCH] KV: position-window (rolling) v2!") == "kv-position-window-rolling-v2"
    assert len(kebab("word " * 40)) <= 52
    n = plan_names([("c1", "A", None), ("c2", "B", RESERVE), ("c3", "C", None)])
    assert n == ["0001-a.patch", RESERVE, "0090-c.patch"]
    with pytest.raises(UsageError, match="0002"):
        plan_names([("c1", "A", None), ("c2", "B", None), ("c3", "X", "0002-x.patch")])
    with pytest.raises(UsageError, match="increase"):
        plan_names([("c1", "A", "0005-a.patch"), ("c2", "B", "0003-b.patch")])


def test_source_applies_verifies_and_records(tmp_path):
    fetch, _, patches, names = _queue(tmp_path)
    s = SourceSettings(target=tmp_path / "src", patches_dir=patches, without=(), fetch=fetch)
    prepare_source(s)
    assert "int a5 = 55;" in (tmp_path / "src" / "src" / "a.c").read_text()
    prov = json.loads((tmp_path / "src" / PROVENANCE_FILE).read_text())
    assert prov["series"] == names and prov["excluded"] == []
    assert prov["manifest"]["status"] == "byte-identical-verified"
    assert set(prov["patches"]) == set(names)
    assert prov["pin"]["sha256"] == fetch.pin.sha256
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".src")] == []


def test_source_without_a_patch(tmp_path):
    fetch, _, patches, names = _queue(tmp_path)
    s = SourceSettings(target=tmp_path / "src", patches_dir=patches, without=(RESERVE,),
                       fetch=fetch)
    prepare_source(s)
    assert (tmp_path / "src" / "src" / "b.c").read_text() == "int b = 1;\n"
    prov = json.loads((tmp_path / "src" / PROVENANCE_FILE).read_text())
    assert prov["series"] == [names[0]] and prov["excluded"] == [RESERVE]
    assert prov["manifest"]["status"] == "verified-except-excluded"
    assert prov["manifest"]["skipped_files"] == ["src/b.c"]


def test_source_before_a_patch_leaves_it_and_the_later_ones_out(tmp_path):
    """--before: the series as it stood before a patch; a later patch built on it would not apply without it."""
    fetch, repo, _, _ = _queue(tmp_path)
    (repo / "src" / "b.c").write_text("int b = 3; /* after the reserve */\n")
    git(repo, "commit", "-q", "-am", "Built on the reserve")
    patches = tmp_path / "patches3"
    names = write_queue(repo, patches, fetch.pin)
    assert len(names) == 3 and from_patch_on(names, RESERVE) == (RESERVE, names[2])
    with pytest.raises(PatchError, match="does not apply"):
        prepare_source(SourceSettings(target=tmp_path / "w", patches_dir=patches, without=(RESERVE,), fetch=fetch))
    prepare_source(SourceSettings(target=tmp_path / "src", patches_dir=patches,
                                  without=from_patch_on(names, RESERVE), fetch=fetch))
    assert (tmp_path / "src" / "src" / "b.c").read_text() == "int b = 1;\n"
    assert json.loads((tmp_path / "src" / PROVENANCE_FILE).read_text())["series"] == [names[0]]
    with pytest.raises(UsageError, match="--before nope.patch: no such patch"):
        from_patch_on(names, "nope.patch")
    settings = SourceSettings.resolve(tmp_path / "x", patches_dir=patches, before=RESERVE, without=(names[0],))
    assert settings.without == (names[0], RESERVE, names[2])


def test_source_refuses_a_non_empty_target(tmp_path):
    fetch, _, patches, _ = _queue(tmp_path)
    target = tmp_path / "src"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    s = SourceSettings(target=target, patches_dir=patches, without=(), fetch=fetch)
    with pytest.raises(TargetError, match="not empty"):
        prepare_source(s)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_source_leaves_nothing_when_a_patch_fails(tmp_path):
    fetch, _, patches, names = _queue(tmp_path)
    # a tree where the first patch cannot apply: change the pinned file it touches
    other = tmp_path / "other"
    other.mkdir()
    from _rollkv_tool_helpers import MINI_FILES, make_mini_sdist

    files = dict(MINI_FILES, **{"src/a.c": MINI_FILES["src/a.c"].replace("a5 = 5", "a5 = 6")})
    sdist, pin = make_mini_sdist(other, files)
    manifest = json.loads((patches / "manifest.json").read_text())
    manifest["pin"]["sha256"] = pin.sha256
    (patches / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    from rollkv_dist.fetch import FetchSettings

    f2 = FetchSettings(cache_dir=other / "cache", pin=pin, sdist=sdist)
    s = SourceSettings(target=tmp_path / "out", patches_dir=patches, without=(), fetch=f2)
    with pytest.raises(PatchError) as ei:
        prepare_source(s)
    assert names[0] in str(ei.value) and "src/a.c" in str(ei.value)
    assert "hunk #1" in str(ei.value)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]
    assert leftovers == []


def test_source_disk_full_is_a_target_error(tmp_path, monkeypatch):
    import errno

    import rollkv_dist.source as source_mod

    fetch, _, patches, _ = _queue(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(source_mod, "extract_tree", full)
    s = SourceSettings(target=tmp_path / "src", patches_dir=patches, without=(), fetch=fetch)
    with pytest.raises(TargetError, match="disk full"):
        prepare_source(s)
    assert not (tmp_path / "src").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".src")] == []


def test_copied_queue_dir_is_independent(tmp_path):
    """export writes only into the given directory: another checkout's patches/ is untouched."""
    fetch, repo, patches, names = _queue(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(patches, copy)
    git(repo, "commit", "-q", "--allow-empty", "-m", "noop")
    with pytest.raises(UsageError, match="changes nothing"):
        write_queue(repo, patches, fetch.pin)
    assert sorted(p.name for p in copy.iterdir()) == sorted([*names, "series", "manifest.json"])


def test_corrupt_patch_is_named_by_its_line_in_the_patch_file(tmp_path):
    """git am numbers the lines of the diff it split off the mail; the message must give the
    line of the patch file (it gave git's number, 5 to 20 lines off)."""
    fetch, _, patches, names = _queue(tmp_path)
    lines = (patches / names[1]).read_text().splitlines(keepends=True)
    bad = next(i for i, ln in enumerate(lines) if ln.startswith("+int b = 2;"))
    lines[bad] = "XYZ corrupt\n"
    (patches / names[1]).write_text("".join(lines))
    repo = tmp_path / "again"
    repo.mkdir()
    with pytest.raises(PatchError) as ei:
        make_queue_repo(repo, fetch_sdist(fetch), patches, names, fetch.pin)
    assert f"{names[1]} is corrupt at line {bad + 1} of the patch file" in str(ei.value)
    assert (patches / names[1]).read_text().splitlines()[bad] == "XYZ corrupt"


def _lab_queue(tmp_path: Path):
    """_queue plus a lab overlay commit (`Rollkv-Queue: lab`) that changes a file the series touched."""
    fetch, repo, _, _ = _queue(tmp_path)
    (repo / "src" / "b.c").write_text('int b = 2; /* lab: getenv("B_SWITCH") */\n')
    git(repo, "commit", "-q", "-am", "A switch for comparisons", "-m", "Rollkv-Queue: lab")
    patches = tmp_path / "patches-lab"
    names = write_queue(repo, patches, fetch.pin)
    return fetch, repo, patches, names


def test_export_puts_lab_commits_in_the_overlay_with_their_own_manifest(tmp_path):
    fetch, repo, patches, names = _lab_queue(tmp_path)
    assert names == ["0001-position-window-first-change.patch", RESERVE]  # the series knows nothing of the lab
    assert (patches / "lab" / "series").read_text() == "0001-a-switch-for-comparisons.patch\n"
    series_files = json.loads((patches / "manifest.json").read_text())["files"]
    lab_files = json.loads((patches / "lab" / "manifest.json").read_text())["files"]
    # the series' manifest has b.c as the series leaves it, the overlay's as the overlay leaves it
    assert series_files["src/b.c"] == sha256_bytes(b"int b = 2;\n")
    assert lab_files == {"src/b.c": sha256_bytes((repo / "src" / "b.c").read_bytes())}
    assert check_queue(patches, fetch) == 0
    # a queue without the lab commit removes the overlay on export
    git(repo, "reset", "-q", "--hard", "HEAD~1")
    assert write_queue(repo, patches, fetch.pin) == names and not (patches / "lab").exists()


def test_a_lab_commit_must_come_after_the_series(tmp_path):
    fetch, repo, patches, _ = _lab_queue(tmp_path)
    (repo / "src" / "c.c").write_text("int c;\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "A product change after the lab")
    with pytest.raises(UsageError, match="move the lab commits to the end"):
        write_queue(repo, patches, fetch.pin)


def test_edit_and_check_carry_the_lab_overlay(tmp_path):
    fetch, _, patches, names = _lab_queue(tmp_path)
    repo2 = tmp_path / "repo2"
    repo2.mkdir()
    make_queue_repo(repo2, fetch_sdist(fetch), patches, names, fetch.pin, ["0001-a-switch-for-comparisons.patch"])
    assert "Rollkv-Queue: lab" in git(repo2, "log", "-1", "--format=%B")
    out = tmp_path / "again"
    write_queue(repo2, out, fetch.pin)
    for f in ["lab/series", "lab/manifest.json", "lab/0001-a-switch-for-comparisons.patch", "manifest.json"]:
        assert (out / f).read_bytes() == (patches / f).read_bytes(), f
    # an overlay whose patch was edited by hand after the export fails the check
    lab_patch = patches / "lab" / "0001-a-switch-for-comparisons.patch"
    lab_patch.write_text(lab_patch.read_text().replace("B_SWITCH", "C_SWITCH"))
    with pytest.raises(PatchError, match="edited by hand"):
        check_queue(patches, fetch)


def test_source_lab_applies_the_overlay_on_the_series_and_verifies_both(tmp_path):
    fetch, _, patches, names = _lab_queue(tmp_path)
    prepare_source(SourceSettings(target=tmp_path / "plain", patches_dir=patches, without=(), fetch=fetch))
    assert (tmp_path / "plain" / "src" / "b.c").read_text() == "int b = 2;\n"
    prepare_source(SourceSettings(target=tmp_path / "lab", patches_dir=patches, without=(), fetch=fetch, lab=True))
    assert "B_SWITCH" in (tmp_path / "lab" / "src" / "b.c").read_text()
    prov = json.loads((tmp_path / "lab" / PROVENANCE_FILE).read_text())
    assert prov["series"] == names and prov["lab"] == ["0001-a-switch-for-comparisons.patch"]
    assert prov["manifest"]["status"] == "byte-identical-verified" and prov["manifest"]["checked_files"] == 3
    assert "lab/0001-a-switch-for-comparisons.patch" in prov["patches"]
    # the overlay's manifest is what its files are checked against: a stale one fails the tree
    m = json.loads((patches / "lab" / "manifest.json").read_text())
    m["files"]["src/b.c"] = sha256_bytes(b"something else\n")
    (patches / "lab" / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    with pytest.raises(PatchError, match="src/b.c"):
        prepare_source(SourceSettings(target=tmp_path / "lab2", patches_dir=patches, without=(), fetch=fetch, lab=True))
    with pytest.raises(UsageError, match="whole series"):
        SourceSettings.resolve(tmp_path / "x", patches_dir=patches, lab=True, before=RESERVE)
    (tmp_path / "q2").mkdir()
    with pytest.raises(UsageError, match="no overlay"):
        SourceSettings.resolve(tmp_path / "x", patches_dir=_queue(tmp_path / "q2")[2], lab=True)
