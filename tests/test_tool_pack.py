"""rollkv pack: trimming rules and the archive's content."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from rollkv_dist.errors import TargetError, UsageError
from rollkv_dist.pack import KEEP, TESTS, PackSettings, is_dropped, iter_kept, write_archive
from rollkv_dist.series import Manifest, PatchEntry, pin_info
from rollkv_dist.source import PROVENANCE_FILE


@pytest.mark.parametrize("rel", [
    "docs", "docs/build.md", "media/llama.png", "benches/x/y.json", "examples/simple/simple.cpp",
    "tests/test-backend-ops.cpp", "models/ggml-vocab-llama-bpe.gguf", "models/templates/x.jinja",
    "tools/ui/src/app.svelte", "tools/ui/package-lock.json", "tools/server/tests/unit/t.py",
    "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "ggml/src/ggml-metal", "ggml/src/ggml-hip/x",
    "convert_hf_to_gguf.py", "build-cpu/CMakeCache.txt", "gguf-py/gguf/__pycache__/x.pyc",
    "tools/mtmd/test-3.mp4",
])
def test_dropped(rel):
    assert is_dropped(rel)


@pytest.mark.parametrize("rel", [
    "CMakeLists.txt", "LICENSE", "licenses/LICENSE-curl", "cmake/build-info.cmake",
    "models", "models/ggml-vocab-qwen2.gguf", "src/llama.cpp", "include/llama.h",
    "common/arg.cpp", "ggml/src/ggml-cpu/ggml-cpu.c", "ggml/src/ggml-cuda/fattn.cu",
    "ggml/include/ggml-vulkan.h", "tools/ui/CMakeLists.txt", "tools/ui/ui.cpp.in",
    "tools/server/server.cpp", "tools/mtmd/clip.cpp", "tools/logits-dump/logits-dump.cpp",
    "scripts/ui-assets.cmake", "gguf-py/gguf/gguf_writer.py", "vendor/cpp-httplib/httplib.h",
])
def test_kept(rel):
    assert not is_dropped(rel)


@pytest.mark.parametrize("rel", ["tests", "tests/test-llama-archs.cpp", "tests/CMakeLists.txt",
                                 "tests/peg-parser/x.cpp"])
def test_with_tests_keeps_upstreams_tests(rel):
    from rollkv_dist.pack import KEEP, TESTS

    assert is_dropped(rel)
    assert not is_dropped(rel, KEEP + (TESTS,))
    # build outputs stay out of a kept folder, and the rest of the trimming holds
    assert is_dropped("tests/__pycache__/x.pyc", KEEP + (TESTS,))
    assert is_dropped("docs/build.md", KEEP + (TESTS,)) and is_dropped("models/ggml-vocab-gpt-2.gguf", KEEP + (TESTS,))


def make_tree(root: Path) -> Path:
    t = root / "tree"
    for rel in ("CMakeLists.txt", "src/llama.cpp", "docs/readme.md", "models/ggml-vocab-qwen2.gguf",
                "models/ggml-vocab-gpt-2.gguf", "tools/ui/CMakeLists.txt", "tools/ui/src/a.ts",
                "build-cpu/CMakeCache.txt"):
        p = t / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel + "\n")
    (t / PROVENANCE_FILE).write_text(json.dumps({"series": ["0001-a.patch"]}))
    return t


def make_patches(root: Path) -> Path:
    """A queue of one patch that touches a kept file and one under upstream's tests/ (as 0096 does)."""
    p = root / "patches"
    p.mkdir()
    (p / "0001-a.patch").write_text("patch\n")
    (p / "series").write_text("0001-a.patch\n")
    touched = ("src/llama.cpp", "tests/test-llama-archs.cpp")
    manifest = Manifest(pin=pin_info(), patches=(PatchEntry("0001-a.patch", "0" * 64, touched),),
                        files={rel: "1" * 64 for rel in touched})
    (p / "manifest.json").write_text(manifest.to_json())
    (p / "notes.txt").write_text("not part of the queue\n")
    return p


def archived_provenance(archive: Path) -> dict:
    with tarfile.open(archive) as tf:
        return json.loads(tf.extractfile(f"{archive.name[:-len('.tar.xz')]}/{PROVENANCE_FILE}").read())


def test_the_archive_lists_the_touched_files_it_leaves_out(tmp_path):
    """A patch to upstream's tests/ in an archive without them: the build's check of the patched tree must know
    the file is absent by design (series.verify_tree's packed_out), and only that file."""
    t = make_tree(tmp_path)
    (t / "tests").mkdir()
    (t / "tests" / "test-llama-archs.cpp").write_text("x\n")
    p = make_patches(tmp_path)
    without, with_tests = tmp_path / "a" / "rollkv-src.tar.xz", tmp_path / "b" / "rollkv-src.tar.xz"
    without.parent.mkdir()
    with_tests.parent.mkdir()
    write_archive(t, p, without, "rollkv-src", 946684800)
    write_archive(t, p, with_tests, "rollkv-src", 946684800, KEEP + (TESTS,))
    prov = archived_provenance(without)
    assert prov["packed_out"] == ["tests/test-llama-archs.cpp"] and prov["series"] == ["0001-a.patch"]
    assert archived_provenance(with_tests)["packed_out"] == []


def test_iter_kept_on_a_tree(tmp_path):
    t = make_tree(tmp_path)
    kept = [rel for _, rel in iter_kept(t)]
    assert kept == ["CMakeLists.txt", PROVENANCE_FILE, "models", "models/ggml-vocab-qwen2.gguf",
                    "src", "src/llama.cpp", "tools", "tools/ui", "tools/ui/CMakeLists.txt"]


def test_archive_content_and_reproducibility(tmp_path):
    t = make_tree(tmp_path)
    p = make_patches(tmp_path)
    a1 = tmp_path / "one" / "rollkv-src.tar.xz"
    a2 = tmp_path / "two" / "rollkv-src.tar.xz"
    a1.parent.mkdir()
    a2.parent.mkdir()
    write_archive(t, p, a1, "rollkv-src", 946684800)
    write_archive(t, p, a2, "rollkv-src", 946684800)
    assert a1.read_bytes() == a2.read_bytes()
    with tarfile.open(a1) as tf:
        names = tf.getnames()
        assert all(m.uid == 0 and m.mtime == 946684800 for m in tf.getmembers())
    assert "rollkv-src/models/ggml-vocab-qwen2.gguf" in names
    assert f"rollkv-src/{PROVENANCE_FILE}" in names
    assert {"rollkv-src/patches/series", "rollkv-src/patches/0001-a.patch",
            "rollkv-src/patches/manifest.json"} <= set(names)
    assert "rollkv-src/patches/notes.txt" not in names
    assert not any("docs" in n or "gpt-2" in n or "build-cpu" in n or "ui/src" in n
                   for n in names)


def test_archive_needs_a_rollkv_tree(tmp_path):
    t = make_tree(tmp_path)
    (t / PROVENANCE_FILE).unlink()
    with pytest.raises(UsageError, match="rollkv source"):
        write_archive(t, make_patches(tmp_path), tmp_path / "x.tar.xz", "x", 0)
    assert not (tmp_path / "x.tar.xz").exists()


def test_pack_settings(tmp_path):
    p = make_patches(tmp_path)
    with pytest.raises(UsageError, match=".tar.xz"):
        PackSettings.resolve(str(tmp_path / "out.zip"), None, str(p))
    (tmp_path / "out.tar.xz").write_text("")
    with pytest.raises(TargetError):
        PackSettings.resolve(str(tmp_path / "out.tar.xz"), None, str(p))
    s = PackSettings.resolve(str(tmp_path / "new.tar.xz"), str(tmp_path), str(p))
    assert s.root_name == "new" and s.source == tmp_path
    assert "tests" not in s.keep
    assert "tests" in PackSettings.resolve(str(tmp_path / "new.tar.xz"), str(tmp_path), str(p), with_tests=True).keep


def test_pack_makes_the_source_itself(tmp_path):
    from _rollkv_tool_helpers import mini_fetch

    from rollkv_dist.pack import run_pack

    p = tmp_path / "patches"
    p.mkdir()
    (p / "series").write_text("")
    out = tmp_path / "out" / "mini-src.tar.xz"
    out.parent.mkdir()
    s = PackSettings(out=out, source=None, patches_dir=p, without=(),
                     fetch=mini_fetch(tmp_path), mtime=0, root_name="mini-src")
    assert run_pack(s) == out
    with tarfile.open(out) as tf:
        names = tf.getnames()
        prov = json.loads(tf.extractfile(f"mini-src/{PROVENANCE_FILE}").read())
    assert "mini-src/src/a.c" in names and "mini-src/patches/series" in names
    assert "mini-src/models/vocab.gguf" not in names
    assert prov["series"] == [] and prov["pin"]["project"] == "mini-pkg"
    assert sorted(x.name for x in out.parent.iterdir()) == ["mini-src.tar.xz"], "temp tree left"


def test_pack_makes_the_folders_of_its_archive_and_takes_them_back_if_it_fails(tmp_path, monkeypatch):
    """A fresh checkout has no .carry/: `rollkv pack .carry/x.tar.xz` makes it (before: ENOENT on its temporary
    tree); a pack that fails leaves no folder it made, and a file where a folder belongs is a clear error."""
    from _rollkv_tool_helpers import mini_fetch

    from rollkv_dist import pack

    p = tmp_path / "patches"
    p.mkdir()
    (p / "series").write_text("")

    def settings(out: Path) -> PackSettings:
        return PackSettings(out=out, source=None, patches_dir=p, without=(), fetch=mini_fetch(tmp_path), mtime=0,
                            root_name=out.name[: -len(".tar.xz")])

    out = tmp_path / "new" / "deeper" / "mini-src.tar.xz"
    assert pack.run_pack(settings(out)) == out and tarfile.is_tarfile(out)
    assert sorted(x.name for x in out.parent.iterdir()) == ["mini-src.tar.xz"]

    def interrupted(ti, mtime):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "_normalise", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack.run_pack(settings(tmp_path / "other" / "deeper" / "x.tar.xz"))
    assert not (tmp_path / "other").exists()
    monkeypatch.undo()
    (tmp_path / "afile").write_text("")
    with pytest.raises(TargetError, match="is not a folder"):
        pack.run_pack(settings(tmp_path / "afile" / "x.tar.xz"))


def test_two_packs_to_one_name_never_share_a_file(tmp_path, monkeypatch):
    """A second `pack` to the same OUT, started and finished while the first is writing: each
    writes its own temporary file; the archive that lands is complete and the other writer is
    refused (before: both wrote `.OUT.tmp`, and one exited 0 with a corrupt archive)."""
    from rollkv_dist import pack

    t = make_tree(tmp_path)
    p = make_patches(tmp_path)
    out = tmp_path / "out" / "rollkv-src.tar.xz"
    out.parent.mkdir()
    real = pack._normalise
    second: dict[str, object] = {}

    def interleave(ti, mtime):
        if ti.name.endswith("src/llama.cpp") and not second:
            second["started"] = True
            try:
                second["count"] = write_archive(t, p, out, "rollkv-src", 0)
            except Exception as e:  # noqa: BLE001 - recorded and asserted below
                second["error"] = e
        return real(ti, mtime)

    monkeypatch.setattr(pack, "_normalise", interleave)
    try:
        first = write_archive(t, p, out, "rollkv-src", 0)
        first_error = None
    except Exception as e:  # noqa: BLE001
        first, first_error = None, e
    assert "error" not in second, second.get("error")
    assert isinstance(first_error, TargetError) and "created by someone else" in str(first_error)
    with tarfile.open(out) as tf:  # complete and readable to the end
        names = tf.getnames()
        assert all(tf.extractfile(m) is not None for m in tf.getmembers() if m.isfile())
    assert "rollkv-src/src/llama.cpp" in names and "rollkv-src/patches/series" in names
    assert first is None and second["count"] > 0
    assert [x.name for x in out.parent.iterdir()] == ["rollkv-src.tar.xz"], "temporary file left"


def test_failed_pack_leaves_nothing(tmp_path, monkeypatch):
    from rollkv_dist import pack

    t = make_tree(tmp_path)
    p = make_patches(tmp_path)
    out = tmp_path / "out" / "x.tar.xz"
    out.parent.mkdir()

    def interrupted(ti, mtime):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "_normalise", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_archive(t, p, out, "x", 0)
    assert list(out.parent.iterdir()) == []


def test_a_lab_tree_carries_its_overlay_and_a_build_commit_that_says_so(tmp_path):
    """A tree made with --lab packs patches/lab/ beside the series (and a product tree does not), and a build of it
    names the overlay in LLAMA_BUILD_COMMIT, so a comparison build is never taken for the product."""
    from rollkv_dist.series import build_commit

    t = make_tree(tmp_path)
    p = make_patches(tmp_path)
    (p / "lab").mkdir()
    (p / "lab" / "0001-switch.patch").write_text("lab patch\n")
    (p / "lab" / "series").write_text("0001-switch.patch\n")
    (p / "lab" / "manifest.json").write_text(Manifest(pin=pin_info(), patches=(), files={}).to_json())
    plain, lab = tmp_path / "a" / "rollkv-src.tar.xz", tmp_path / "b" / "rollkv-src.tar.xz"
    plain.parent.mkdir()
    lab.parent.mkdir()
    write_archive(t, p, plain, "rollkv-src", 946684800)
    (t / PROVENANCE_FILE).write_text(json.dumps({"series": ["0001-a.patch"], "lab": ["0001-switch.patch"]}))
    write_archive(t, p, lab, "rollkv-src", 946684800)
    with tarfile.open(plain) as tf:
        assert not any("/patches/lab" in n for n in tf.getnames())
    with tarfile.open(lab) as tf:
        assert {"rollkv-src/patches/lab/series", "rollkv-src/patches/lab/manifest.json",
                "rollkv-src/patches/lab/0001-switch.patch"} <= set(tf.getnames())
    assert build_commit(["0001-a.patch"], lab=["0001-switch.patch"]).endswith("+rollkv.1-lab-0001")
    with pytest.raises(UsageError, match="--lab"):
        PackSettings.resolve(str(tmp_path / "c.tar.xz"), str(t), str(p), lab=True)
