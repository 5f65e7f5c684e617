"""`rollkv docs`: docs/performance.md and the README's headline are what the gate reports under reports/ say."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from rollkv_dist import cli, perfdoc
from rollkv_dist.errors import ReportFormatError, RollkvError

ROOT = Path(__file__).resolve().parents[1]
SPEED = ROOT / "reports/2026-12-01-h200-g/08-speed-16k-final/speed-gpu0.json"


def test_the_committed_docs_agree_with_the_reports():
    """The documented numbers are the measured ones: regenerate from reports/ and compare byte for byte."""
    for rel, text in perfdoc.expected(ROOT).items():
        assert (ROOT / rel).read_text() == text, f"{rel} disagrees with reports/: run `rollkv docs` and commit"


def _checkout(tmp_path: Path, report: dict) -> Path:
    root = tmp_path / "co"
    (root / "reports" / "2026-12-09-h200" / "speed").mkdir(parents=True)
    (root / "reports" / "2026-12-09-h200" / "speed" / "speed-gpu0.json").write_text(json.dumps(report))
    (root / "reports" / "2026-12-09-h200" / "raw.json").write_text("llama-bench printed this, not JSON\n")
    (root / "README.md").write_text(f"# x\n\n{perfdoc.HEADLINE[0]}\nold\n{perfdoc.HEADLINE[1]}\n\nend\n")
    return root


def test_a_changed_report_makes_the_check_fail_until_the_docs_are_written(tmp_path, capsys):
    report = json.loads(SPEED.read_text())
    report["date"] = "2026-12-09T10:00:00Z"
    root = _checkout(tmp_path, report)
    assert cli.main(["docs", "--root", str(root)]) == 0
    doc, readme = (root / "docs/performance.md").read_text(), (root / "README.md").read_text()
    # the report's own numbers, its path, GPU, driver and series size are in the page; the headline has its ratios
    assert "`reports/2026-12-09-h200/speed/speed-gpu0.json`" in doc
    assert "| 16384 | f16 | 51 % | 18 123 / 16 643 / 1 496 / 4 033 | 92 % | 406.2 / 180.5 / 138.8 / 11.4 | 86 % |" in doc
    assert "NVIDIA H200, driver 580.159.04, 25 patches" in doc
    assert "| 16384 | q8_0 | 54 % | 92 % | 3.11x | 13.88x |" in readme and readme.endswith("\n\nend\n")
    assert "old" not in readme
    assert cli.main(["docs", "--root", str(root), "--check"]) == 0

    changed = copy.deepcopy(report)
    changed["results"]["rows"][0]["window"]["auto"]["prefill_tps"] = 9000.0
    (root / "reports/2026-12-09-h200/speed/speed-gpu0.json").write_text(json.dumps(changed))
    capsys.readouterr()
    assert cli.main(["docs", "--root", str(root), "--check"]) == perfdoc.DocsStale.exit_code
    assert "docs/performance.md disagree with reports/" in capsys.readouterr().err
    assert "16 643" in (root / "docs/performance.md").read_text()  # --check changes nothing
    assert cli.main(["docs", "--root", str(root)]) == 0
    assert "18 123 / 9 000 / 1 496" in (root / "docs/performance.md").read_text()
    assert cli.main(["docs", "--root", str(root), "--check"]) == 0


def test_a_report_in_an_unknown_format_is_an_error_naming_it(tmp_path):
    report = json.loads(SPEED.read_text())
    report["date"] = "2026-12-09T10:00:00Z"
    for row in report["results"]["rows"]:
        del row["kv_type"]
    root = _checkout(tmp_path, report)
    with pytest.raises(RollkvError, match="2026-12-09-h200/speed/speed-gpu0.json: a speed report without"):
        perfdoc.expected(root)


def test_a_row_field_this_rollkv_does_not_know_stops_the_docs_naming_report_and_field(tmp_path, capsys):
    report = json.loads(SPEED.read_text())
    report["date"] = "2026-12-09T10:00:00Z"
    report["results"]["rows"][1]["window"]["auto"]["decode_tps_mean"] = 1.0  # a writer's field no reader knows
    root = _checkout(tmp_path, report)
    assert cli.main(["docs", "--root", str(root)]) == ReportFormatError.exit_code == 11
    err = capsys.readouterr().err
    assert "2026-12-09-h200/speed/speed-gpu0.json" in err and "Staged: unknown field(s) decode_tps_mean" in err
    assert not (root / "docs/performance.md").exists()


def test_a_readme_without_the_headline_block_is_an_error(tmp_path):
    root = _checkout(tmp_path, json.loads(SPEED.read_text()))
    (root / "README.md").write_text("# x\n")
    with pytest.raises(RollkvError, match="no headline block"):
        perfdoc.expected(root)


def test_the_newest_passing_report_per_depth_makes_the_headline(tmp_path):
    old = json.loads(SPEED.read_text())
    new = copy.deepcopy(old)
    new["date"] = "2026-12-10T10:00:00Z"
    new["results"]["rows"][0]["ratios"]["prefill_after_over_resident"] = 0.5
    failed = copy.deepcopy(new)
    failed["date"], failed["verdict"] = "2026-12-11T10:00:00Z", "fail"
    failed["results"]["rows"][0]["ratios"]["prefill_after_over_resident"] = 0.1
    root = _checkout(tmp_path, old)
    for name, rep in (("new", new), ("failed", failed)):
        (root / "reports" / name).mkdir()
        (root / "reports" / name / "speed-gpu0.json").write_text(json.dumps(rep))
    block = perfdoc.headline(perfdoc.load_reports(root))
    rows = [line for line in block if line.startswith("| 16384 | f16")]
    assert rows == [rows[0]] and "| 50 % |" in rows[0] and "2026-12-10" in rows[0], block
    shutil.rmtree(root)


def test_a_lab_build_is_named_as_one_and_never_makes_the_headline(tmp_path):
    """A comparison build with the lab overlay (its build info lists the overlay's patches) is shown as such in the
    page, and the README's numbers stay the product's even when the lab report is newer and passes."""
    product = json.loads(SPEED.read_text())
    lab = copy.deepcopy(product)
    lab["date"] = "2026-12-10T10:00:00Z"
    lab.setdefault("build", {}).setdefault("info", {})["lab"] = ["0001-ggml-cuda-prefetch-copy-settings.patch"]
    lab["results"]["rows"][0]["ratios"]["prefill_after_over_resident"] = 0.5
    root = _checkout(tmp_path, product)
    (root / "reports" / "lab").mkdir()
    (root / "reports" / "lab" / "speed-gpu0.json").write_text(json.dumps(lab))
    reports = perfdoc.load_reports(root)
    rows = [line for line in perfdoc.headline(reports) if line.startswith("| 16384 | f16")]
    assert len(rows) == 1 and "| 92 % |" in rows[0] and "2026-12-10" not in rows[0], rows
    doc = perfdoc.render_doc(reports)
    assert "25 patches + the lab overlay (0001-ggml-cuda-prefetch-copy-settings.patch: a comparison build)" in doc
    assert doc.count("a comparison build") == 1
