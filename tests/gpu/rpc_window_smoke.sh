#!/usr/bin/env bash
# Device script (not run by CI), issue 29: window buffers over RPC on one GPU (0102/0103). Two ggml-rpc-servers on
# loopback serve the same GPU as two nodes; a random qwen2-1.5B-shape f16 model (written by reserve_diag.py's
# models step under /tmp/rk/hod) is split over both; window mode with a --vram-target per node that leaves a host tail
# on each, against resident over the same nodes and a local resident run. Logs and logits digests go to $OUT/rpc.
# Settings: RPC_MODEL, RPC_CTX (65536), RPC_WORDS (6000), RPC_TARGETS ("3000,3000 2900,3300": one run each),
# RPC_EXTRA (more client flags, e.g. "-ctk q8_0 -ctv q8_0"). Reported: reports/2026-12-07-h100-e/.
set -uo pipefail
S=/tmp/rk; B=$S/after/bin; W=$S/rpcw; OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT/rpc"
M=${RPC_MODEL:-$S/hod/qwen2-1.5b-f16.gguf}
python3 -c "
import random; r=random.Random(0); w='the of and river mountain window garden engine signal pattern'.split()
open('$W/p.txt','w').write(' '.join(r.choice(w) for _ in range(${RPC_WORDS:-6000})))"
$B/ggml-rpc-server -H 127.0.0.1 -p 50061 > "$OUT/rpc/server-0.log" 2>&1 &
P0=$!
$B/ggml-rpc-server -H 127.0.0.1 -p 50062 > "$OUT/rpc/server-1.log" 2>&1 &
P1=$!
sleep 3
run() {  # run NAME ARGS...: llama-logits-dump, its log under $OUT/rpc
    local name=$1; shift
    local t=$(date +%s%N)
    $B/llama-logits-dump -m "$M" -f "$W/p.txt" -n 16 -c ${RPC_CTX:-65536} -fa on -ngl 99 ${RPC_EXTRA:-} "$@" \
        --logits-out "$W/$name" > "$OUT/rpc/$name.log" 2>&1
    echo "$name rc=$? ms=$(( ($(date +%s%N) - t)/1000000 ))" | tee -a "$OUT/rpc/runs.txt"
    grep -h "position window\|host tail\|window budget\|rpc-server\|cannot hold\|prompt eval\|failed\|error" \
        "$OUT/rpc/$name.log" | head -12
}
RPC="--rpc 127.0.0.1:50061,127.0.0.1:50062 -dev RPC0,RPC1"
run local-resident -dev CUDA0 -krm resident
run rpc-resident $RPC -krm resident
TARGETS=${RPC_TARGETS:-3000,3000 2900,3300}
for vt in $TARGETS; do
    run rpc-window-${vt/,/-} $RPC -krm window --vram-target $vt
done
run rpc-auto $RPC -krm auto --vram-target ${TARGETS%% *}
kill $P0 $P1; wait
grep -h "window buffer" "$OUT"/rpc/server-*.log | head
python3 - "$W" <<'PY' | tee "$OUT/rpc/compare.txt"
import json, sys, pathlib, numpy as np
w = pathlib.Path(sys.argv[1]); ref = np.fromfile(w / "local-resident.f32", dtype=np.float32)
for f in sorted(w.glob("*.f32")):
    a = np.fromfile(f, dtype=np.float32); m = json.loads(f.with_suffix(".json").read_text()) if f.with_suffix(".json").exists() else {}
    d = float(np.abs(a - ref).max()) if a.shape == ref.shape else None
    print(f.stem, "max_abs_diff", d, "n_prompt", m.get("n_prompt"), "tokens_equal", m.get("tokens") == json.loads((w / "local-resident.json").read_text()).get("tokens"))
PY
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
