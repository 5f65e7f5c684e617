"""environment.yml: conda-forge only, and everything the dev workflow calls is in it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _names(deps):
    names = set()
    for dep in deps:
        if isinstance(dep, str):
            names.add(re.split(r"[\s=<>!]", dep, maxsplit=1)[0])
    return names


def test_environment_channels_and_dependencies():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    names = _names(env["dependencies"])
    required = {
        "python", "nox", "pytest", "requests", "nvidia-ml-py", "conda-build",
        "cmake", "ninja", "c-compiler", "cxx-compiler", "cuda-nvcc",
        "cuda-cudart-dev", "libcublas-dev", "numpy", "matplotlib",
        "conda-package-handling", "py-rattler",
    }
    assert required <= names, sorted(required - names)
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python "))
    assert python.split()[1].startswith("3.11")


def test_environment_cuda_renders_a_recipe_variant():
    """The dev environment's CUDA (its nvcc) is the variant `rollkv channel` builds there."""
    from rollkv_dist.channel import render_meta
    from rollkv_dist.detect import cuda_variant

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    spec = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("cuda-version"))
    version = spec.split()[1].rstrip(".*")
    variant = cuda_variant(version)
    meta = render_meta(ROOT / "recipe", variant.conda_config())
    # the build string starts with the variant's one name (cuda130), the name `rollkv build --variant` takes
    assert meta["build"]["string"].startswith(variant.name + "_") and variant.name == "cuda" + version.replace(".", "")
    assert f"cuda-version {version}" in meta["requirements"]["host"]
