"""`rollkv docs`: docs/performance.md and the README's headline numbers, written from the gate reports.

Every number about speed that the documentation shows comes from a speed, curve or resident-ab gate
report under reports/ (the versioned JSON the gates write), so documented numbers cannot drift from
measured ones: `rollkv docs --check` (and tests/test_perfdoc.py) fails when the files disagree with
what the reports say. Reports are found by walking reports/; a report of one of these gates in a
format this renderer does not know is an error naming the file, not a silent omission.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollkv_dist import log
from rollkv_dist.commands import add_command
from rollkv_dist.errors import ReportFormatError, RollkvError, UsageError
from rollkv_dist.gates.rows import AbRow, CurvePoint, CurveResident, Rates, SpeedRatios, SpeedRow, Staged
from rollkv_dist.util import atomic_write_text, repo_root

GATES = ("speed", "curve", "resident-ab")
DOC = Path("docs/performance.md")
README = Path("README.md")
HEADLINE = ("<!-- headline: written by `rollkv docs` from reports/ (docs/performance.md) -->",
            "<!-- /headline -->")
# rows of the speed gate before this format (2026-11-29: no KV type per row) are listed, not tabled
FIRST_FORMAT_DATE = "2026-12-01"


class DocsStale(RollkvError):
    """The documentation disagrees with the reports (`rollkv docs` rewrites it)."""

    exit_code = 9


@dataclass(frozen=True)
class Report:
    path: str          # relative to the repository, e.g. reports/2026-12-01-h200-g/08-speed-16k-final/speed-gpu0.json
    gate: str
    date: str          # ISO, UTC
    verdict: str
    gpu: str
    driver: str
    patches: int | None
    commit: str
    results: dict[str, Any]
    commands: tuple[str, ...]
    lab: tuple[str, ...] = ()  # the lab overlay's patches of a comparison build (never in the headline)

    @property
    def day(self) -> str:
        return self.date[:10]


def load_reports(root: Path) -> list[Report]:
    """Every speed, curve and resident-ab gate report under ROOT/reports, newest first."""
    out = []
    for p in sorted((root / "reports").rglob("*.json")):
        if p.name == "run.json":
            continue
        try:
            d = json.loads(p.read_text())
        except ValueError:  # raw captures (a program's output saved as .json) are no gate report
            continue
        if not isinstance(d, dict) or d.get("gate") not in GATES or "schema_version" not in d:
            continue
        gpu = d.get("gpu") or {}
        series = d.get("series")
        out.append(Report(
            path=p.relative_to(root).as_posix(), gate=d["gate"], date=str(d.get("date") or "?"),
            verdict=str(d.get("verdict") or "?"), gpu=str(gpu.get("name") or "?"),
            driver=str((d.get("driver") or {}).get("version") or "?"),
            patches=len(series) if isinstance(series, list) and series else None,
            commit=str(((d.get("rollkv") or {}).get("commit")) or "?")[:12],
            results=d.get("results") or {}, commands=tuple(d.get("commands") or ()),
            lab=tuple(_get(d, "build", "info", "lab") or ())))
    out.sort(key=lambda r: (r.date, r.path), reverse=True)
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}".replace(",", " ") if x < 1000 else f"{x:,.0f}".replace(",", " ")


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _get(d: dict | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _heading(r: Report) -> list[str]:
    series = "?" if r.patches is None else str(r.patches)
    lab = f" + the lab overlay ({', '.join(r.lab)}: a comparison build)" if r.lab else ""
    return [f"### {r.day}: `{r.path}`", "",
            f"{r.gpu}, driver {r.driver}, {series} patches{lab}, rollkv `{r.commit}`, verdict **{r.verdict}**.", ""]


def _command(r: Report, needle: str) -> list[str]:
    cmd = next((c for c in r.commands if needle in c), r.commands[0] if r.commands else None)
    if cmd is None:
        return []
    return [f"Its first window command (the report lists all {len(r.commands)}):", "", "    " + cmd, ""]


def _parse(r: Report, parse: Any, value: Any) -> Any:
    """A report's rows through their one definition (gates/rows.py); a row this rollkv cannot read names the file."""
    try:
        return parse(value)
    except ReportFormatError as e:
        raise ReportFormatError(f"{r.path}: {e}") from None


def _speed_rows(r: Report) -> list[SpeedRow]:
    rows = r.results.get("rows")
    if not isinstance(rows, list) or any(not isinstance(x, dict) or "kv_type" not in x
                                         or not isinstance(x.get("window"), dict) for x in rows):
        raise ReportFormatError(f"{r.path}: a speed report without per-row KV types and stagings; "
                                f"rollkv docs reads reports from {FIRST_FORMAT_DATE} on")
    return _parse(r, lambda v: [SpeedRow.from_json(x) for x in v], rows)


def render_speed(r: Report) -> list[str]:
    lines = _heading(r) + [
        "| depth | KV | tail | prefill t/s: resident / window / before / `-nkvo` | prefill vs resident "
        "| decode t/s: resident / window / before / `-nkvo` | decode vs overlap bound |",
        "|---|---|---|---|---|---|---|"]
    for x in _speed_rows(r):
        after, before = x.after or Staged(), x.before or Staged()
        res, nkvo, ratios = x.resident or Rates(), x.nkvo or Rates(), x.ratios or SpeedRatios()
        prefill = " / ".join(_tps(v) for v in (res.prefill_tps, after.prefill_tps, before.prefill_tps,
                                               nkvo.prefill_tps))
        decode = " / ".join(_tps(v) for v in (res.decode_tps, after.decode_tps, before.decode_tps, nkvo.decode_tps))
        lines.append(f"| {x.depth} | {x.kv_type} | {_pct(after.tail_fraction)} | {prefill} | "
                     f"{_pct(ratios.prefill_after_over_resident)} | {decode} | "
                     f"{_pct(ratios.decode_after_over_overlap_bound)} |")
    return lines + [""] + _command(r, "-krm window")


def render_curve(r: Report) -> list[str]:
    res = r.results
    points = res.get("points")
    if not isinstance(points, list):
        raise ReportFormatError(f"{r.path}: a curve report without points")
    model = str(res.get("model") or "?").rsplit("/", 1)[-1]
    ctx = res.get("n_ctx") or "the depth"
    link = _get(res, "link", "gbps")
    resident = _parse(r, CurveResident.maybe, res.get("resident")) or CurveResident()
    lines = _heading(r) + [
        f"`{model}`, depth {res.get('depth')}, context {ctx}, ubatch {res.get('n_ubatch') or 'default'}; "
        f"resident prefill {_tps(resident.prefill_tps)} t/s, decode "
        f"{_tps(resident.decode_tps)} t/s; link {'-' if link is None else f'{link} GB/s'}.", "",
        "| --vram-target MiB | tail (prefill) | prefill t/s | vs resident | before (`-kts off`) | decode t/s "
        "| vs zero-copy limit |",
        "|---|---|---|---|---|---|---|"]
    for p in _parse(r, lambda v: [CurvePoint.from_json(x) for x in v], points):
        if p.rc not in (0, None):
            lines.append(f"| {p.vram_target} | failed (rc {p.rc}) | - | - | - | - | - |")
            continue
        lines.append(f"| {p.vram_target} | {_pct(p.prefill_tail_fraction)} | "
                     f"{_tps(p.prefill_tps)} | {_pct(p.prefill_over_resident)} | "
                     f"{_tps(p.before and p.before.prefill_tps)} | {_tps(p.decode_tps)} | "
                     f"{_ratio(p.decode_over_limit)} |")
    return lines + [""] + _command(r, "-krm window")


def render_resident_ab(r: Report) -> list[str]:
    rows = r.results.get("rows")
    if not isinstance(rows, list):
        raise ReportFormatError(f"{r.path}: a resident-ab report without rows")
    lines = _heading(r) + [
        f"{r.results.get('rounds')} rounds; tolerance {r.results.get('tolerance_pct')} % beyond the noise band.", "",
        "| test | depth | series t/s | upstream t/s | difference | within noise |", "|---|---|---|---|---|---|"]
    for x in _parse(r, lambda v: [AbRow.from_json(x) for x in v], rows):
        lines.append(f"| {x.test} | {x.depth} | {_tps(x.series.mean)} | {_tps(x.upstream.mean)} | "
                     f"{x.diff_pct:+.1f} % | {'yes' if x.within_noise else 'no'} |")
    return lines + [""]


RENDER = {"speed": render_speed, "curve": render_curve, "resident-ab": render_resident_ab}
TITLES = {
    "speed": ("Speed gate: prefill and decode at depth with a host tail",
              "llama-bench at a fixed depth: resident, the window with the packaged staging (auto), the window "
              "with staging off (`before`: zero-copy reads of the tail) and `-nkvo`. t/s are medians of the "
              "repetitions. The overlap bound is what decode could reach if the tail's link time and the "
              "resident compute overlapped fully."),
    "curve": ("Curve gate: throughput against the host tail",
              "One context, `--vram-target` swept down; each point's tail is the share of the prompt's cells "
              "in host memory. The zero-copy limit is resident decode time plus the tail's bytes over the "
              "measured link."),
    "resident-ab": ("Resident against upstream",
                    "The packaged default where the KV fits against the unpatched pin, same GPU, alternating "
                    "rounds."),
}


def headline(reports: list[Report]) -> list[str]:
    """The README's numbers: the newest passing speed report of the product (no lab overlay) per depth, its rows."""
    lines = [HEADLINE[0], "| depth | KV | cells in the host tail | prefill vs resident | prefill vs `-nkvo` "
             "| decode vs `-nkvo` | report |", "|---|---|---|---|---|---|---|"]
    seen: set[int] = set()
    for r in reports:
        if r.gate != "speed" or r.verdict != "pass" or r.day < FIRST_FORMAT_DATE or r.lab:
            continue
        rows = _speed_rows(r)
        for x in (x for x in rows if x.depth not in seen):
            ratios = x.ratios or SpeedRatios()
            lines.append(f"| {x.depth} | {x.kv_type} | {_pct((x.after or Staged()).tail_fraction)} | "
                         f"{_pct(ratios.prefill_after_over_resident)} | "
                         f"{_ratio(ratios.prefill_after_over_nkvo)} | "
                         f"{_ratio(ratios.decode_after_over_nkvo)} | "
                         f"[{r.day}, {r.gpu}](docs/performance.md) |")
        seen |= {x.depth for x in rows}
    return lines + [HEADLINE[1]]


def render_doc(reports: list[Report]) -> str:
    lines = ["# Performance", "",
             "<!-- written by `rollkv docs` from the gate reports under reports/; "
             "tests/test_perfdoc.py fails when it disagrees with them -->", "",
             "Every table below is one gate report (`rollkv gates`, JSON under `reports/`), newest first, with the "
             "GPU, driver, the number of patches of the series it measured and the rollkv commit. Models are "
             "random-weight GGUFs of the named shape written by `rollkv model random`; `docs/gates.md` says what "
             "each gate runs.", ""]
    for gate in GATES:
        title, text = TITLES[gate]
        mine = [r for r in reports if r.gate == gate]
        current = [r for r in mine if r.day >= FIRST_FORMAT_DATE or gate != "speed"]
        older = [r for r in mine if r not in current]
        lines += [f"## {title}", "", text, ""]
        for r in current:
            lines += RENDER[gate](r)
        if older:
            lines += ["Older reports in a format before per-row KV types (their own Markdown beside them): "
                      + ", ".join(f"`{r.path}`" for r in older) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def splice_headline(readme: str, block: list[str]) -> str:
    start, end = readme.find(HEADLINE[0]), readme.find(HEADLINE[1])
    if not 0 <= start < end:
        raise RollkvError(f"{README}: no headline block ({HEADLINE[0]} ... {HEADLINE[1]})")
    return readme[:start] + "\n".join(block) + readme[end + len(HEADLINE[1]):]


def expected(root: Path) -> dict[Path, str]:
    """What docs/performance.md and README.md must hold, from ROOT's reports."""
    reports = load_reports(root)
    return {DOC: render_doc(reports), README: splice_headline((root / README).read_text(), headline(reports))}


def run(args: argparse.Namespace) -> int:
    root = Path(args.root) if args.root else repo_root()
    if root is None or not (root / "reports").is_dir():
        raise UsageError("no checkout with reports/ here: give --root DIR")
    stale = []
    for rel, text in expected(root).items():
        target = root / rel
        if target.is_file() and target.read_text() == text:
            continue
        stale.append(rel)
        if not args.check:
            atomic_write_text(target, text)
            log.info(f"wrote {rel}")
    if args.check and stale:
        raise DocsStale(f"{', '.join(map(str, stale))} disagree with reports/: run `rollkv docs` and commit")
    if not stale:
        log.info("docs/performance.md and the README's headline agree with reports/")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "docs", "write docs/performance.md and the README's numbers from reports/",
                    __doc__ or "", run)
    p.add_argument("--check", action="store_true", help="change nothing; exit 9 when the files disagree")
    p.add_argument("--root", help="checkout to read and write (default: this package's checkout)")
