"""Shared helpers for the tests of the rollkv tool (fetch, series, queue, source, pack)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

from rollkv_dist.fetch import FetchSettings
from rollkv_dist.pin import UpstreamPin

MINI_FILES = {
    "CMakeLists.txt": "project(mini)\n",
    "src/a.c": "".join(f"int a{i} = {i};\n" for i in range(40)),
    "src/b.c": "int b = 1;\n",
    "include/x.h": "#pragma once\n",
    ".gitignore": "*.gguf\n",
    "models/vocab.gguf": "not really a gguf\n",
}


def make_mini_sdist(root: Path, files: dict[str, str] | None = None) -> tuple[Path, UpstreamPin]:
    """A small sdist shaped like the pinned one (tree in vendor/llama.cpp) and its pin."""
    files = MINI_FILES if files is None else files
    top = "mini_pkg-1.0"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        def add(name: str, data: bytes, mode: int = 0o644) -> None:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = mode
            ti.mtime = 1000
            tf.addfile(ti, io.BytesIO(data))

        add(f"{top}/setup.py", b"# outside the tree\n")
        add(f"{top}/vendor/llama.cpp/.git", b"gitdir: ../../.git/modules/vendor/llama.cpp\n")
        for rel, text in files.items():
            add(f"{top}/vendor/llama.cpp/{rel}", text.encode())
    data = buf.getvalue()
    path = root / f"{top}.tar.gz"
    path.write_bytes(data)
    pin = UpstreamPin(project="mini-pkg", version="1.0", sha256=hashlib.sha256(data).hexdigest(),
                      sri="", tree="vendor/llama.cpp", llama_commit="abc1234", llama_version="0.1.0")
    return path, pin


def make_build_tree(root: Path) -> Path:
    """The least `rollkv build` takes for a llama.cpp tree (CMakeLists.txt and ggml/)."""
    t = root / "llama.cpp"
    (t / "ggml").mkdir(parents=True)
    (t / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    return t


def mini_fetch(tmp: Path) -> FetchSettings:
    sdist, pin = make_mini_sdist(tmp)
    return FetchSettings(cache_dir=tmp / "cache", pin=pin, sdist=sdist)


def git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
               GIT_AUTHOR_NAME="Dev", GIT_AUTHOR_EMAIL="dev@example.invalid",
               GIT_COMMITTER_NAME="Dev", GIT_COMMITTER_EMAIL="dev@example.invalid",
               GIT_AUTHOR_DATE="2026-01-02T03:04:05+0000",
               GIT_COMMITTER_DATE="2026-01-02T03:04:05+0000",
               GIT_CEILING_DIRECTORIES=str(repo.parent))
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True,
                          capture_output=True, text=True).stdout


def empty_queue(tmp: Path, name: str = "repo") -> tuple[FetchSettings, Path]:
    """The mini pin and a queue repository of it with no patch yet (its base commit only)."""
    from rollkv_dist.fetch import fetch_sdist
    from rollkv_dist.patches import make_queue_repo

    fetch = mini_fetch(tmp)
    empty = tmp / "empty"
    empty.mkdir(exist_ok=True)
    (empty / "series").write_text("")
    repo = tmp / name
    repo.mkdir()
    make_queue_repo(repo, fetch_sdist(fetch), empty, [], fetch.pin)
    return fetch, repo
