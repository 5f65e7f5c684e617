"""`rollkv recipe export DIR`: a self-contained, feedstock-ready copy of recipe/.

The recipe in the repository reads its values from the checkout (rollkv_dist/pin.toml,
patches/series through `..`) and its sdist from rollkv's cache. The export is what
conda-build, conda-smithy's linter and a feedstock get:

* meta.yaml with the block between the rollkv-values markers replaced by the values
  themselves (version, sha256, series, its digest, home, maintainers, source URL);
* the source URL of the pinned sdist as pip resolves it with its own configuration (pip's
  link finder, the same lookup `pip download` does; this repository names no index), or
  `--source-url` (e.g. file:// of a verified local copy for an offline build);
* the patch queue (series, its patches, manifest.json) in patches/, and rollkv_dist's
  series tool and build definition (cmake/) in rollkv_dist/, referenced by relative `path:`
  sources, so nothing is read from `..` or $HOME;
* build.sh and run_test.sh; no conda_build_config.yaml: the variants (CUDA versions,
  compilers) come from conda-forge's global pinning or from `rollkv channel`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rollkv_dist.commands import add_command
from rollkv_dist import log
from rollkv_dist.errors import FetchError, UsageError
from rollkv_dist.pin import PIN, UpstreamPin
from rollkv_dist.proc import run as run_process
from rollkv_dist.series import (
    MANIFEST_FILE,
    SERIES_FILE,
    Manifest,
    check_patches_match_manifest,
    read_series,
    series_digest,
)
from rollkv_dist.util import check_empty_target, default_patches_dir, staged_directory

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipe"
PACKAGE_NAME = "rollkv-llamafile"
VALUES_BEGIN = "{#- rollkv-values -#}"
VALUES_END = "{#- /rollkv-values -#}"
RECIPE_FILES = ("meta.yaml", "build.sh", "run_test.sh")
# what `python -m rollkv_dist.series` imports, and the build definition
TOOL_FILES = ("__init__.py", "errors.py", "pin.py", "pin.toml", "util.py", "proc.py", "series.py",
              "cmake/rollkv.cmake", "cmake/rollkv-programs.cmake", "cmake/rollkv-install.cmake")

# pip's own link finder (pip download's lookup, pip's configuration): the URL of the pinned
# sdist file. Run in a child interpreter, since it uses pip's internal API.
_PIP_FIND = r"""
import json, sys
from pip._internal.commands import create_command
project, version, filename, sha256 = sys.argv[1:5]
cmd = create_command("download")
options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", "-d", ".",
                             f"{project}=={version}"])
with cmd.main_context():
    session = cmd.get_default_session(options)
    finder = cmd._build_package_finder(options=options, session=session, target_python=None,
                                       ignore_requires_python=True)
    links = [c.link for c in finder.find_all_candidates(project)]
for link in links:
    if link.filename == filename:
        hashes = link.as_hashes() if hasattr(link, "as_hashes") else None
        ok = hashes is None or not hashes.digest_count or hashes.is_hash_allowed("sha256", sha256)
        print(json.dumps({"url": link.url_without_fragment, "hash_ok": bool(ok)}))
        sys.exit(0)
sys.exit(f"pip found no file {filename} for {project} {version}")
"""


def pip_sdist_url(pin: UpstreamPin = PIN, python: str = sys.executable) -> str:
    """Where pip would download the pinned sdist from (its index configuration applies)."""
    try:
        proc = run_process([python, "-c", _PIP_FIND, pin.project, pin.version, pin.sdist_filename,
                            pin.sha256], capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise FetchError(f"pip did not resolve the URL of {pin.sdist_filename} within 300 s: check "
                         f"pip's index configuration and network, or pass --source-url") from exc
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip could not resolve the URL of {pin.sdist_filename} ({tail}): "
                         f"check pip's index configuration and network, or pass --source-url")
    found = json.loads(proc.stdout)
    if not found["hash_ok"]:
        raise FetchError(f"the index pip uses lists {pin.sdist_filename} with another sha256 "
                         f"than the pin {pin.sha256}: it serves a different file")
    return found["url"]


@dataclass(frozen=True)
class ExportSettings:
    out: Path
    patches_dir: Path
    source_url: str
    home: str
    maintainers: tuple[str, ...]

    @classmethod
    def resolve(cls, out: str | os.PathLike[str], *, patches_dir: str | os.PathLike[str] | None = None,
                source_url: str | None = None, home: str | None = None,
                maintainers: tuple[str, ...] | list[str] = (),
                env: Mapping[str, str] | None = None,
                url_resolver: Callable[[], str] = pip_sdist_url,
                feedstock: bool = True) -> ExportSettings:
        """feedstock=False (a local channel build): home and maintainers may stay empty."""
        env = os.environ if env is None else env
        home = home or env.get("ROLLKV_RECIPE_HOME", "")
        maint = tuple(maintainers) or tuple(env.get("ROLLKV_RECIPE_MAINTAINERS", "").split())
        if feedstock and not home:
            raise UsageError("the recipe needs about/home: pass --home URL (the project's page) "
                             "or set ROLLKV_RECIPE_HOME")
        if feedstock and not maint:
            raise UsageError("the recipe needs maintainers: pass --maintainer GITHUB_HANDLE "
                             "(repeatable) or set ROLLKV_RECIPE_MAINTAINERS")
        return cls(out=Path(out).absolute(),
                   patches_dir=(Path(patches_dir) if patches_dir else default_patches_dir(env)).absolute(),
                   source_url=source_url or url_resolver(), home=home, maintainers=maint)


def _jinja_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid jinja string literal


def values_block(settings: ExportSettings, names: list[str], pin: UpstreamPin = PIN) -> str:
    values = {
        "upstream": pin.project, "upstream_version": pin.version, "sha256": pin.sha256,
        "llama_commit": pin.llama_commit, "llama_version": pin.llama_version,
        "series_id": series_digest(settings.patches_dir, names),
        "sdist_fn": pin.sdist_filename, "sdist_url": settings.source_url,
        "queue_path": "patches", "tool_path": "rollkv_dist", "home": settings.home,
    }
    lines = [VALUES_BEGIN, "{#- written by `rollkv recipe export` -#}"]
    lines += [f"{{% set {k} = {_jinja_str(v)} %}}" for k, v in values.items()]
    lines.append(f"{{% set series = {json.dumps(names)} %}}")
    lines.append(f"{{% set maintainers = {json.dumps(list(settings.maintainers))} %}}")
    lines.append(VALUES_END)
    return "\n".join(lines)


def export_recipe(settings: ExportSettings, recipe_dir: Path = RECIPE_DIR) -> Path:
    """Write the self-contained recipe into settings.out (which must be empty or absent)."""
    check_empty_target(settings.out)
    names = read_series(settings.patches_dir)
    check_patches_match_manifest(settings.patches_dir, names, Manifest.load(settings.patches_dir))
    meta = (recipe_dir / "meta.yaml").read_text()
    start, end = meta.find(VALUES_BEGIN), meta.find(VALUES_END)
    if start < 0 or end < start:
        raise UsageError(f"{recipe_dir / 'meta.yaml'} has no {VALUES_BEGIN} ... {VALUES_END} block")
    # written into a staging folder next to settings.out, renamed into place when complete
    with staged_directory(settings.out) as out:
        (out / "meta.yaml").write_text(meta[:start] + values_block(settings, names)
                                       + meta[end + len(VALUES_END):])
        for f in RECIPE_FILES[1:]:
            shutil.copy2(recipe_dir / f, out / f)
        queue = out / "patches"
        queue.mkdir()
        for f in [SERIES_FILE, *names] + ([MANIFEST_FILE] if names else []):
            shutil.copy2(settings.patches_dir / f, queue / f)
        tool_src = Path(__file__).resolve().parent
        for f in TOOL_FILES:
            (out / "rollkv_dist" / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tool_src / f, out / "rollkv_dist" / f)
    return settings.out


def _run(args: argparse.Namespace) -> int:
    settings = ExportSettings.resolve(args.out, patches_dir=args.patches, source_url=args.source_url,
                                      home=args.home, maintainers=args.maintainer or ())
    with log.step(f"Exporting the recipe to {settings.out}"):
        export_recipe(settings)
    log.info("lint it with `conda smithy recipe-lint --conda-forge DIR`; build it with "
             "`rollkv channel` or `conda build DIR -m <conda-forge pinning>`")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "recipe", "conda recipe tools (export)")
    sub = p.add_subparsers(dest="recipe_command", metavar="COMMAND")
    e = add_command(sub, "export", "write a self-contained, feedstock-ready recipe folder",
                    "Copy recipe/ with the values, the patch queue and the series tool filled in; nothing is "
                    "read from .. or $HOME.", _run)
    e.add_argument("out", help="new directory for the recipe")
    e.add_argument("--patches", help="patch queue (default: the repository's patches/)")
    e.add_argument("--source-url", help="URL of the pinned sdist (default: where pip finds it)")
    e.add_argument("--home", help="about/home (default: $ROLLKV_RECIPE_HOME)")
    e.add_argument("--maintainer", action="append",
                   help="recipe maintainer's GitHub handle, repeatable "
                        "(default: $ROLLKV_RECIPE_MAINTAINERS)")
    p.set_defaults(handler=lambda args: p.print_help() or 2)
