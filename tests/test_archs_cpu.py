"""Issue 25 in CI, without a GPU: the archs gate on the shared CPU build, one model of the pin's fixture per
memory type. Under the packaged default each loads and decodes (auto runs resident: no GPU), and its
staging graph (patch 0020: LLAMA_KV_STAGE_EVERY_CELL=1, every cache reads a staged copy of its K/V with the
prefetch, as if every cell were in a host tail) gives the resident logits bit for bit.

The fixture's writer, upstream's tests/test-llama-archs.cpp, is not in the shipped programs: the gate builds it
for the CPU from the `rollkv source` tree the shared build was packed from (about 7 min on 2 cores, once per
work folder)."""

from __future__ import annotations

import os
import re

import pytest

from conftest import shown
from rollkv_dist.gates import common, run_gate

# one fixture model per memory type (the memory each is, as patch 0090 names it on a GPU build:
# reports/2026-12-02-every-memory/archs.json)
MODELS = {
    "llama-dense": "an attention KV cache",
    "gemma3-dense": "an iSWA attention KV cache (a full cache and a sliding-window cache)",
    "qwen35-dense": "hybrid (an attention KV cache beside recurrent state)",
    "lfm2moe-moe": "hybrid (an attention KV cache beside recurrent state)",  # its iSWA form
    "qwen4exp-moe": "hybrid (an attention KV cache with an indexer cache, beside recurrent state)",
    "deepseek32-moe": "sparse attention (DSA: an attention KV cache with an indexer K cache)",
    "dots3note-moe": "sparse attention (DSA: an attention KV cache with an indexer K cache)",  # DSA-iSWA
    "minimax-m3-moe": "sparse attention (MSA: an attention KV cache with an indexer K cache)",
    "deepseek4-moe": "DeepSeek-V4's compressed KV cache",
    "mamba-dense": "recurrent state only (no attention KV cache)",
}


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_every_memory_type_stages_exactly_on_the_cpu_build(cpu_build, request):
    flt = "^(" + "|".join(re.escape(m) for m in MODELS) + ")$"
    ctx = common.GateContext(build=cpu_build["prefix"], work=cpu_build["work"] / "archs-cpu", gpu=None,
                             llama_tree=cpu_build["src"], env=dict(os.environ),
                             options={"archs_filter": flt, "archs_jobs": 2, "archs_ctx": 2048})
    with shown(request):
        res = run_gate("archs", ctx)
    rows = {r["arch"]: r for r in res.results.get("rows", [])}
    assert sorted(rows) == sorted(MODELS), [c for c in res.checks if not c.ok]
    assert res.verdict == "pass", [c for c in res.checks if not c.ok]
    for name, row in rows.items():
        assert row["resident_ok"] and row["auto_ok"], (name, row)
        assert row["staged_max_abs_diff"] == 0.0, (name, row)
    staged = [c for c in res.checks if c.name.endswith("gives the resident logits")]
    assert len(staged) == len(MODELS) and all(c.ok for c in staged)
    assert sum(c.startswith("LLAMA_KV_STAGE_EVERY_CELL=1 ") for c in res.commands) == len(MODELS)
    # the CPU build runs resident under auto, and says why
    assert all("there is no GPU device" in row["note"] for row in rows.values())
