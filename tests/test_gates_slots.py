"""The slots gate (four unified llama-server slots on a realistic hybrid, window vs resident) against
the fake programs: the fake test-llama-archs writes the model with the sizes it was given, the fake
llama-server answers array requests with tokens and log-probabilities that are a function of the
prompt (FAKE_WINDOW_ANSWER_DIFF=1: one log-probability differs in window mode)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollkv_dist.errors import UsageError
from rollkv_dist.gates import context, slots
from rollkv_dist.gates.runner import run_gate

from test_gates import FAKE, fake_gpu


class FileBallast:
    """Stands in for the libcuda ballast: while held, the fake programs see `leave_free_mib` of free memory (the
    file FAKE_FREE_FILE names)."""

    path: Path | None = None

    def __init__(self, leave_free_mib, **kw):
        self.leave_free_mib = leave_free_mib
        self.held_mib, self.free_mib = 139000 - leave_free_mib, leave_free_mib

    def __enter__(self):
        self.path.write_text(str(self.leave_free_mib))
        return self

    def __exit__(self, *exc):
        self.path.unlink()


@pytest.fixture(autouse=True)
def file_ballast(tmp_path, monkeypatch):
    from rollkv_dist import ballast

    monkeypatch.setattr(FileBallast, "path", tmp_path / "free-mib")
    monkeypatch.setattr(ballast, "Ballast", FileBallast)


def run_slots(tmp_path: Path, env: dict[str, str] | None = None, **opts) -> context.GateResult:
    # KV of 0.1 MiB a cell: 3.2 GiB at -c 32768, as the gate's model has
    env = {**os.environ, "FAKE_KRM_DEFAULT": "auto", "FAKE_SERVER_MIB_PER_CELL": "0.1",
           "FAKE_FREE_FILE": str(tmp_path / "free-mib"), **(env or {})}
    ctx = context.GateContext(build=FAKE, work=tmp_path / "work", gpu=fake_gpu(), options=opts, env=env)
    return run_gate("slots", ctx)


def test_slots_pass_when_window_and_default_answer_as_resident(tmp_path):
    res = run_slots(tmp_path)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    # the model was written at the realistic shape the gate asks for
    model = json.loads(next((tmp_path / "work" / "model").glob("*.gguf")).read_text())
    assert model["size"] == {"n_embd": 2048, "n_head": 16, "n_ff": 6144, "n_layer": 24}
    # the MTP runs load a second model: the same trunk and one MTP block after it
    mtp_model = json.loads(next((tmp_path / "work" / "model-mtp1").glob("*.gguf")).read_text())
    assert mtp_model["size"] == {"n_embd": 2048, "n_head": 16, "n_ff": 6144, "n_layer": 25, "n_nextn": 1}
    assert all("model-mtp1" in c for c in res.commands if "--spec-type" in c)
    rows = res.results["rows"]
    assert len(rows) == 3 * 2 * 4  # window, default and window with the MTP draft; two waves, four slots
    assert all(r["tokens_equal"] and r["max_abs_diff"] == 0.0 and r["n_logprobs"] > 0 for r in rows)
    w = res.results["window"]
    assert slots.MIN_TAIL <= w["tail_fraction"] <= 0.9 and w["cells_used"] > w["cells_resident"]
    # wave 2 extends wave 1, so every slot finds its cached prefix
    assert all(r["cache_n"] > 0 for r in rows if r["wave"] == 2)
    n = res.results["n_prompt_tokens"]
    assert all(b > a for a, b in zip(n[0], n[1])) and sum(n[1]) <= 32768
    # the servers ran with four unified slots; the window one with the target the search found
    servers = [c for c in res.commands if "llama-server" in c]
    assert all("-np 4 --kv-unified" in c for c in servers)
    assert any(f"--vram-target {w['vram_target']}" in c for c in servers)
    # the MTP run: a ballast, no --vram-target, and both the main cache and the draft's with a tail
    assert res.results["mtp_ballast"]["leave_free_mib"] == int(w["vram_target"]) + 1024
    mtp = [c for c in servers if "--spec-type draft-mtp" in c]
    assert len(mtp) == 2 and not any("--vram-target" in c for c in mtp)
    assert [mw["tail_fraction"] > 0 for mw in res.results["mtp_windows"]] == [True, True]
    assert not any("MTP draft's cache" in n for n in res.notes)
    table = slots.report_rows(res.results)
    assert sum(line.startswith("| window |") for line in table) == 8
    assert sum(line.startswith("| window-mtp |") for line in table) == 8


def test_without_mtp_blocks_there_is_no_mtp_run(tmp_path):
    res = run_slots(tmp_path, slots_nextn=0)
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    assert not (tmp_path / "work" / "model-mtp1").exists()
    assert not any("--spec-type" in c for c in res.commands) and "mtp_windows" not in res.results


def test_a_window_answer_that_differs_fails(tmp_path):
    res = run_slots(tmp_path, {"FAKE_WINDOW_ANSWER_DIFF": "1"})
    assert res.verdict == "fail"
    failed = {c.name for c in res.checks if not c.ok}
    assert failed == {f"{run} wave {w} slot {s}: log-probabilities identical"
                      for run in ("window", "window-mtp") for w in (1, 2) for s in range(4)}


def test_the_writer_refusing_the_size_fails(tmp_path):
    res = run_slots(tmp_path, slots_ff=0)  # the fixture's own refusal of a size
    assert res.verdict == "fail"
    assert [c.name for c in res.checks if not c.ok] == ["test-llama-archs writes the qwen35 model"]
    res = run_slots(tmp_path / "mtp", slots_nextn=1000001)  # the main model is written, the MTP one refused
    assert [c.name for c in res.checks if not c.ok] == ["test-llama-archs writes the qwen35 model with 1000001 MTP block(s)"]


def test_bad_options_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="--slots-fill"):
        run_slots(tmp_path, slots_fill=0.95)


def test_waves_extend_each_slot_prompt():
    o = slots.Options(slots_ctx=8192, slots_np=2, slots_fill=0.5)
    first, second = slots.waves(o)
    assert len(first) == len(second) == 2 and first[0] != first[1]
    assert all(b.startswith(a + " ") for a, b in zip(first, second))
    # about fill * ctx / np tokens of the test tokenizer per slot after wave 2
    assert all(abs(len(b) / slots.CHARS_PER_TOKEN - 2048) < 0.05 * 2048 for b in second)


def test_an_mtp_draft_whose_kv_fits_its_room_is_fully_resident_with_a_note(tmp_path):
    """On the H200 the draft's one-layer KV at 32768 cells fit the room the main window left it."""
    res = run_slots(tmp_path, {"FAKE_MTP_ROOM": "2300"})
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    main, draft = res.results["mtp_windows"]
    assert main["tail_fraction"] > 0 and draft["tail_fraction"] == 0
    assert any("MTP draft's cache" in n and "fully resident" in n for n in res.notes)


def test_an_mtp_draft_without_a_window_fails(tmp_path):
    """Before patch 0090 the draft context made its cache without the residency: no window line of its own."""
    res = run_slots(tmp_path, {"FAKE_MTP_NO_WINDOW": "1"})
    assert {c.name for c in res.checks if not c.ok} == {
        "the MTP draft context sizes its cache in window mode (a window line of its own)"}
