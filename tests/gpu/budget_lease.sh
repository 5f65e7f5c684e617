#!/usr/bin/env bash
# Device script (not run by CI): one GPU lease, in calls that each fit 10 minutes, for issue 26's remaining cases
# (the device budget under a ballast, the server gate) and issue 27's check of the product without the lab switches
# (parity, and speed against the lab tree of the same GPU). Run from the repo copy on the device, with the packed
# trees carried in .carry/:
#   rollkv pack .carry/rollkv-src.tar.xz --with-tests  # the product series (the server gate needs test-llama-archs)
#   rollkv pack .carry/rollkv-lab.tar.xz --lab         # the series + patches/lab (byte for byte the tree measured before)
# Everything lives under /tmp/rk, so it survives between calls on the same warm machine; what comes back is written
# under $OUT (small results only).
#
#   bash tests/gpu/budget_lease.sh STEP...  # steps in order, e.g. `build parity server` in a call
#   bash tests/gpu/budget_lease.sh product  # unpack, build the product, resident-parity, speed, K-shift after
#   bash tests/gpu/budget_lease.sh budget   # K-shift resident, draft; 0098 reverted: K-shift before
#   bash tests/gpu/budget_lease.sh kshift-ab  # -ub 128 -kts off: K-shift after 0098, resident, before (one lease)
#   bash tests/gpu/budget_lease.sh ondemand-inputs ondemand  # host memory on demand (tests/gpu/host_on_demand.py)
#   bash tests/gpu/budget_lease.sh gates    # the server gate (every case) and the archs gate
#   bash tests/gpu/budget_lease.sh rpc      # the rpc gate: two nodes on loopback, a host tail on each, a node killed
#   bash tests/gpu/budget_lease.sh rpc-smoke  # tests/gpu/rpc_window_smoke.sh (RPC_MODEL, RPC_TARGETS, ...)
#   bash tests/gpu/budget_lease.sh rpc-cost   # tests/gpu/rpc_cost.py: local, two nodes, local + node; 1.5B f16
#   bash tests/gpu/budget_lease.sh rpc-cost-14b  # the same with the 14B-1M shape, q8_0 K/V at 262 144 cells
#   bash tests/gpu/budget_lease.sh graph-opt  # resident-parity under GGML_CUDA_GRAPH_OPT=1 (0104)
#   bash tests/gpu/budget_lease.sh lab      # build the lab tree, speed: lab, then the product again
set -uo pipefail
S=/tmp/rk
R=$(pwd)
OUT=${OUT:-$S/out}
mkdir -p "$S" "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
TARGETS=${ROLLKV_LEASE_TARGETS:-llama-logits-dump,llama-server,llama-perplexity,llama-bench,ggml-rpc-server}
build() {  # build SRC PREFIX BUILD_DIR: incremental where BUILD_DIR exists; test-llama-archs where SRC has tests/
    local t targets=$TARGETS tests=()
    t=$(date +%s)
    if [ -f "$1/tests/test-llama-archs.cpp" ] && [ -z "${ROLLKV_LEASE_TARGETS:-}" ]; then
        targets=$TARGETS,test-llama-archs
        tests=(--cmake-arg=-DLLAMA_BUILD_TESTS=ON)
    fi
    python3 -m rollkv_dist build --source "$1" --prefix "$2" --build-dir "$3" --variant cuda \
        --cuda-arch 90-real -j 16 --targets "$targets" "${tests[@]}" 2>&1 | tail -3
    echo "build_seconds $2 $(( $(date +%s) - t ))"
}
unpack() {  # unpack ARCHIVE DIR
    [ -d "$2" ] || { tar -xJf "$1" -C "$S" && mv "$S/$(basename "$1" .tar.xz)" "$2"; }
}
gates() {  # gates PREFIX NAME GATE [options]: one gate run, its report under rep/NAME
    local prefix=$1 name=$2 gate=$3
    shift 3
    python3 -m rollkv_dist gates --build "$prefix" --gates "$gate" --gpu 0 --llama-tree "$S/src" \
        --work "$S/gw" --reports "$S/rep/$name" "$@" 2>&1 | tail -6
}
speed() {  # speed PREFIX NAME: depth 16384, f16 and q8_0 K/V, staging auto and off, -nkvo
    gates "$1" "$2" speed --speed-depths 16384 --ubatch-sweep none
}
budget() {  # budget STEP [args]: tests/gpu/budget_scratch.py
    python3 tests/gpu/budget_scratch.py "$@" --work "$S/w" 2>&1 | tail -4
}
rpc_cost() {  # rpc_cost NAME MODEL [options]: tests/gpu/rpc_cost.py, its JSON and log to $OUT
    local name=$1 model=$2
    shift 2
    python3 "$R/tests/gpu/rpc_cost.py" --build "$S/after" --model "$S/hod/$model" --work "$S/$name" "$@" \
        2> "$OUT/$name.log" > "$OUT/$name.json"; echo "$name rc=$?"
    tail -c 1500 "$OUT/$name.json"
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
}
collect() {  # the small results only (never the gates' work folders whole)
    (cd "$S" && tar -czf "$OUT/$1.tar.gz" --ignore-failed-read w/*.json rep 2>/dev/null)
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
}
[ $# -gt 0 ] || set -- usage
for step in "$@"; do
case "$step" in
build)  # unpack and build the product (ggml-rpc-server and test-llama-archs included)
    unpack .carry/rollkv-src.tar.xz "$S/src"
    build "$S/src" "$S/after" "$S/bld"
    ;;
parity)
    gates "$S/after" parity resident-parity
    collect parity
    ;;
speed)
    speed "$S/after" speed-product-1
    collect speed
    ;;
kshift)  # the models, then the quantized K-shift after 0098 under the ballast, server defaults and -ub 128 -kts off
    budget inputs --build "$S/after" --llama-tree "$S/src"
    budget kshift --build "$S/after" --label after
    budget kshift --build "$S/after" --label after --small-compute
    collect kshift
    ;;
server)
    gates "$S/after" server server
    collect server
    ;;
archs)
    gates "$S/after" archs archs
    collect archs
    ;;
archs-logs)  # the run logs of the archs gate's models named in ARCHS_LOGS (default: deepseek4-moe)
    (cd "$S/gw/gpu0/archs" && tar -czf "$OUT/archs-logs.tar.gz" $(for m in ${ARCHS_LOGS:-deepseek4-moe}; do echo "$m"/*.log; done))
    ;;
product)
    bash "$0" build parity speed kshift
    ;;
rpc)
    gates "$S/after" rpc rpc
    collect rpc
    ;;
rpc-q8)  # the rpc gate with q8_0 K/V (staged on the nodes; reports/2026-12-07-h100-f saw the 14B shape differ)
    gates "$S/after" rpc-q8 rpc --rpc-cache-type q8_0
    collect rpc-q8
    ;;
rpc-smoke)  # issue 29: tests/gpu/rpc_window_smoke.sh (two nodes on this GPU; its RPC_* settings pass through)
    bash "$R/tests/gpu/rpc_window_smoke.sh" 2>&1 | grep "rc=\|position window\|max_abs" | tail -20
    ;;
rpc-inputs)  # the 1.5B f16 model of rpc-cost alone (ondemand-inputs writes the 14B shape too)
    mkdir -p "$S/hod"; [ -f "$S/hod/qwen2-1.5b-f16.gguf" ] || python3 -m rollkv_dist model random -o "$S/hod/qwen2-1.5b-f16.gguf" \
        --shape qwen2-1.5b --qtype f16 --llama-tree "$S/src" --quiet 2>&1 | tail -2
    ;;
rpc-cost)  # issue 29: the RPC cost per token (tests/gpu/rpc_cost.py), the model from rpc-inputs
    rpc_cost rpc-cost qwen2-1.5b-f16.gguf --ctx 32768 --keep 0.2
    ;;
rpc-cost-14b)  # the 14B-1M shape over two nodes: its KV above both budgets together (the model from ondemand-inputs)
    rpc_cost rpc-cost-14b qwen2.5-14b-1m-q8_0.gguf --ctx 262144 --keep 0.04 --extra "-ctk q8_0 -ctv q8_0" \
        --layouts local,rpc2 --reps 1 -n 32
    ;;
rpc-cost-q8)  # q8_0 K/V over two nodes (1.5B f16, rpc-inputs): staging auto, off and on at one target; RPC_COST_TAG
    # names the results (e.g. a run under GGML_CUDA_DISABLE_GRAPHS=1)
    rpc_cost "rpc-cost-q8${RPC_COST_TAG:-}" qwen2-1.5b-f16.gguf --ctx 32768 --keep 0.2 --extra "-ctk q8_0 -ctv q8_0" \
        --layouts local,rpc2 --reps 2 -n 16 --window-variants "kts-off=-kts off;kts-on=-kts on"
    ;;
graph-opt-det)  # is GGML_CUDA_GRAPH_OPT=1 deterministic at all? Two resident runs with it and two without (1.5B f16)
    mkdir -p "$S/god"; python3 -c "from rollkv_dist.gates.resident_parity import make_prompt; print(make_prompt(14000))" > "$S/god/p.txt"
    for i in 1 2; do for g in 0 1; do
        GGML_CUDA_GRAPH_OPT=$g "$S/after/bin/llama-logits-dump" -m "$S/hod/qwen2-1.5b-f16.gguf" -f "$S/god/p.txt" -n 16 \
            -c 32768 -fa on -ngl 99 -krm resident --logits-out "$S/god/g$g-$i" > "$S/god/g$g-$i.log" 2>&1; echo "g$g-$i rc=$?"
    done; done
    python3 - "$S/god" <<'PY' | tee "$OUT/graph-opt-det.json"
import json, sys
from pathlib import Path
from rollkv_dist.gates.resident_parity import compare
d = Path(sys.argv[1])
out = {f"{a} vs {b}": {k: v for k, v in compare(d / a, d / b).items() if k != "tokens"}
       for a, b in (("g0-1", "g0-2"), ("g1-1", "g1-2"), ("g0-1", "g1-1"))}
print(json.dumps(out, indent=1))
PY
    grep -ah "GRAPH_OPT" "$S/god/g1-1.log" | head -3
    ;;
graph-opt)  # issue 26, 0104: resident-parity under GGML_CUDA_GRAPH_OPT=1 (streams' pools in the scratch bound)
    GGML_CUDA_GRAPH_OPT=1 gates "$S/after" parity-graph-opt resident-parity
    grep -rhoa "GGML_CUDA_GRAPH_OPT=1: the scratch bound.*" "$S/gw" | sort | uniq -c | head -3
    collect graph-opt
    ;;
gates)
    bash "$0" server archs
    ;;
lab)
    unpack .carry/rollkv-lab.tar.xz "$S/lab-src"
    build "$S/lab-src" "$S/lab" "$S/bld-lab"
    speed "$S/lab" speed-lab-1
    speed "$S/after" speed-product-2
    collect lab
    ;;
kshift-ab)  # issue 26: the quantized K-shift at -ub 128 -kts off after 0098, resident, then 0098 reverted (before)
    budget inputs --build "$S/after" --llama-tree "$S/src"
    budget kshift --build "$S/after" --label after --small-compute
    budget kshift --build "$S/after" --label after --small-compute --free
    (cd "$S/src" && patch -R -p1 < patches/0098-*.patch > /dev/null) || exit 1
    build "$S/src" "$S/before" "$S/bld"
    budget kshift --build "$S/before" --label before --small-compute
    (cd "$S/src" && patch -p1 < patches/0098-*.patch > /dev/null)
    collect kshift-ab
    ;;
ondemand-inputs)  # issue 28: the 14B-1M and 1.5B shapes for tests/gpu/host_on_demand.py
    python3 tests/gpu/host_on_demand.py inputs --build "$S/after" --llama-tree "$S/src" --work "$S/hod" 2>&1 | tail -3
    ;;
ondemand-*)  # issue 28, one case of tests/gpu/host_on_demand.py: boot, speed, fault or huge
    python3 tests/gpu/host_on_demand.py "${step#ondemand-}" --build "$S/after" --work "$S/hod" 2>&1 | tail -12
    (cd "$S" && tar -czf "$OUT/ondemand-${step#ondemand-}.tar.gz" hod/*.json hod/*.log 2>/dev/null)
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
    ;;
ondemand)
    bash "$0" ondemand-boot ondemand-speed ondemand-fault ondemand-huge
    ;;
diag-build)  # the series with tests/gpu/reserve_diag.diff (allocation trace, LLAMA_DIAG_SPLIT_TWICE = before 0097's fix)
    unpack .carry/rollkv-src.tar.xz "$S/src"
    (cd "$S/src" && patch -p1 --forward < "$R/tests/gpu/reserve_diag.diff" > /dev/null) || exit 1
    build "$S/src" "$S/after" "$S/bld"
    ;;
diag-undo)  # the diagnostic diff taken out again: the series alone, rebuilt incrementally
    (cd "$S/src" && patch -R -p1 < "$R/tests/gpu/reserve_diag.diff" > /dev/null) || exit 1
    build "$S/src" "$S/after" "$S/bld"
    ;;
diag)  # tests/gpu/reserve_diag.py: pass 1 against the compute buffer after pass 2, before and after 0097's fix; each
    # case's results go to $OUT as soon as it ends (a call cut short keeps what ran)
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
    for c in ${DIAG_CASES:-tiny-1m 14b-1m 14b-noc 15b-131k}; do
        python3 tests/gpu/reserve_diag.py models --build "$S/after" --llama-tree "$S/src" --work "$S/hod" --cases "$c" 2>&1 | tail -3
        python3 tests/gpu/reserve_diag.py run --build "$S/after" --work "$S/hod" --cases "$c" 2>&1 | tail -2 | cut -c1-1500
        (cd "$S" && tar -czf "$OUT/diag.tar.gz" hod/*.json hod/*.log 2>/dev/null)
    done
    ;;
budget)
    budget kshift --build "$S/after" --label after --free
    budget draft --build "$S/after"
    budget kshift --build "$S/after" --label after --small-compute --free
    (cd "$S/src" && patch -R -p1 < patches/0098-*.patch > /dev/null) || exit 1
    build "$S/src" "$S/before" "$S/bld"
    budget kshift --build "$S/before" --label before
    budget kshift --build "$S/before" --label before --small-compute
    (cd "$S/src" && patch -p1 < patches/0098-*.patch > /dev/null)
    collect budget
    ;;
*)
    echo "usage: $0 STEP... (build parity speed kshift kshift-ab server archs rpc rpc-q8 rpc-inputs rpc-cost rpc-cost-14b rpc-cost-q8 graph-opt graph-opt-det archs-logs budget lab ondemand-inputs ondemand-boot|speed|fault|huge ondemand diag-build diag diag-undo; product = build parity speed kshift, gates = server archs)" >&2
    exit 2
    ;;
esac
done
