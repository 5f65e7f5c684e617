"""Gate reports: one JSON per gate run (versioned schema) plus a short Markdown summary.

Layout under the reports dir (default `reports/<date>-<gpu>/`):
  <gate>-gpu<index>.json, <gate>-gpu<index>.md (an all-GPU run: <gate>-gpus0+1.*), [curve PNG],
  SUMMARY.md, run.json
Below its checks, a gate's Markdown shows its own rows (Gate.report_rows). An all-GPU run's JSON has
`gpus` (every GPU; `gpu` is the first), null otherwise.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollkv_dist import __version__
from rollkv_dist.util import atomic_write_text, git_head
from rollkv_dist.gates.context import GateResult
from rollkv_dist.gates.rows import jsonable

SCHEMA_VERSION = 1
REQUIRED_KEYS = ("schema_version", "gate", "rollkv", "series", "gpu", "driver", "date", "commands",
                 "results", "checks", "verdict")


# the variables that change what the engine does (GGML_CUDA_PREFETCH_COPY, GGML_CUDA_DISABLE_GRAPHS,
# LLAMA_ARG_KV_RESIDENCY_MODE, LLAMA_KV_HOST_CHECK, ...): a report's numbers hold for the values recorded
ENGINE_ENV_PREFIXES = ("GGML_", "LLAMA_")
# a name with one of these parts is recorded as set, without its value (LLAMA_API_KEY, say)
SECRET_PARTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def engine_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine variables the gates' children run with (`env`, else this process's environment),
    sorted by name; a secret's value is left out."""
    env = os.environ if env is None else env
    return {k: "(set, value not recorded)" if any(p in k.upper() for p in SECRET_PARTS) else v
            for k, v in sorted(env.items()) if k.startswith(ENGINE_ENV_PREFIXES)}


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rollkv_commit(repo: Path | None = None, build_info: dict[str, Any] | None = None) -> str | None:
    """The rollkv commit: git HEAD of this checkout, else the one `rollkv source`/`pack` recorded in
    the build's provenance (a copy of the tree on a GPU host often has no .git)."""
    head = git_head(repo or Path(__file__).resolve().parents[2])
    if head:
        return head
    prov = (build_info or {}).get("provenance") or {}
    for k in ("rollkv_commit", "commit", "git_commit"):
        if prov.get(k):
            return str(prov[k])
    return None


def gate_report(res: GateResult, *, build: Path, baseline: Path | None, probe: Any,
                build_info: dict[str, Any] | None, baseline_info: dict[str, Any] | None,
                environment: dict[str, str] | None = None) -> dict[str, Any]:
    """The report of one gate run; `environment`: engine_environment() of its children (None: not recorded)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "gate": res.gate,
        "rollkv": {"version": __version__, "commit": rollkv_commit(build_info=build_info),
                   # the commit the build's source tree was made from (`rollkv source`/`pack`): a copy of
                   # the checkout on a GPU host may carry a stale .git, so both are recorded
                   "source_commit": (((build_info or {}).get("provenance") or {}).get("rollkv_commit")
                                     or ((build_info or {}).get("record") or {}).get("rollkv_commit"))},
        "series": None if build_info is None else build_info.get("series"),
        "baseline_series": None if baseline_info is None else baseline_info.get("series"),
        "build": {"prefix": str(build), "info": build_info},
        "baseline_build": None if baseline is None else {"prefix": str(baseline), "info": baseline_info},
        "gpu": res.gpu,
        "gpus": res.gpus,
        "driver": {"version": getattr(probe, "driver_version", None),
                   "cuda": getattr(probe, "cuda_driver_version", None)},
        "date": utc_now(),
        "seconds": round(res.seconds, 1),
        "commands": res.commands,
        "environment": environment,
        "results": jsonable(res.results),  # the rows' JSON (rows.py): the report is data only
        "checks": [c.__dict__ for c in res.checks],
        "notes": res.notes,
        "logs": res.logs,
        "plots": res.plots,
        "verdict": res.verdict,
    }


def markdown(rep: dict[str, Any]) -> str:
    gpus = rep.get("gpus") or [rep.get("gpu") or {}]
    lines = [f"# {rep['gate']}: {rep['verdict'].upper()}", "",
             f"- GPU{'s (one process, layer split)' if len(gpus) > 1 else ''}: "
             + ", ".join(f"{g.get('name', '?')} `{g.get('uuid', '?')}`" for g in gpus)
             + f", driver {rep['driver']['version']}, CUDA {rep['driver']['cuda']}",
             f"- rollkv {rep['rollkv']['version']} commit `{rep['rollkv']['commit']}` (source tree made at "
             f"`{rep['rollkv'].get('source_commit')}`); "
             f"series: {', '.join(rep['series'] or []) or '?'}",
             f"- date {rep['date']}, {rep['seconds']} s"]
    env = rep.get("environment")
    if env is not None:
        lines.append(f"- engine environment ({', '.join(p + '*' for p in ENGINE_ENV_PREFIXES)}): "
                     + (", ".join(f"`{k}={v}`" for k, v in env.items()) or "none set (the engine's defaults)"))
    lines.append("")
    lines += ["| check | result | detail |", "|---|---|---|"]
    for c in rep["checks"]:
        detail = str(c["detail"]).replace("|", "\\|")[:300]
        lines.append(f"| {c['name']} | {'ok' if c['ok'] else 'FAIL'} | {detail} |")
    rows = report_rows(rep["gate"], rep["results"])
    if rows:
        lines += ["", *rows]
    for p in rep.get("plots") or []:
        lines += ["", f"![{rep['gate']}]({Path(p).name})"]
    if rep.get("notes"):
        lines += ["", *[f"- note: {n}" for n in rep["notes"]]]
    lines += ["", "Commands:", "", *[f"    {c}" for c in rep["commands"]]]
    return "\n".join(lines) + "\n"


def report_rows(gate: str, results: dict[str, Any]) -> list[str]:
    """The gate's own Markdown below its checks (Gate.report_rows); none for a gate that is not
    registered (a report of an older rollkv)."""
    from rollkv_dist.gates.base import registry

    g = registry().get(gate)
    return [] if g is None else g.report_rows(results)


def write_gate(rep: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in rep.get("plots") or []:
        src = Path(p)
        if src.is_file() and src.parent != out_dir:
            shutil.copy2(src, out_dir / src.name)
    js = out_dir / f"{stem}.json"
    md = out_dir / f"{stem}.md"
    atomic_write_text(js, json.dumps(rep, indent=2, default=str) + "\n")
    atomic_write_text(md, markdown(rep))
    return js, md


def write_summary(reps: list[dict[str, Any]], out_dir: Path) -> Path:
    lines = ["# rollkv GPU gates", "", "| gate | GPU | verdict | seconds |", "|---|---|---|---|"]
    for r in reps:
        gpus = r.get("gpus") or [r.get("gpu") or {}]
        where = " + ".join(f"{g.get('name', '?')} {g.get('uuid', '')}".strip() for g in gpus)
        lines.append(f"| {r['gate']} | {where} | {r['verdict']} | {r['seconds']} |")
    atomic_write_text(out_dir / "SUMMARY.md", "\n".join(lines) + "\n")
    run = {"schema_version": SCHEMA_VERSION, "date": utc_now(),
           "gates": [{"gate": r["gate"], "gpu": (r.get("gpu") or {}).get("uuid"),
                      "gpus": None if not r.get("gpus") else [g.get("uuid") for g in r["gpus"]],
                      "verdict": r["verdict"]} for r in reps],
           "verdict": "pass" if reps and all(r["verdict"] in ("pass", "skip") for r in reps)
           and any(r["verdict"] == "pass" for r in reps) else "fail"}
    atomic_write_text(out_dir / "run.json", json.dumps(run, indent=2) + "\n")
    return out_dir / "SUMMARY.md"
