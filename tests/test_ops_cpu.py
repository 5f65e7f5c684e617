"""Issue 30 in CI, without a GPU: upstream's op suite (test-backend-ops of the pinned tree's tests/, built for the CPU
from the shared build's `rollkv source` tree together with the archs gate's writer) under patch 0100's GGML_TEST_WINDOW, the CPU
against itself. The CPU has no window buffers, so each test's tensors go in a plain buffer of the window layout
(device granules, then host granules, the boundary at the split): the placement and the harness run, and cannot rot,
before any GPU sees them."""

from __future__ import annotations

import pytest

from conftest import shown
from rollkv_dist.gates import context, opsuite

OPS = "CPY,DUP,CONT,GET_ROWS,SET_ROWS"


@pytest.mark.integration
@pytest.mark.xdist_group("llama-cpu-build")
def test_the_op_suite_over_stand_in_window_buffers_on_the_cpu(cpu_build, request):
    ctx = context.GateContext(build=cpu_build["prefix"], work=cpu_build["work"] / "ops-cpu", gpu=None,
                             llama_tree=cpu_build["src"],
                             options=_options(ops_filter=OPS, ops_places="src,dst", ops_splits="odd,third", ops_jobs=2))
    res = context.GateResult(gate="engine", gpu=None)
    with shown(request):
        opsuite.run(ctx, res)
    bad = [c for c in res.checks if not c.ok]
    assert res.checks and not bad, bad
    s = res.results["ops_suite"]
    assert s["backend"] == "CPU" and s["fault"] is None  # the planted fault is ggml-cuda's
    assert len(s["rows"]) == 4 * len(OPS.split(","))
    assert all(r["passed"] > 0 and r["failed"] == 0 for r in s["rows"])
    # every run placed tensors, all of them in the stand-in buffer (the check says so per run)
    assert sum(c.name.endswith("tensors placed across the device/host boundary") for c in res.checks) == 4
    assert all("GGML_TEST_WINDOW=" in c and "-b CPU" in c for c in res.commands)


def _options(**values):
    from rollkv_dist.gates import engine

    return engine.GATE.make_options(values)
