"""Patch series: parsing, strict application with precise errors, manifest verification."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from rollkv_dist.errors import PatchError, UsageError
from rollkv_dist.series import (
    PROVENANCE_FILE,
    Manifest,
    PatchEntry,
    apply_patch,
    apply_queue,
    check_patches_match_manifest,
    file_state,
    make_manifest,
    parse_patch,
    read_series,
    select_series,
    verify_tree,
)

LINES = [f"line {i}\n" for i in range(1, 31)]

TWO_HUNKS = textwrap.dedent("""\
    From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
    From: Dev <dev@example.invalid>
    Subject: [PATCH] two hunks

    ---
    diff --git a/f.txt b/f.txt
    index 1111111..2222222 100644
    --- a/f.txt
    +++ b/f.txt
    @@ -2,3 +2,4 @@
     line 2
     line 3
    +inserted A
     line 4
    @@ -20,3 +21,4 @@ section
     line 20
     line 21
    +inserted B
     line 22
    diff --git a/new.txt b/new.txt
    new file mode 100644
    index 0000000..3333333
    --- /dev/null
    +++ b/new.txt
    @@ -0,0 +1 @@
    +hello
    """)


def make_tree(root: Path) -> Path:
    tree = root / "tree"
    tree.mkdir()
    (tree / "f.txt").write_text("".join(LINES))
    return tree


def test_parse_patch_files_and_hunks():
    diffs = parse_patch(TWO_HUNKS)
    assert [d.paths for d in diffs] == [["f.txt"], ["new.txt"]]
    assert diffs[1].old_path is None
    assert [start for start, _ in diffs[0].hunks] == [2, 20]


def test_parse_patch_rename_and_delete():
    text = textwrap.dedent("""\
        diff --git a/old/name.c b/new/name.c
        similarity index 100%
        rename from old/name.c
        rename to new/name.c
        diff --git a/gone.c b/gone.c
        deleted file mode 100644
        index 1111111..0000000
        --- a/gone.c
        +++ /dev/null
        @@ -1 +0,0 @@
        -x
        """)
    diffs = parse_patch(text)
    assert diffs[0].paths == ["new/name.c", "old/name.c"]
    assert diffs[1].paths == ["gone.c"] and diffs[1].new_path is None


def test_clean_patch_applies(tmp_path):
    tree = make_tree(tmp_path)
    patch = tmp_path / "0001-two-hunks.patch"
    patch.write_text(TWO_HUNKS)
    apply_patch(tree, patch)
    text = (tree / "f.txt").read_text()
    assert "inserted A\nline 4" in text and "inserted B\nline 22" in text
    assert (tree / "new.txt").read_text() == "hello\n"


def test_broken_hunk_names_patch_file_and_hunk(tmp_path):
    tree = make_tree(tmp_path)
    # upstream changed line 21: hunk 2's context no longer matches
    (tree / "f.txt").write_text("".join(LINES).replace("line 21\n", "line twenty-one\n"))
    patch = tmp_path / "0007-two-hunks.patch"
    patch.write_text(TWO_HUNKS)
    with pytest.raises(PatchError) as ei:
        apply_patch(tree, patch)
    msg = str(ei.value)
    assert "0007-two-hunks.patch" in msg
    assert "f.txt" in msg
    assert "hunk #2" in msg
    assert ei.value.exit_code == 5
    # git apply is atomic: nothing of the patch landed
    assert "inserted A" not in (tree / "f.txt").read_text()
    assert not (tree / "new.txt").exists()


def test_missing_file_is_named(tmp_path):
    tree = make_tree(tmp_path)
    (tree / "f.txt").unlink()
    patch = tmp_path / "0002-x.patch"
    patch.write_text(TWO_HUNKS)
    with pytest.raises(PatchError, match=r"0002-x\.patch.*f\.txt"):
        apply_patch(tree, patch)


def test_tree_inside_another_repository_is_still_patched(tmp_path):
    """git apply inside a repo would silently skip paths; rollkv stops git's discovery."""
    from _rollkv_tool_helpers import git

    outer = tmp_path / "outer"
    outer.mkdir()
    git(outer, "init", "-q")
    tree = make_tree(outer)
    patch = tmp_path / "0001-two-hunks.patch"
    patch.write_text(TWO_HUNKS)
    apply_patch(tree, patch)
    assert "inserted A" in (tree / "f.txt").read_text()


def test_read_series_ignores_comments_and_checks_files(tmp_path):
    (tmp_path / "0001-a.patch").write_text("x")
    (tmp_path / "series").write_text("# queue\n\n0001-a.patch  # first\n")
    assert read_series(tmp_path) == ["0001-a.patch"]
    (tmp_path / "series").write_text("0001-a.patch\n0002-missing.patch\n")
    with pytest.raises(PatchError, match="0002-missing.patch"):
        read_series(tmp_path)
    (tmp_path / "series").write_text("")
    assert read_series(tmp_path) == []


def test_select_series_without():
    names = ["0001-a.patch", "0089-rolling-kv-compute-reserve.patch", "0090-b.patch"]
    assert select_series(names, ("0089-rolling-kv-compute-reserve.patch",)) == [
        "0001-a.patch", "0090-b.patch"]
    with pytest.raises(UsageError, match="0042-nope.patch"):
        select_series(names, ("0042-nope.patch",))


def _applied(tmp_path: Path) -> tuple[Path, Path, Manifest]:
    tree = make_tree(tmp_path)
    pdir = tmp_path / "patches"
    pdir.mkdir()
    (pdir / "0001-two-hunks.patch").write_text(TWO_HUNKS)
    (pdir / "series").write_text("0001-two-hunks.patch\n")
    apply_patch(tree, pdir / "0001-two-hunks.patch")
    manifest = make_manifest([("0001-two-hunks.patch", (pdir / "0001-two-hunks.patch").read_bytes())],
                             lambda paths: {p: file_state(tree, p) for p in paths})
    return tree, pdir, manifest


def test_manifest_verifies_then_catches_a_changed_file(tmp_path):
    tree, _, manifest = _applied(tmp_path)
    assert sorted(manifest.files) == ["f.txt", "new.txt"]
    res = verify_tree(tree, manifest)
    assert res.status == "byte-identical-verified" and res.checked == 2
    (tree / "f.txt").write_text((tree / "f.txt").read_text() + "fuzz\n")
    with pytest.raises(PatchError, match="f.txt"):
        verify_tree(tree, manifest)


def test_a_packed_tree_may_lack_only_the_files_its_pack_left_out(tmp_path):
    tree, pdir, manifest = _applied(tmp_path)
    (tree / "new.txt").unlink()
    res = verify_tree(tree, manifest, packed_out=("new.txt",))  # listed by the pack: absent by design
    assert res.packed_out == ("new.txt",) and res.checked == 1
    with pytest.raises(PatchError, match="f.txt"):  # a listed file that is there is still checked
        (tree / "f.txt").write_text("changed\n")
        verify_tree(tree, manifest, packed_out=("f.txt", "new.txt"))
    # apply_queue reads the list from the tree's provenance, and says what was left out
    (tmp_path / "b").mkdir()
    tree2, pdir2, manifest2 = _applied(tmp_path / "b")
    (pdir2 / "manifest.json").write_text(manifest2.to_json())
    (tree2 / "new.txt").unlink()
    (tree2 / PROVENANCE_FILE).write_text(json.dumps({"series": ["0001-two-hunks.patch"], "packed_out": ["new.txt"]}))
    said = []
    assert apply_queue(tree2, pdir2, out=said.append).packed_out == ("new.txt",)
    assert said[-1] == "series: byte-identical-verified (1 files; left out by the pack: new.txt)"
    (tree2 / PROVENANCE_FILE).write_text(json.dumps({"series": ["0001-two-hunks.patch"]}))  # not listed: an error
    with pytest.raises(PatchError, match="new.txt.*absent"):
        apply_queue(tree2, pdir2, out=said.append)


def test_manifest_catches_a_missing_file_and_skips_excluded(tmp_path):
    tree, _, manifest = _applied(tmp_path)
    (tree / "new.txt").unlink()
    with pytest.raises(PatchError, match="new.txt.*absent"):
        verify_tree(tree, manifest)
    res = verify_tree(tree, manifest, excluded=("0001-two-hunks.patch",))
    assert res.status == "verified-except-excluded"
    assert res.skipped == ("f.txt", "new.txt") and res.checked == 0


def test_manifest_json_round_trip_is_stable(tmp_path):
    _, _, manifest = _applied(tmp_path)
    text = manifest.to_json()
    again = Manifest.from_json(text)
    assert again == manifest and again.to_json() == text
    with pytest.raises(PatchError, match="not a valid"):
        Manifest.from_json('{"schema": 99}')


def test_hand_edited_patch_is_caught(tmp_path):
    _, pdir, manifest = _applied(tmp_path)
    check_patches_match_manifest(pdir, ["0001-two-hunks.patch"], manifest)
    p = pdir / "0001-two-hunks.patch"
    p.write_text(p.read_text().replace("hello", "hallo"))
    with pytest.raises(PatchError, match="edited by hand"):
        check_patches_match_manifest(pdir, ["0001-two-hunks.patch"], manifest)
    with pytest.raises(PatchError, match="differs from the manifest"):
        check_patches_match_manifest(pdir, [], manifest)


def test_series_without_manifest_is_an_error_unless_empty(tmp_path):
    check_patches_match_manifest(tmp_path, [], None)
    with pytest.raises(PatchError, match="manifest.json is missing"):
        check_patches_match_manifest(tmp_path, ["0001-a.patch"], None)


def test_manifest_entry_files_are_per_patch(tmp_path):
    _, _, manifest = _applied(tmp_path)
    assert manifest.patches == (
        PatchEntry("0001-two-hunks.patch", manifest.patches[0].sha256, ("f.txt", "new.txt")),)


def _queue_dir(tmp_path: Path) -> Path:
    p = tmp_path / "patches"
    p.mkdir()
    (p / "0001-a.patch").write_text("")
    (p / "series").write_text("0001-a.patch\n")
    return p


def test_manifest_that_is_a_json_list_is_a_patch_error(tmp_path, capsys):
    from rollkv_dist import cli

    p = _queue_dir(tmp_path)
    (p / "manifest.json").write_text('[{"schema": 1}]\n')
    with pytest.raises(PatchError, match="JSON list, expected an object"):
        Manifest.load(p)
    rc = cli.main(["source", str(tmp_path / "t"), "--patches", str(p)])
    assert rc == PatchError.exit_code, capsys.readouterr().err


def test_series_that_is_not_utf8_is_a_patch_error(tmp_path, capsys):
    from rollkv_dist import cli

    p = _queue_dir(tmp_path)
    (p / "series").write_bytes(b"0001-a.patch\n# caf\xe9\n")
    with pytest.raises(PatchError, match=r"not UTF-8 text \(byte 18, line 2\)"):
        read_series(p)
    rc = cli.main(["source", str(tmp_path / "t"), "--patches", str(p)])
    err = capsys.readouterr().err
    assert rc == PatchError.exit_code and "internal error" not in err


def test_the_compute_reserve_patch_is_found_by_its_role(tmp_path):
    from rollkv_dist.series import COMPUTE_RESERVE_ROLE, patch_with_role

    real = Path(__file__).resolve().parents[1] / "patches"
    assert patch_with_role(real, COMPUTE_RESERVE_ROLE) == "0089-rolling-kv-compute-reserve.patch"
    q = tmp_path / "q"
    q.mkdir()
    body = "---\ndiff --git a/f b/f\n"
    # renumbered and renamed: the trailer still marks it; a name alone marks it when there is no trailer
    (q / "0001-a.patch").write_text("Subject: [PATCH] a\n\n" + body)
    (q / "0120-measure-the-reserve.patch").write_text(
        "Subject: [PATCH] r\n\nRollkv-Patch: 0120-rolling-kv-compute-reserve\n" + body)
    (q / "series").write_text("0001-a.patch\n0120-measure-the-reserve.patch\n")
    assert patch_with_role(q, COMPUTE_RESERVE_ROLE) == "0120-measure-the-reserve.patch"
    # a trailer naming another role wins over the file name; a series without the role gives None
    (q / "0005-rolling-kv-compute-reserve.patch").write_text("Subject: x\n\nRollkv-Patch: 0005-other\n" + body)
    (q / "series").write_text("0001-a.patch\n0005-rolling-kv-compute-reserve.patch\n")
    assert patch_with_role(q, COMPUTE_RESERVE_ROLE) is None
    (q / "0130-rolling-kv-compute-reserve.patch").write_text("Subject: y\n\n" + body)
    (q / "series").write_text("0120-measure-the-reserve.patch\n0130-rolling-kv-compute-reserve.patch\n")
    with pytest.raises(PatchError, match="all claim the role"):
        patch_with_role(q, COMPUTE_RESERVE_ROLE)


def test_a_package_build_refuses_a_tree_that_carries_the_lab_overlay(tmp_path):
    """The recipe's and the flake's apply step (apply_queue) takes the series alone: a tree made with
    `rollkv source --lab` (its provenance lists the overlay) is refused, even where the series matches."""
    tree, pdir, manifest = _applied(tmp_path)
    (pdir / "manifest.json").write_text(manifest.to_json())
    (tree / PROVENANCE_FILE).write_text(json.dumps({"series": ["0001-two-hunks.patch"], "lab": ["0001-switch.patch"]}))
    with pytest.raises(PatchError, match="carries the lab overlay .0001-switch.patch."):
        apply_queue(tree, pdir, out=lambda _: None)
    (tree / PROVENANCE_FILE).write_text(json.dumps({"series": ["0001-two-hunks.patch"]}))
    assert apply_queue(tree, pdir, out=lambda _: None).status == "byte-identical-verified"
