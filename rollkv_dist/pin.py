"""The one pin of upstream: llama.cpp as vendored in the llama-cpp-python sdist.

Its values live in pin.toml beside this file, which the conda recipe (load_file_data) and the Nix
package (builtins.fromTOML) read too; this module reads and checks them.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from rollkv_dist.errors import UsageError

PIN_FILE = Path(__file__).resolve().with_name("pin.toml")


@dataclass(frozen=True)
class UpstreamPin:
    project: str
    version: str
    sha256: str
    sri: str
    tree: str
    llama_commit: str
    llama_version: str
    """LLAMA_VERSION_MAJOR.MINOR.PATCH of the tree's CMakeLists.txt (the programs say
    <this>-dev; the conda package version starts with it)."""

    @property
    def sdist_filename(self) -> str:
        return f"{self.project.replace('-', '_')}-{self.version}.tar.gz"

    @property
    def sdist_root(self) -> str:
        """Top-level folder inside the sdist."""
        return f"{self.project.replace('-', '_')}-{self.version}"

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version} --hash=sha256:{self.sha256}"


# what each value must look like (the file is hand-edited, and three languages read it)
_FORMATS = {
    "project": r"[A-Za-z0-9][A-Za-z0-9._-]*",
    "version": r"[0-9][0-9A-Za-z.+-]*",
    "sha256": r"[0-9a-f]{64}",
    "sri": r"sha256-[A-Za-z0-9+/]{43}=",
    "tree": r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*",
    "llama_commit": r"[0-9a-f]{7,40}",
    "llama_version": r"[0-9]+\.[0-9]+\.[0-9]+",
}


def load_pin(path: Path = PIN_FILE) -> UpstreamPin:
    """The pin in PATH (TOML): every field of UpstreamPin, each a string of its form, nothing else."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"{path}: cannot read the pin: {e}") from e
    names = [f.name for f in fields(UpstreamPin)]
    missing = [n for n in names if n not in data]
    extra = [n for n in data if n not in names]
    if missing or extra:
        raise UsageError(f"{path}: the pin needs exactly {', '.join(names)}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unknown {', '.join(extra)}" if extra else ""))
    for n in names:
        if not isinstance(data[n], str) or not re.fullmatch(_FORMATS[n], data[n]):
            raise UsageError(f"{path}: {n} = {data[n]!r} is not of the form {_FORMATS[n]}")
    return UpstreamPin(**{n: data[n] for n in names})


PIN = load_pin()
