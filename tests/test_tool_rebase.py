"""`rollkv patches rebase`: the series replayed onto another release of a small synthetic sdist (the real
rehearsal, onto llama-cpp-python 0.3.35, is in reports/2026-12-03-rebase-0.3.35/)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from _rollkv_tool_helpers import MINI_FILES, empty_queue, git, mini_fetch

from rollkv_dist import rebase
from rollkv_dist.errors import UsageError
from rollkv_dist.fetch import FetchSettings, fetch_sdist
from rollkv_dist.patches import check_queue, write_queue
from rollkv_dist.pin import load_pin

HEAD = "4df29be4f0123456789abcdef0123456789abcde"
CMAKE = "set(LLAMA_VERSION_MAJOR 0)\nset(LLAMA_VERSION_MINOR 7)\nset(LLAMA_VERSION_PATCH 1)\nproject(mini)\n"


def release(root: Path, version: str, files: dict[str, str], head: str | None = HEAD) -> tuple[Path, str]:
    """Another release of the mini project: its sdist (the tree, and the submodule HEAD it records) and sha256."""
    top = f"mini_pkg-{version}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        def add(name: str, text: str) -> None:
            data = text.encode()
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 1000
            tf.addfile(ti, io.BytesIO(data))

        if head:
            add(f"{top}/.git/modules/vendor/llama.cpp/HEAD", head + "\n")
        for rel, text in files.items():
            add(f"{top}/vendor/llama.cpp/{rel}", text)
    path = root / f"{top}.tar.gz"
    path.write_bytes(buf.getvalue())
    return path, hashlib.sha256(buf.getvalue()).hexdigest()


def queue(tmp_path: Path) -> tuple[FetchSettings, Path]:
    """patches/ of two patches on the mini pin: one edits src/a.c, one adds src/new.c."""
    fetch, repo = empty_queue(tmp_path, "q")
    (repo / "src" / "a.c").write_text((repo / "src" / "a.c").read_text().replace("int a5 = 5;", "int a5 = 55;"))
    git(repo, "commit", "-q", "-am", "Window: a5")
    (repo / "src" / "new.c").write_text("int n;\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Window: new file")
    patches = tmp_path / "patches"
    write_queue(repo, patches, fetch.pin)
    return fetch, patches


def moved_onto(tmp_path: Path, files: dict[str, str], head: str | None = HEAD):
    fetch, patches = queue(tmp_path)
    sdist, sha = release(tmp_path, "2.0", files, head)
    new_pin = rebase.release_pin(sdist, "2.0", sha, fetch.pin)
    repo = tmp_path / "moving"
    repo.mkdir()
    outcomes = rebase.rebase(repo, fetch_sdist(fetch), sdist, new_pin, patches, fetch.pin)
    return fetch, patches, sdist, new_pin, repo, outcomes


def shifted() -> dict[str, str]:
    """The release: three lines before a5 in src/a.c (the patch moves), a version in CMakeLists.txt."""
    files = dict(MINI_FILES, **{"CMakeLists.txt": CMAKE})
    files["src/a.c"] = "int z0;\nint z1;\nint z2;\n" + MINI_FILES["src/a.c"]
    return files


def test_the_pin_of_a_release_comes_from_its_sdist(tmp_path):
    sdist, sha = release(tmp_path, "2.0", shifted())
    fetch = mini_fetch(tmp_path)
    pin = rebase.release_pin(sdist, "2.0", sha, fetch.pin)
    assert (pin.version, pin.sha256, pin.llama_commit, pin.llama_version) == ("2.0", sha, HEAD[:9], "0.7.1")
    assert pin.sri.startswith("sha256-") and len(pin.sri) == 51 and (pin.project, pin.tree) == (
        fetch.pin.project, fetch.pin.tree)
    no_head, sha2 = release(tmp_path / "..", "2.0", shifted(), head=None)
    with pytest.raises(UsageError, match="no llama.cpp commit recorded"):
        rebase.release_pin(no_head, "2.0", sha2, fetch.pin)
    no_version, sha3 = release(tmp_path, "2.0", MINI_FILES)
    with pytest.raises(UsageError, match="LLAMA_VERSION_MAJOR"):
        rebase.release_pin(no_version, "2.0", sha3, fetch.pin)


def test_a_clean_replay_moves_the_queue_and_the_pin(tmp_path):
    fetch, patches, sdist, new_pin, repo, outcomes = moved_onto(tmp_path, shifted())
    assert [(o.result, o.lines_changed) for o in outcomes] == [("moved", 0), ("same", 0)]
    assert [o.upstream_lines for o in outcomes] == [3, 0]  # src/a.c's three new lines; CMakeLists.txt is no patch's
    before = {n: (patches / n).read_text() for n in ("0001-window-a5.patch", "0002-window-new-file.patch")}
    pin_file = tmp_path / "pin.toml"
    pin_file.write_text((Path(rebase.__file__).with_name("pin.toml")).read_text())
    names = rebase.finish(repo, patches, pin_file)
    assert names == ["0001-window-a5.patch", "0002-window-new-file.patch"]
    assert load_pin(pin_file) == new_pin
    # the exported queue is the series of the new release: it applies there byte for byte
    assert check_queue(patches, FetchSettings(cache_dir=tmp_path / "cache", pin=new_pin, sdist=sdist)) == 0
    # the first patch differs only in its hunk's position (and the blob ids), the second not at all
    def body(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if not ln.startswith(("@@", "index "))]

    new = {n: (patches / n).read_text() for n in names}
    assert new[names[1]] == before[names[1]]
    assert new[names[0]] != before[names[0]] and body(new[names[0]]) == body(before[names[0]])


def test_a_conflict_stops_at_the_patch_and_names_its_files_then_finish_after_the_fix(tmp_path):
    files = dict(MINI_FILES, **{"CMakeLists.txt": CMAKE})
    files["src/a.c"] = MINI_FILES["src/a.c"].replace("int a5 = 5;", "int a5 = 6;")
    fetch, patches, sdist, new_pin, repo, outcomes = moved_onto(tmp_path, files)
    assert [(o.name, o.result) for o in outcomes] == [("0001-window-a5.patch", "conflict"),
                                                    ("0002-window-new-file.patch", "not reached")]
    assert outcomes[0].files == ["src/a.c"] and outcomes[0].upstream_lines == 2
    pin_file = tmp_path / "pin.toml"
    pin_file.write_text(Path(rebase.__file__).with_name("pin.toml").read_text())
    with pytest.raises(UsageError, match="still mid-rebase"):
        rebase.finish(repo, patches, pin_file)
    # the user resolves it: the patch's value wins
    (repo / "src" / "a.c").write_text(files["src/a.c"].replace("int a5 = 6;", "int a5 = 55;"))
    git(repo, "add", "src/a.c")
    env = dict(os.environ, GIT_EDITOR="true", GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
               GIT_COMMITTER_NAME="Dev", GIT_COMMITTER_EMAIL="dev@example.invalid")
    p = subprocess.run(["git", "rebase", "--continue"], cwd=repo, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr + p.stdout
    names = rebase.finish(repo, patches, pin_file)
    assert len(names) == 2 and load_pin(pin_file) == new_pin
    assert check_queue(patches, FetchSettings(cache_dir=tmp_path / "cache", pin=new_pin, sdist=sdist)) == 0


def test_a_patch_the_release_already_has_is_dropped(tmp_path):
    files = dict(shifted())
    files["src/new.c"] = "int n;\n"
    *_, outcomes = moved_onto(tmp_path, files)
    assert [o.result for o in outcomes] == ["moved", "dropped"]


def test_finish_without_a_rebase_is_a_usage_error(tmp_path):
    d = tmp_path / "r"
    (d / ".git").mkdir(parents=True)
    with pytest.raises(UsageError, match="not a queue being moved"):
        rebase.finish(d, tmp_path / "patches", tmp_path / "pin.toml")


def test_the_pin_template_keeps_its_comments():
    text = Path(rebase.__file__).with_name("pin.toml").read_text()
    from rollkv_dist.pin import PIN

    assert rebase.pin_text(PIN, text) == text  # the pin itself changes nothing


def test_the_command_refuses_bad_input_with_what_to_give(tmp_path, capsys):
    from rollkv_dist import cli
    from rollkv_dist.pin import PIN

    def err(*args: str) -> str:
        assert cli.main(["patches", "rebase", *args]) == 2
        return capsys.readouterr().err

    assert "--onto VERSION and --sha256 HEX are needed" in err(str(tmp_path / "a"), "--onto", "0.3.35")
    assert "is not 64 hex digits" in err(str(tmp_path / "a"), "--onto", "0.3.35", "--sha256", "abc")
    assert "is the pinned version already" in err(str(tmp_path / "a"), "--onto", PIN.version, "--sha256", "0" * 64)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "is not empty" in err(str(tmp_path / "full"), "--onto", "0.3.35", "--sha256", "0" * 64)
    assert "not a queue being moved" in err(str(tmp_path / "full"), "--finish")
