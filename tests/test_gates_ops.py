"""The op suite over window buffers (gates/opsuite.py, in the engine gate) against the fake test-backend-ops:
one run per (WHERE, SPLIT) with every op, a check per op and run, the closing `tensors placed` line, and the
planted split fault, which must fail; the parser on the suite's real console format."""

from __future__ import annotations

import pytest

from rollkv_dist.errors import LogParseError
from rollkv_dist.gates import engine, opsuite

from test_gates_engine import failed, run_engine


def ops_checks(res) -> list:
    return [c for c in res.checks if c.name.startswith("ops")]


def test_every_op_and_split_is_a_check_and_the_planted_fault_fails(tmp_path):
    ctx, res = run_engine(tmp_path)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    s = res.results["ops_suite"]
    assert s["backend"] == "CUDA0" and s["program"].endswith("test-backend-ops")
    runs = [(p, sp) for p in opsuite.PLACES for sp in opsuite.SPLITS]
    assert len(s["rows"]) == len(runs) * len(opsuite.OPS)
    assert all(r["passed"] == 3 and r["failed"] == 0 and r["not_supported"] == 1 for r in s["rows"])
    names = {c.name for c in ops_checks(res)}
    for place, split in runs:
        assert f"ops {place}:{split}: test-backend-ops exits 0" in names
        assert f"ops {place}:{split}: tensors placed across the device/host boundary" in names
        assert f"ops {place}:{split}: the case lines add up to the suite's own summary" in names
        for op in opsuite.OPS:
            assert f"ops {place}:{split}: {op} passes (3/3)" in names
    # each run names its window in the recorded command; the fault run plants the fault
    assert sum("GGML_TEST_WINDOW=" in c and "GGML_CUDA_WINDOW_TEST_FAULT" not in c for c in res.commands) == len(runs)
    fault = [c for c in res.commands if "GGML_CUDA_WINDOW_TEST_FAULT=split" in c]
    assert len(fault) == 1 and "-o CPY,CONT,DUP" in fault[0]
    assert s["fault"]["failed"] > 0 and s["fault"]["rc"] == 1
    assert "ops: the planted split fault (GGML_CUDA_WINDOW_TEST_FAULT=split) fails the suite" in names
    md = "\n".join(engine.markdown(res.results))
    assert "| src | odd | SET_ROWS | 3 | 0 | 1 |" in md and "Planted fault" in md


def test_an_op_that_fails_across_the_boundary_fails_its_checks(tmp_path, monkeypatch):
    _, res = run_engine(tmp_path, monkeypatch, env={"FAKE_OPS_FAIL": "SET_ROWS:odd"})
    assert res.verdict == "fail"
    assert failed(res) == {f"ops {p}:odd: {x}" for p in opsuite.PLACES
                           for x in ("test-backend-ops exits 0", "SET_ROWS passes (0/3)")}
    detail = next(c.detail for c in res.checks if c.name == "ops src:odd: SET_ROWS passes (0/3)")
    assert detail.startswith("SET_ROWS(type=f16,ne=[64,3,2,1]): FAIL")


def test_a_suite_that_aborts_fails_and_its_summary_is_missing(tmp_path, monkeypatch):
    _, res = run_engine(tmp_path, monkeypatch, env={"FAKE_OPS_CRASH": "ROPE"}, ops_places="dst", ops_splits="odd")
    assert failed(res) == {f"ops dst:odd: {x}" for x in (
        "test-backend-ops exits 0", "the case lines add up to the suite's own summary",
        "tensors placed across the device/host boundary", "ROPE passes (0/0)")}
    detail = next(c.detail for c in res.checks if c.name == "ops dst:odd: test-backend-ops exits 0")
    assert detail.startswith("rc=-6 ") and detail.endswith(".err")


def test_a_suite_that_places_nothing_fails(tmp_path, monkeypatch):
    _, res = run_engine(tmp_path, monkeypatch, env={"FAKE_OPS_NO_PLACE": "1"}, ops_places="src", ops_splits="half")
    assert failed(res) == {"ops src:half: tensors placed across the device/host boundary"}


def test_a_planted_fault_that_passes_fails_the_gate(tmp_path, monkeypatch):
    _, res = run_engine(tmp_path, monkeypatch, env={"FAKE_OPS_FAULT_IGNORED": "1"}, ops_places="dst",
                        ops_splits="0")
    assert failed(res) == {"ops: the planted split fault (GGML_CUDA_WINDOW_TEST_FAULT=split) fails the suite"}


def test_ops_skip_leaves_the_suite_out(tmp_path):
    _, res = run_engine(tmp_path, ops_skip=True)
    assert res.verdict == "pass" and not ops_checks(res) and "ops_suite" not in res.results
    assert any("--ops-skip" in n for n in res.notes)


REAL = """Testing 2 devices

Backend 1/2: CUDA0
  Device description: NVIDIA H200
  CPY(type_src=f16,type_dst=q8_0,ne=[256,4,4,4],permute_src=[0,0,0,0],permute_dst=[0,0,0,0]): \x1b[1;32mOK\x1b[0m
  CPY(type_src=f32,type_dst=iq4_nl,ne=[256,4,4,4]): not supported [CUDA0]
  SET_ROWS(type=q8_0,type_idx=i64,ne=[256,5,1,3],nr23=[1,1],r=1,v=0): [SET_ROWS] NMSE = 0.010000 > 0.000000 \x1b[1;31mFAIL\x1b[0m
  MUL_MAT(type_a=f16,type_b=f32,m=16,n=1,k=256): \x1b[1;32mOK\x1b[0m
[MUL_MAT] ERR = 0.000545544 > 0.000500000   MUL_MAT(type_a=q4_1,type_b=f32,m=16,n=1,k=256,bs=[1,1]): \x1b[1;31mFAIL\x1b[0m
  SET_ROWS(type_src=f32,type_dst=q4_0,type_idx=i64,ne=[256,5,1,3],nr23=[1,1],r=1,v=0): \x1b[1;32mOK\x1b[0m
  2/5 tests passed
  Backend CUDA0: \x1b[1;31mFAIL\x1b[0m
GGML_TEST_WINDOW=src:odd: 7 tensors placed across the device/host boundary (0 wholly in host memory, 0 in a plain buffer standing in for a window)
0/1 backends passed
"""


def test_the_parser_reads_the_suites_console_format():
    out = opsuite.parse(REAL)
    assert (out.ops["CPY"].passed, out.ops["CPY"].not_supported) == (1, 1)
    assert out.ops["SET_ROWS"].failed == 1 and "NMSE" in out.ops["SET_ROWS"].failures[0]
    assert out.ops["MUL_MAT"].passed == 1 and out.summary == (2, 5)
    # with -j a worker's message lands in front of a case line (seen on the H200): the case still counts, and
    # its failure keeps the message
    assert out.ops["MUL_MAT"].failed == 1 and out.ops["MUL_MAT"].failures == [
        "MUL_MAT(type_a=q4_1,type_b=f32,m=16,n=1,k=256,bs=[1,1]): [MUL_MAT] ERR = 0.000545544 > 0.000500000 FAIL"]
    assert out.ops["SET_ROWS"].passed == 1
    assert out.placed == ("src:odd", 7, 0, 0)
    with pytest.raises(LogParseError, match="GGML_TEST_WINDOW"):
        opsuite.parse("GGML_TEST_WINDOW=src:odd: some tensors placed")


def test_an_unknown_place_or_split_is_a_usage_error(tmp_path):
    from rollkv_dist.errors import UsageError

    with pytest.raises(UsageError, match="--ops-splits 'halff'"):
        run_engine(tmp_path, ops_splits="halff")
