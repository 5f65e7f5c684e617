"""nox sessions of rollkv: CPU tests (the CI default), lint, build, and the GPU gates.

    nox                      # = nox -s tests (CPU; what CI runs)
    nox -l                   # list sessions; gpu_gates shows one entry per gate x GPU x artifact
    nox -s build             # fetch, patch and build llama.cpp for this machine into .work/prefix
    nox -s gpu_gates         # every gate on every GPU NVML finds (skips with NVML's reason if none)
    nox -s "gpu_gates(needle-H200-0-conda)"   # gate x GPU x artifact
    nox -s "gpu_gates(resident-parity-all-source)"   # every GPU in one process (two or more GPUs)
    nox -s curve             # the curve gate on the first GPU, with its PNG
    nox -s channel           # conda channel of the variants this machine builds (.work/channel)
    nox -s smoke             # CPU smoke gate (a completion) per artifact

Artifacts (the gates test what users install): `source` (rollkv source + rollkv build),
`conda` (the package from the channel, installed with py-rattler into a fresh prefix), `nix`
(`nix build`, where Nix exists).

GPUs are found when this file is imported, through NVML (`pynvml` from nvidia-ml-py; install it
next to nox: `pip install nox nvidia-ml-py`), else nvidia-smi. Gate settings come from the
environment: ROLLKV_BUILD (install prefix, default .work/prefix), ROLLKV_BASELINE_BUILD (the
series before its compute-reserve patch, for boot-repro), ROLLKV_UPSTREAM_BUILD (the pin with no patch, for resident-ab),
ROLLKV_GEMMA (Gemma 3 270M GGUF), ROLLKV_LLAMA_TREE (llama.cpp tree for writing the random
models), ROLLKV_REPORTS (reports dir), ROLLKV_GATES (comma list of the gates gpu_gates runs, default
every gate; an unknown name fails gpu_gates naming the known ones), ROLLKV_ARTIFACTS (comma list of
source, conda, nix; default every artifact this machine has), e.g. on a GPU host with prebuilt
builds: `ROLLKV_BUILD=/opt/rollkv ROLLKV_GATES=engine,resident-parity ROLLKV_ARTIFACTS=source
nox -s gpu_gates`. Extra
arguments after `--` go to `rollkv gates`.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from rollkv_dist.detect import CPU, Variant, machine_variants  # noqa: E402
from rollkv_dist.errors import UsageError  # noqa: E402
from rollkv_dist.gates.runner import DEFAULT_GATES, parse_gate_list  # noqa: E402
from rollkv_dist.gates.base import BASELINE_BUILD, GEMMA, UPSTREAM_BUILD  # noqa: E402
from rollkv_dist.gates.base import registry as gate_registry  # noqa: E402
from rollkv_dist.gpu import GPUProbe, probe  # noqa: E402
from rollkv_dist.series import COMPUTE_RESERVE_ROLE, patch_with_role, read_series  # noqa: E402

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

WORK = ROOT / ".work"
DEFAULT_PREFIX = WORK / "prefix"
DEFAULT_SOURCE = WORK / "src"
CHANNEL = WORK / "channel"
# what users install: the source build, the conda package from the channel, the Nix build
ARTIFACTS = ("source", "conda", *(("nix",) if shutil.which("nix") else ()))


def _probe() -> GPUProbe:
    if os.environ.get("ROLLKV_NO_GPU_PROBE"):  # tests: the no-GPU path on any machine
        return GPUProbe(reason=os.environ["ROLLKV_NO_GPU_PROBE"])
    try:
        return probe()
    except Exception as e:  # never break `nox -l` because of a GPU probe
        return GPUProbe(reason=f"GPU probe failed: {e}")


PROBE = _probe()
GATE_REGISTRY = gate_registry()
ALL_GPUS = "all"  # the gpu parameter of the all-GPU entries


def gate_selection(env: dict[str, str] | None = None) -> tuple[tuple[str, ...], str | None]:
    """(gates, error) for gpu_gates from ROLLKV_GATES: a comma list of gate names; unset, empty or
    'all' = every gate. An unknown name (or a list of none) gives no gates and the error."""
    spec = (os.environ if env is None else env).get("ROLLKV_GATES")
    try:
        gates = tuple(parse_gate_list(spec))
    except UsageError as e:
        return (), f"ROLLKV_GATES={spec!r}: {e}"
    if not gates:
        return (), f"ROLLKV_GATES={spec!r} names no gate; known: {', '.join(DEFAULT_GATES)}"
    return gates, None


def artifact_selection(env: dict[str, str] | None = None) -> tuple[tuple[str, ...], str | None]:
    """(artifacts, error) for gpu_gates from ROLLKV_ARTIFACTS: a comma list of source, conda, nix;
    unset, empty or 'all' = every artifact this machine has (ARTIFACTS)."""
    spec = ((os.environ if env is None else env).get("ROLLKV_ARTIFACTS") or "").strip()
    if not spec or spec == "all":
        return ARTIFACTS, None
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    bad = [n for n in names if n not in ARTIFACTS]
    if bad or not names:
        return (), (f"ROLLKV_ARTIFACTS={spec!r}: unknown or unavailable artifact(s) {', '.join(bad) or '(none)'}; "
                    f"this machine has: {', '.join(ARTIFACTS)}")
    return names, None


SELECTED_GATES, GATES_ERROR = gate_selection()
SELECTED_ARTIFACTS, ARTIFACTS_ERROR = artifact_selection()


def gpu_params(probe: GPUProbe, gates: tuple[str, ...] = DEFAULT_GATES,
               artifacts: tuple[str, ...] = ARTIFACTS, error: str | None = None) -> list:
    """One nox.param per gate x GPU x artifact, id like 'resident-parity-H200-0-conda'; with two or
    more GPUs also one per gate that has an all-GPU run x artifact, id like
    'resident-parity-all-conda' (every GPU in one process, layer split); without GPUs a single
    'no-gpu' param; with a bad ROLLKV_GATES or ROLLKV_ARTIFACTS (error) a single 'bad-selection'
    param whose session fails with it."""
    if error:
        return [nox.param(None, None, None, id="bad-selection")]
    if not probe.gpus:
        return [nox.param(None, None, None, id="no-gpu")]
    per_gpu = [nox.param(gate, g.uuid, art, id=f"{gate}-{g.short_name}-{g.index}-{art}")
               for g in probe.gpus for gate in gates for art in artifacts]
    if len(probe.gpus) < 2:
        return per_gpu
    return per_gpu + [nox.param(gate, ALL_GPUS, art, id=f"{gate}-all-{art}")
                      for gate in gates if GATE_REGISTRY[gate].multi_gpu for art in artifacts]


@functools.cache
def _machine_variant() -> Variant:
    """The variant the gates build and install, detected once per run (rollkv_dist.detect, the names every
    command takes): the CUDA toolkit's variant where a GPU and nvcc exist, else cpu."""
    found = machine_variants()
    return found[-1] if PROBE.gpus else CPU


def artifact_prefix(session: nox.Session, artifact: str) -> Path:
    """The install prefix whose programs the gates run, per artifact."""
    if artifact == "source":
        prefix = Path(os.environ.get("ROLLKV_BUILD", DEFAULT_PREFIX))
        if not (prefix / "bin" / "llama-server").exists():
            if "ROLLKV_BUILD" in os.environ:
                session.error(f"ROLLKV_BUILD={prefix} has no bin/llama-server")
            _build_into(session, DEFAULT_SOURCE, prefix)
        return prefix
    if artifact == "conda":
        label = _machine_variant().name
        prefix = WORK / "artifacts" / f"conda-{label}"
        session.run("rollkv", "channel", str(CHANNEL), "--variant", label, "--install", str(prefix))
        return prefix
    if artifact == "nix":
        out = WORK / "artifacts" / "nix-result"
        attr = f".#{_machine_variant().kind}"
        session.run("nix", "build", attr, "-o", str(out), external=True)
        return out
    session.error(f"unknown artifact {artifact!r}: one of {', '.join(ARTIFACTS)}")
    raise AssertionError("unreachable")


def _build_into(session: nox.Session, source: Path, prefix: Path, without: tuple[str, ...] = (),
                extra: tuple[str, ...] = (), before: str | None = None) -> None:
    """`rollkv source` (unless done) + `rollkv build` for this machine: CUDA when a GPU and nvcc exist."""
    if not (source / "ROLLKV-PROVENANCE.json").exists():
        if source.exists():
            session.error(f"{source} exists but is not a finished `rollkv source` tree; remove it")
        session.run("rollkv", "source", str(source), *[a for w in without for a in ("--without", w)],
                    *(("--before", before) if before else ()))
    variant = _machine_variant().name
    session.log(f"building the {variant} variant into {prefix}"
                + ("" if PROBE.gpus else f" (no NVIDIA GPU found: {PROBE.reason})"))
    session.run("rollkv", "build", "--source", str(source), "--prefix", str(prefix), "--variant", variant,
                *extra)


def _gate_args(session: nox.Session, gates: str, gpu: str, artifact: str = "source") -> list[str]:
    """`rollkv gates ...` for one gate on one artifact's programs; builds what is missing (the
    series, the series before 0089 for boot-repro, the pin without any patch for resident-ab)
    and assembles Gemma for the needle gate, unless given by the environment."""
    prefix = artifact_prefix(session, artifact)
    if (artifact != "source" and not os.environ.get("ROLLKV_LLAMA_TREE")
            and not (DEFAULT_SOURCE / "ROLLKV-PROVENANCE.json").exists()):
        session.run("rollkv", "source", str(DEFAULT_SOURCE))  # gguf-py + vocab for the models
    args = ["rollkv", "gates", "--build", str(prefix), "--gates", gates, "--gpu", gpu,
            *(["--split-gpus"] if gpu == ALL_GPUS else []), "--work", str(WORK / "gates")]
    needs = {n for g in gates.split(",") for n in GATE_REGISTRY[g].needs}  # what the gates need beyond --build
    series = read_series(ROOT / "patches")
    reserve = patch_with_role(ROOT / "patches", COMPUTE_RESERVE_ROLE)  # the baseline leaves it out
    if BASELINE_BUILD in needs and not os.environ.get("ROLLKV_BASELINE_BUILD") and reserve:
        # the series as it stood before the reserve patch: the patches after it build on it
        tag = reserve.split("-", 1)[0]
        base = WORK / f"prefix-before-{tag}"
        if not (base / "bin" / "llama-server").exists():
            _build_into(session, WORK / f"src-before-{tag}", base, before=reserve)
        args += ["--baseline-build", str(base)]
    if UPSTREAM_BUILD in needs and not os.environ.get("ROLLKV_UPSTREAM_BUILD"):
        up = WORK / "prefix-upstream"
        if not (up / "bin" / "llama-bench").exists():
            _build_into(session, WORK / "src-upstream", up, without=tuple(series))
        args += ["--upstream-build", str(up)]
    if GEMMA in needs and not os.environ.get("ROLLKV_GEMMA"):
        gem = WORK / "models" / "gemma-3-270m-q4_k_m.gguf"
        if not gem.exists():
            session.run("rollkv", "model", "gemma", "-o", str(gem.parent))
        args += ["--gemma", str(gem)]
    for env, flag in (("ROLLKV_BASELINE_BUILD", "--baseline-build"), ("ROLLKV_UPSTREAM_BUILD", "--upstream-build"),
                      ("ROLLKV_GEMMA", "--gemma"), ("ROLLKV_LLAMA_TREE", "--llama-tree"),
                      ("ROLLKV_REPORTS", "--reports")):
        if os.environ.get(env):
            args += [flag, os.environ[env]]
    if "--llama-tree" not in args and (DEFAULT_SOURCE / "gguf-py").is_dir():
        args += ["--llama-tree", str(DEFAULT_SOURCE)]
    return args + list(session.posargs)


# pytest arguments of the test sessions: -rs prints every skip with its reason in the summary
# (the flake tests skip when nix-instantiate is missing; CI's .ci/run installs Nix beforehand)
PYTEST_ARGS = ("-q", "-rs")


@nox.session(tags=["ci", "cpu"])
def tests(session: nox.Session) -> None:
    """CPU test suite (no GPU needed): install the package with its dev extras, run pytest.

    This is the CI entry point (.ci/run). The integration test builds llama.cpp for the CPU once.
    Nothing outside the session's virtualenv is changed: where Nix is missing the flake tests skip
    (reason in the summary); CI provides Nix in .ci/run.
    """
    session.install("-e", ".[dev]")
    if shutil.which("ninja") is None:
        session.install("ninja")
    # two workers (pytest-xdist): the unit tests run beside the one llama.cpp build, whose tests
    # stay on one worker (xdist group, tests/conftest.py), so CI's two cores are both busy
    session.run("pytest", *(session.posargs or (*PYTEST_ARGS, "-n", "2", "--dist", "loadgroup")))


@nox.session(tags=["ci", "cpu"])
def lint(session: nox.Session) -> None:
    """ruff over the package, the tests and this file."""
    session.install("ruff")
    session.run("ruff", "check", "rollkv_dist", "tests", "noxfile.py", *session.posargs)


@nox.session(tags=["build"])
def build(session: nox.Session) -> None:
    """Fetch the pinned llama.cpp, apply the series and build it for this machine into .work/prefix.

    CUDA when NVML finds a GPU and nvcc is available (architectures from the GPUs), else CPU.
    Extra arguments go to `rollkv build`.
    """
    session.install("-e", ".")
    _build_into(session, DEFAULT_SOURCE, Path(os.environ.get("ROLLKV_BUILD", DEFAULT_PREFIX)),
                extra=tuple(session.posargs))


@nox.session(tags=["gpu"])
@nox.parametrize(["gate", "gpu", "artifact"],
                 gpu_params(PROBE, SELECTED_GATES, SELECTED_ARTIFACTS, GATES_ERROR or ARTIFACTS_ERROR))
def gpu_gates(session: nox.Session, gate: str | None, gpu: str | None, artifact: str | None) -> None:
    """One GPU gate on one GPU (or, for the `<gate>-all-<artifact>` entries of a machine with two or
    more GPUs, on every GPU in one process, layer split) against one artifact's programs; skipped
    when NVML finds no GPU.

    The gates are ROLLKV_GATES' and the artifacts ROLLKV_ARTIFACTS' (default: all of each).
    Artifacts: source (rollkv source + build), conda (the package from .work/channel installed
    into a fresh prefix), nix (nix build, where Nix exists). Builds the series (and what the gate
    needs: for boot-repro the series before its compute-reserve patch, for resident-ab the pin)
    when no build is given, and assembles Gemma 3 270M for the needle gate. Reports go to
    reports/<date>-<gpu>/ (or ROLLKV_REPORTS); the session fails when the gate fails.
    """
    if GATES_ERROR or ARTIFACTS_ERROR:
        session.error(GATES_ERROR or ARTIFACTS_ERROR)
    if gate is None or gpu is None or artifact is None:
        session.skip(f"no NVIDIA GPU found: {PROBE.reason}")
    # the conda artifact packs and installs with the channel tools; the others need only the gates'
    session.install("-e", ".[channel]" if artifact == "conda" else ".")
    session.run(*_gate_args(session, gate, gpu, artifact), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})


@nox.session(tags=["cpu", "packaging"])
@nox.parametrize("artifact", [nox.param(a, id=a) for a in ARTIFACTS])
def smoke(session: nox.Session, artifact: str) -> None:
    """CPU smoke gate: a completion from a tiny random model through the artifact's llama-server.

    Runs without a GPU (CI runs the same gate on the CPU conda package in tests/test_recipe_build.py).
    """
    session.install("-e", ".[channel]")
    prefix = artifact_prefix(session, artifact)
    if not (DEFAULT_SOURCE / "ROLLKV-PROVENANCE.json").exists():
        session.run("rollkv", "source", str(DEFAULT_SOURCE))  # gguf-py + vocab for the model
    session.run("rollkv", "smoke", "--build", str(prefix), "--llama-tree", str(DEFAULT_SOURCE),
                "--work", str(WORK / "smoke" / artifact))


@nox.session(tags=["packaging"])
def channel(session: nox.Session) -> None:
    """Conda channel in .work/channel of the variants this machine can build (CPU; CUDA where nvcc
    exists): conda-build where installed, else the offline packer. Arguments go to `rollkv channel`."""
    session.install("-e", ".[channel]")
    session.run("rollkv", "channel", str(CHANNEL), *session.posargs)


@nox.session(tags=["gpu"])
def curve(session: nox.Session) -> None:
    """The curve gate on the first GPU: decode/prefill t/s against host-tail MiB, PNG included."""
    if not PROBE.gpus:
        session.skip(f"no NVIDIA GPU found: {PROBE.reason}")
    session.install("-e", ".")
    session.run(*_gate_args(session, "curve", PROBE.gpus[0].uuid), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})


# --- packaging (recipe/, flake.nix) -------------------------------------------------------------


@nox.session(tags=["packaging", "cpu"])
def recipe(session: nox.Session) -> None:
    """conda recipe: renders per variant, agrees with pin + series, exports; build.sh -> channel -> py-rattler.

    Includes the one shared CPU build of the pinned tree (tests/conftest.py, about 8-12 min on 2
    cores); `nox -s recipe -- -m "not integration"` leaves it out.
    """
    session.install("-e", ".[dev]")
    if shutil.which("ninja") is None:
        session.install("ninja")
    session.run("pytest", "tests/test_recipe_render.py", "tests/test_recipe_build.py",
                "tests/test_packaging_env.py", *(session.posargs or PYTEST_ARGS))


@nox.session(tags=["packaging", "cpu"])
def flake(session: nox.Session) -> None:
    """flake.nix / package.nix: outputs evaluate (Nix 2.8, offline, stand-in nixpkgs) per pin + series;
    the three consumers of the build definition agree; the nix run launcher.

    Needs nix-instantiate on PATH (Debian: nix-bin); without it the evaluating tests skip, saying so.
    """
    session.install("-e", ".[dev]")
    session.run("pytest", "tests/test_flake_eval.py", "tests/test_build_definition.py",
                "tests/test_nix_launcher.py", *(session.posargs or PYTEST_ARGS))
