"""GPU gates: real runs of the built binaries that a release must pass on a real GPU.

`rollkv gates --build PREFIX [--baseline-build PREFIX] [--upstream-build PREFIX] [--gates a,b]
[--gpu INDEX|UUID|all] [--split-gpus] [--work DIR] [--reports DIR] [--gemma PATH] [--llama-tree DIR]
[gate options]`

Each gate is a module of this package with a GATE (rollkv_dist/gates/base.py says what it holds);
its options dataclass makes its flags below.

Runtime needs on the GPU host: python3 with numpy, requests, pynvml, matplotlib; the repo on
PYTHONPATH. No network, no nox.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rollkv_dist import gpu as gpu_mod
from rollkv_dist.commands import add_command
from rollkv_dist.errors import GateFailure
from rollkv_dist.gates.base import add_option_flags, check_option_names, option_values, registry
from rollkv_dist.gates.runner import check_inputs, parse_gate_list, run_gates


def _cmd(args: Any) -> int:
    names = parse_gate_list(args.gates)
    options = option_values(args)
    check_option_names(options)
    paths = {k: None if getattr(args, k) is None else Path(getattr(args, k)).resolve()
             for k in ("build", "baseline_build", "upstream_build", "gemma", "llama_tree", "reports")}
    check_inputs(names, paths["build"], paths["baseline_build"], paths["upstream_build"], paths["gemma"])
    probe = gpu_mod.probe()
    gpus = probe.select(args.gpu if args.gpu is not None or not args.split_gpus else "all")  # NoGPUError if none
    reps, rdir = run_gates(
        names, list(gpus), build=paths["build"], work=Path(args.work).resolve(), reports=paths["reports"],
        probe=probe, baseline=paths["baseline_build"], upstream=paths["upstream_build"],
        llama_tree=paths["llama_tree"], gemma=paths["gemma"], options=options, split=args.split_gpus)
    failed = [f"{r['gate']} ({(r.get('gpu') or {}).get('uuid')})" for r in reps if r["verdict"] == "fail"]
    print(f"reports: {rdir}")
    if failed:
        raise GateFailure(f"gate(s) failed: {', '.join(failed)}; see {rdir}")
    return 0


def register(subparsers: Any) -> None:
    gates = registry()
    p = add_command(subparsers, "gates", "run the GPU gates against a build", __doc__, _cmd,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", required=True, metavar="PREFIX", help="install prefix of the full series build")
    p.add_argument("--baseline-build", metavar="PREFIX",
                   help="build of the series before its compute-reserve patch (boot-repro expects it to fail in "
                        "graph_reserve)")
    p.add_argument("--upstream-build", metavar="PREFIX",
                   help="build of the pin with no patch (resident-ab compares resident t/s against it)")
    p.add_argument("--gates", default="all", help=f"comma list of {', '.join(gates)} (default all)")
    p.add_argument("--gpu", default=None, help="INDEX, UUID, a comma list of them, or 'all': each in turn "
                                               "(default: the first GPU; with --split-gpus: all)")
    p.add_argument("--split-gpus", action="store_true",
                   help="one run with the selected GPUs (two or more) visible together, the model split by layers "
                        f"(gates with such a run: {', '.join(n for n, g in gates.items() if g.multi_gpu)}; the "
                        "others skip)")
    p.add_argument("--work", default=".work/gates", help="scratch: models, logs, logits (default .work/gates)")
    p.add_argument("--reports", default=None, help="reports dir (default reports/<date>-<gpu>/)")
    p.add_argument("--gemma", default=None, help="Gemma 3 270M GGUF for the needle gate")
    p.add_argument("--llama-tree", default=None, help="llama.cpp source tree (gguf-py, vocab) to write models")
    add_option_flags(p.add_argument_group("gate options (generated from the gates' options)"))
