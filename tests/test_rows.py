"""The result rows of the speed, curve and resident-ab gates (gates/rows.py): one definition that the gates
write and every reader parses, checked against every such report under reports/."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollkv_dist.errors import ReportFormatError
from rollkv_dist.gates import logparse, rows
from rollkv_dist.perfdoc import FIRST_FORMAT_DATE, load_reports

ROOT = Path(__file__).resolve().parents[1]


def within(sub, whole, where: str) -> None:
    """Every key and value of `sub` (a report's JSON) is in `whole` (its rows written again)."""
    if isinstance(sub, dict):
        assert isinstance(whole, dict), where
        for k, v in sub.items():
            if k in rows.Staged.DERIVED:  # what older curve plots wrote into the points, computed again on reading
                continue
            assert k in whole, f"{where}/{k} lost"
            within(v, whole[k], f"{where}/{k}")
    elif isinstance(sub, list):
        assert isinstance(whole, list) and len(sub) == len(whole), where
        for i, (a, b) in enumerate(zip(sub, whole)):
            within(a, b, f"{where}[{i}]")
    else:
        assert sub == whole, f"{where}: {sub!r} != {whole!r}"


def parsed_parts(gate: str, results: dict) -> list[tuple[str, object, type[rows.Row]]]:
    """(where, JSON, row type) of each row of a report's results."""
    if gate == "resident-ab":
        return [(f"rows[{i}]", x, rows.AbRow) for i, x in enumerate(results.get("rows") or [])]
    if gate == "curve":
        return [*((f"points[{i}]", x, rows.CurvePoint) for i, x in enumerate(results["points"])),
                ("resident", results.get("resident"), rows.CurveResident),
                ("link_probe", results.get("link_probe"), rows.CurveLinkProbe)]
    return [*((f"rows[{i}]", x, rows.SpeedRow) for i, x in enumerate(results.get("rows") or [])),
            ("ubatch_sweep", results.get("ubatch_sweep"), rows.UbatchSweep),
            ("split", results.get("split"), rows.SplitRun)]


def test_every_report_of_the_current_format_reads_back_through_its_rows():
    reports = [r for r in load_reports(ROOT) if r.day >= FIRST_FORMAT_DATE]
    assert {r.gate for r in reports} == {"speed", "curve", "resident-ab"} and len(reports) >= 20
    for r in reports:
        for where, data, kind in parsed_parts(r.gate, r.results):
            if data is None:
                continue
            row = kind.from_json(data)
            # nothing the report says is dropped or changed by reading it into the row and writing it again
            within(data, row.to_json(), f"{r.path}:{where}")
            assert kind.from_json(row.to_json()) == row


def test_a_row_refuses_what_it_does_not_know_and_names_it():
    with pytest.raises(ReportFormatError, match="SpeedRow: required field 'kv_type' missing"):
        rows.SpeedRow.from_json({"depth": 16384})
    with pytest.raises(ReportFormatError, match=r"SpeedRatios: unknown field\(s\) decode_ratio"):
        rows.SpeedRow.from_json({"depth": 1, "kv_type": "f16", "ratios": {"decode_ratio": 1.0}})
    with pytest.raises(ReportFormatError, match="Window: unknown field"):
        rows.Staged.from_json({"window": {"kv_size": 1, "cells": 2}})
    with pytest.raises(ReportFormatError, match="AbRow: expected an object, got list"):
        rows.AbRow.from_json([])
    # a field a report written before it lacks reads as None; a derived key of older curve plots is read past
    old = rows.CurvePoint.from_json({"vram_target": 3000, "prefill_tail_fraction": 0.5, "prefill_tail_pct": 50.0})
    assert old.prefill_tail_fraction == 0.5 and old.decode_tps is None and "prefill_tail_pct" not in old.to_json()


def test_the_staging_pair_is_auto_and_off_in_the_json():
    w = logparse.Window(fully_resident=False, kv_size=16640, cells_resident=8192, device_mib=2.0, host_tail_mib=4.0)
    row = rows.SpeedRow(depth=16384, kv_type="f16", window=rows.SpeedWindow(
        vram_target=5000, stagings=["auto", "off"], after=rows.Staged(decode_tps=140.0, window=w),
        before=rows.Staged(decode_tps=200.0)))
    j = rows.jsonable({"rows": [row]})["rows"][0]
    assert j["window"]["auto"]["decode_tps"] == 140.0 and j["window"]["off"]["decode_tps"] == 200.0
    assert j["window"]["auto"]["window"]["cells_resident"] == 8192 and "after" not in j["window"]
    back = rows.SpeedRow.from_json(j)
    assert back == row and back.after.window == w and back.before.decode_tps == 200.0
