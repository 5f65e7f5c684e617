"""The rpc gate against the fake programs: a fake ggml-rpc-server on loopback that a test kills, and the fake
llama-logits-dump's RPC device (tests/data/fake_llama/bin)."""

from __future__ import annotations

import pytest

from rollkv_dist.gates import report

from test_gates import _prompt_model, ctx_for, run_one


def run_rpc(tmp_path, monkeypatch=None, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    ctx = ctx_for(tmp_path, model=str(_prompt_model(tmp_path)))
    return ctx, run_one("rpc", ctx)


def failed(res) -> list[str]:
    return [c.name for c in res.checks if not c.ok]


def test_rpc_parity_refusal_and_a_killed_node(tmp_path):
    ctx, res = run_rpc(tmp_path)
    assert res.verdict == "pass", failed(res)
    runs = res.results["runs"]
    assert list(runs) == ["local-resident", "rpc-resident", "rpc-auto", "rpc-window"]
    assert runs["rpc-resident"]["compare"]["max_abs_diff"] == 0.0 and runs["rpc-auto"]["compare"]["max_abs_diff"] == 0.0
    assert runs["rpc-auto"]["said"][0].startswith("kv residency: auto -> resident on RPC0: the KV cache")
    assert runs["rpc-window"]["rc"] == 1 and "raise --vram-target" in runs["rpc-window"]["said"][0]
    # the client runs on the RPC device only, --rpc before -dev; the server listens on loopback only
    rpc_cmds = [c for c in res.commands if "--rpc" in c]
    assert len(rpc_cmds) == 4 and all(c.index("--rpc 127.0.0.1:") < c.index("-dev RPC0") for c in rpc_cmds)
    servers = [c for c in res.commands if "ggml-rpc-server" in c]
    assert len(servers) == 2 and all(" -H 127.0.0.1 -p " in c for c in servers)
    fault = res.results["fault"]
    assert fault["killed"] and fault["rc"] not in (0, None, "hung")
    port = servers[1].rsplit(" ", 1)[1]
    assert fault["named"].startswith(f"RPC server 127.0.0.1:{port} stopped answering (GRAPH_COMPUTE)")
    md = report.markdown(report.gate_report(res, build=ctx.build, baseline=None, probe=None, build_info=None,
                                            baseline_info=None))
    assert "| rpc-auto | 0 |" in md and f"`RPC server 127.0.0.1:{port} stopped answering" in md


@pytest.mark.parametrize("knob, fails", [
    ("FAKE_RPC_DIFF", ["resident over RPC vs local: logits identical (max |diff| == 0)"]),
    ("FAKE_RPC_NAMELESS", ["fault: the client names the node that stopped answering (0100)"]),
], ids=["rpc-logits-differ", "nameless-abort"])
def test_each_rpc_claim_fails_on_its_own(tmp_path, monkeypatch, knob, fails):
    _, res = run_rpc(tmp_path, monkeypatch, {knob: "1"})
    assert res.verdict == "fail" and failed(res) == fails


def test_an_rpc_server_that_does_not_listen_fails_the_gate_naming_its_log(tmp_path, monkeypatch):
    _, res = run_rpc(tmp_path, monkeypatch, {"FAKE_RPC_NO_LISTEN": "1"})
    assert res.verdict == "fail"
    assert any("ggml-rpc-server did not listen" in c.detail and "Failed to create server socket" in c.detail
               for c in res.checks if not c.ok), res.checks
