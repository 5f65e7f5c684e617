#!/usr/bin/env bash
# call 2 (issue 17): K-shift that cannot get its memory, before (0013 reverted) and after; a draft model (-md) in
# window mode; the memory breakdown at exit; resident-parity on the conda artifact
source .carry/env.sh
exec > >(tee $OUT/c2.log) 2>&1
stamp start; tail -2 $W/up-build.log; cp .wh1/*.whl /tmp/wh/
ls -la /sys/bus/virtio/drivers/virtio_mem/ /sys/bus/virtio/drivers/virtio_balloon/ 2>&1 | head; grep -E "MemTotal|MemAvailable" /proc/meminfo
python3 .carry/server_checks.py $C/bin/llama-server $REP/hostmem-16m.json auto-1.5b-16M-past-host-RAM 60 -m $M -c 16777216
# the 14B-1M shape for call 4's curve, written beside this call's runs (one core)
setsid bash -c "nice -n 10 python3 -m rollkv_dist model random -o $W/gates/models/qwen2.5-14b-1m-q8_0-s0.gguf --shape qwen2.5-14b-1m --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m14.json 2> $W/m14.log < /dev/null && mv $W/m14.json $W/gates/models/qwen2.5-14b-1m-q8_0-s0.json" > /dev/null 2>&1 < /dev/null &
# before: libllama of the same tree without 0013, rebuilt incrementally in the channel's build dir
( cd $W/src && git apply -R $OLDPWD/patches/0013-*.patch || patch -R -p1 < $OLDPWD/patches/0013-*.patch ) && \
  cmake --build $W/src/build-rollkv --target llama -j 16 2>&1 | tail -1 && rm -rf $B13 && cp -a $C $B13 && \
  cp -P $W/src/build-rollkv/bin/libllama.so* $B13/lib/ && ls -la $B13/lib/libllama* $C/lib/libllama*
python3 - <<'PY' > $W/prompt.txt
import random
r = random.Random(7)
words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
print(" ".join(r.choice(words) for _ in range(1200)))
PY
D() { # name prefix extra...: one llama-logits-dump run with K-shift 200, q8_0 K, 1M cells
  local name=$1 pfx=$2; shift 2
  ( time timeout 240 $pfx/bin/llama-logits-dump -m $M -f $W/prompt.txt -n 8 -c 1048576 -fa on --kv-unified -np 1 \
      -ctk q8_0 -ctv f16 -b 512 -ub 128 -kts off --kv-shift 200 --logits-out $REP/ks-$name "$@" ) > $REP/ks-$name.log 2>&1
  echo "ks-$name: exit $?"; grep -E "position window|host memory|K-shift|shift|failed|error|rc =|ret =" $REP/ks-$name.log | grep -v "^$" | head -12 | cut -c1-260
}
stamp kshift
D ref-resident $C -krm resident
D window-roomy-after $C -krm window --vram-target 8000
BAL() { python3 -m rollkv_dist.ballast --leave-free $1 > $W/ballast.log 2>&1 & BP=$!; for i in $(seq 60); do grep -q ready $W/ballast.log && break; sleep 1; done; cat $W/ballast.log; }
BAL 7000
D window-tight-before $B13 -krm window
D window-tight-after $C -krm window
kill $BP; wait $BP 2>/dev/null
python3 - <<'PY'
import json, numpy as np, os
rep = "/tmp/w/rep"
ref = np.fromfile(f"{rep}/ks-ref-resident.f32", dtype=np.float32)
out = {}
for n in ("window-roomy-after", "window-tight-before", "window-tight-after"):
    p = f"{rep}/ks-{n}.f32"
    if not os.path.exists(p) or not os.path.exists(p.replace(".f32", ".json")):
        out[n] = {"logits": None}; continue
    a = np.fromfile(p, dtype=np.float32)
    j = json.load(open(p.replace(".f32", ".json"))); jr = json.load(open(f"{rep}/ks-ref-resident.json"))
    out[n] = {"rows": j["n_rows"], "same_shape": a.shape == ref.shape,
              "max_abs_diff": float(np.abs(a - ref).max()) if a.shape == ref.shape else None,
              "tokens": j["tokens"], "ref_tokens": jr["tokens"]}
print(json.dumps(out, indent=1)); json.dump(out, open(f"{rep}/kshift-compare.json", "w"), indent=1)
PY
stamp draft
S=$C/bin/llama-server
python3 .carry/server_checks.py $S $REP/draft-window.json draft-md-window 120 -m $M -md $M -c 131072 -fa on -krm window --vram-target 3000 -np 1 --kv-unified
nvidia-smi --query-gpu=memory.used --format=csv
BAL 20000
python3 .carry/server_checks.py $S $REP/draft-auto.json draft-md-auto-1M-20GB-free 150 -m $M -md $M -c 1048576
kill $BP; wait $BP 2>/dev/null
stamp parity
timeout 240 python3 -m rollkv_dist gates --build $C --gates resident-parity --gpu 0 --work $W/gates --reports $REP/c2-gates --llama-tree $W/src 2>&1 | tail -8
stamp end; tail -2 $W/up-build.log
tar czf $OUT/c2.tar.gz -C $W rep --exclude='*.f32'
