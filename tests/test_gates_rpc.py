"""The rpc gate against the fake programs: a fake ggml-rpc-server on loopback that a test kills, and the fake
llama-logits-dump's RPC device (tests/data/fake_llama/bin)."""

from __future__ import annotations

import pytest

from rollkv_dist.errors import UsageError
from rollkv_dist.gates import report

from test_gates import _prompt_model, ctx_for, run_one


def run_rpc(tmp_path, monkeypatch=None, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)))
    return ctx, run_one("rpc", ctx)


def failed(res) -> list[str]:
    return [c.name for c in res.checks if not c.ok]


def test_rpc_parity_host_tails_on_two_nodes_and_a_killed_node(tmp_path):
    ctx, res = run_rpc(tmp_path)
    assert res.verdict == "pass", failed(res)
    runs = res.results["runs"]
    assert list(runs) == ["local-resident", "rpc-resident", "rpc-probe-0", "rpc-probe-1", "rpc-window", "rpc-auto"]
    assert all(runs[n]["compare"]["max_abs_diff"] == 0.0 for n in ("rpc-resident", "rpc-window", "rpc-auto"))
    # each node's target: its fixed part (from the probe that stopped at it) + 0.2 of its KV + a granule per tensor
    fixed, kv = res.results["fixed_mib"], res.results["node_kv_mib"]
    assert set(fixed) == {"RPC0", "RPC1"} and kv == [458.75, 458.75]
    want = [int(f["model"] + f["compute_reserve"] + f["margin"] + 0.2 * k + 28 * 2) for f, k in zip(fixed.values(), kv)]
    assert res.results["vram_target"] == ",".join(map(str, want))
    for name in ("rpc-window", "rpc-auto"):
        wins = runs[name]["windows"]
        assert set(wins) == {"RPC0", "RPC1"} and all(0 < w["cells_resident"] < 13200 for w in wins.values()), wins
    assert "window mode: no device memory left for the KV window on RPC0" in runs["rpc-probe-0"]["said"][0]
    assert "window mode: no device memory left for the KV window on RPC1" in runs["rpc-probe-1"]["said"][0]
    # the client runs on the RPC devices only, --rpc before -dev; the servers listen on loopback only and log the
    # window buffers they allocated
    rpc_cmds = [c for c in res.commands if "--rpc" in c]
    assert len(rpc_cmds) == 6 and all(c.index("--rpc 127.0.0.1:") < c.index("-dev RPC0,RPC1") for c in rpc_cmds)
    # the fault run: two fresh nodes with the windows of the tail targets
    assert f"-krm window --vram-target {res.results['vram_target']} -b 8 -ub 8" in rpc_cmds[5]
    servers = [c for c in res.commands if "ggml-rpc-server" in c]
    assert len(servers) == 4 and all(" -H 127.0.0.1 -p " in c for c in servers)
    # node 0's window is allocated by the second probe too, which stops at node 1
    assert [len(lines) for lines in res.results["server_windows"]] == [3, 2]
    fault = res.results["fault"]
    assert fault["killed"] and fault["rc"] not in (0, None, "hung") and fault["mode"] == "window"
    port = servers[2].rsplit(" ", 1)[1]
    assert fault["named"].startswith(f"RPC server 127.0.0.1:{port} stopped answering (GRAPH_COMPUTE)")
    md = report.markdown(report.gate_report(res, build=ctx.build, baseline=None, probe=None, build_info=None,
                                            baseline_info=None))
    assert "| rpc-window | 0 |" in md and "RPC0 " in md and f"`RPC server 127.0.0.1:{port} stopped answering" in md
    assert "Node 1: `rpc-server: window buffer on CUDA0:" in md and "Fault (window KV over two nodes)" in md


@pytest.mark.parametrize("knob, value, fails", [
    ("FAKE_RPC_DIFF", "1", [f"{run}: logits identical (max |diff| == 0)" for run in (
        "resident over RPC vs local", "window over RPC with host tails vs local resident",
        "auto over RPC with host tails vs local resident")]),
    ("FAKE_RPC_DIFF", "window", [f"{mode} over RPC with host tails vs {ref}: logits identical (max |diff| == 0)"
                                 for mode in ("window", "auto") for ref in ("local resident",
                                                                            "resident over the same nodes")]),
    ("FAKE_RPC_NAMELESS", "1", ["fault: the client names the node that stopped answering (0100)"]),
    ("FAKE_WINDOW_REFUSED", "1", ["probe 0: window mode stops at an RPC node not sized yet, with its fixed part"]),
], ids=["rpc-logits-differ", "rpc-tail-differs", "nameless-abort", "no-probe-line"])
def test_each_rpc_claim_fails_on_its_own(tmp_path, monkeypatch, knob, value, fails):
    _, res = run_rpc(tmp_path, monkeypatch, {knob: value})
    assert res.verdict == "fail" and failed(res) == fails


def test_the_kv_type_reaches_every_run_and_an_unknown_one_is_refused(tmp_path):
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), rpc_cache_type="q8_0")
    res = run_one("rpc", ctx)
    assert res.verdict == "pass", failed(res)
    dumps = [c for c in res.commands if "llama-logits-dump" in c]
    assert len(dumps) == 7 and all(" -ctk q8_0 -ctv q8_0 " in c for c in dumps), dumps
    assert res.results["cache_type"] == "q8_0"
    with pytest.raises(UsageError, match="q4_0"):
        run_one("rpc", ctx_for(tmp_path, model=str(_prompt_model(tmp_path)), rpc_cache_type="q4_0"))


def test_an_rpc_server_that_does_not_listen_fails_the_gate_naming_its_log(tmp_path, monkeypatch):
    _, res = run_rpc(tmp_path, monkeypatch, {"FAKE_RPC_NO_LISTEN": "1"})
    assert res.verdict == "fail"
    assert any("ggml-rpc-server did not listen" in c.detail and "Failed to create server socket" in c.detail
               for c in res.checks if not c.ok), res.checks
