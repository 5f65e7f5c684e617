"""The one pin of upstream: llama.cpp as vendored in the llama-cpp-python sdist.

Every consumer (the `rollkv` tool, the conda recipe, the Nix flake) reads or is
checked against these values.
"""

from __future__ import annotations

from dataclasses import dataclass


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


PIN = UpstreamPin(
    project="llama-cpp-python",
    version="0.3.36",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    sri="sha256-gy2waZAH8b6Vp+Qe8S6IkmsCuoNkYeNqNjctsnYMGi4=",
    tree="vendor/llama.cpp",
    llama_commit="0c1e57098",
    llama_version="0.5.0",
)
