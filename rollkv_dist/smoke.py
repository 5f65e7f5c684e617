"""`rollkv smoke --build PREFIX`: the CPU smoke gate of an installed build.

A completion from a tiny random-weight model through the prefix's own llama-server: the
server must boot, generate exactly the asked number of tokens greedily, and repeat itself.
It runs on any machine (no GPU), so CI runs it on the CPU conda artifact (installed from the
channel into a fresh prefix) as well as on source builds; `nox -s smoke` runs it per
artifact. The model is written from a llama.cpp tree's gguf-py and qwen2 vocab
(`--llama-tree`, e.g. `rollkv source DIR`), or given with `--model`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rollkv_dist.commands import add_command
from rollkv_dist import log
from rollkv_dist.errors import GateFailure, UsageError

PROMPT = "The capital of France is"
N_PREDICT = 8


def tiny_model(work: Path, llama_tree: Path) -> Path:
    """The tiny f16 random-weight qwen2 model (written once per work dir)."""
    from rollkv_dist.models import write_random_gguf

    path = work / "tiny-f16.gguf"
    if not path.is_file():
        write_random_gguf(path, shape="tiny", qtype="f16", llama_tree=llama_tree, seed=0,
                          progress=False)
    return path


def run_smoke(prefix: Path, model: Path, work: Path, threads: int = 2) -> dict[str, Any]:
    """Boot the prefix's llama-server on `model`, ask for two identical greedy completions."""
    from rollkv_dist.gates.llama_server import LlamaServer
    from rollkv_dist.gates.context import find_bin

    server = find_bin(prefix, "llama-server")
    work.mkdir(parents=True, exist_ok=True)
    args = ["-m", str(model), "-c", "256", "-t", str(threads), "-np", "1", "--no-webui"]
    with LlamaServer(server, args, work / "smoke-server.log", boot_timeout=180,
                     request_timeout=120) as srv:
        if not srv.booted:
            raise GateFailure(f"{server} exited with {srv.exit_code} before answering /health:\n"
                              f"{srv.log()[-2000:]}")
        first = srv.completion(PROMPT, N_PREDICT)
        second = srv.completion(PROMPT, N_PREDICT)
    result = {"server": str(server), "model": str(model), "prompt": PROMPT,
              "content": first.get("content"), "tokens_predicted": first.get("tokens_predicted"),
              "tokens_evaluated": first.get("tokens_evaluated"),
              "repeatable": first.get("content") == second.get("content")}
    problems = []
    if result["tokens_predicted"] != N_PREDICT:
        problems.append(f"{result['tokens_predicted']} tokens predicted, asked for {N_PREDICT}")
    if not result["tokens_evaluated"]:
        problems.append("no prompt token evaluated")
    if not result["repeatable"]:
        problems.append("greedy decoding did not repeat")
    if problems:
        raise GateFailure(f"smoke gate on {prefix}: {'; '.join(problems)} (log: "
                          f"{work / 'smoke-server.log'})")
    return result


def _run(args: argparse.Namespace) -> int:
    prefix, work = Path(args.build).absolute(), Path(args.work).absolute()
    if args.model:
        model = Path(args.model)
    elif args.llama_tree:
        model = tiny_model(work, Path(args.llama_tree))
    else:
        raise UsageError("pass --model FILE.gguf or --llama-tree DIR (a llama.cpp tree with "
                         "gguf-py, e.g. from `rollkv source DIR`) to write the tiny model")
    with log.step(f"Smoke gate: completion through {prefix}/bin/llama-server"):
        result = run_smoke(prefix, model, work)
    print(json.dumps(result, indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    # the description is this module's docstring past its title: what the gate checks and where it runs
    p = add_command(subparsers, "smoke", "CPU smoke gate: a completion through an installed llama-server",
                    __doc__.split("\n\n", 1)[1], _run)
    p.add_argument("--build", required=True, help="install prefix (a conda env, a Nix result, "
                   "a `rollkv build` prefix)")
    p.add_argument("--model", help="GGUF model (default: write the tiny random model)")
    p.add_argument("--llama-tree", help="llama.cpp tree for writing the tiny model")
    p.add_argument("--work", default=".work/smoke", help="work dir (model, server log)")
