#!/usr/bin/env bash
# one call on a fresh machine: unpack the series, build llama-bench only, write the model, run the curve gate
set -u
repo=$(pwd)
rm -rf /tmp/rk && mkdir -p /tmp/rk && tar -C "$repo" --exclude=.carry -cf - . | tar -C /tmp/rk -xf -
tar xJf .carry/src/rollkv-src.tar.xz -C /tmp
cd /tmp/rk
python3 -c '
from pathlib import Path
from rollkv_dist.gates.common import GateContext, ensure_random_model
ctx = GateContext(build=Path("/tmp/p-full"), work=Path("/tmp/gw/x"), gpu=None, models_dir=Path("/tmp/gw/models"),
                  llama_tree=Path("/tmp/rollkv-src"))
print(ensure_random_model(ctx, "qwen2-1.5b", "q8_0"))
' > /tmp/model.log 2>&1 &
python3 -m rollkv_dist build --source /tmp/rollkv-src --prefix /tmp/p-full --variant cuda --cuda-arch 90-real \
  --build-dir /tmp/b -j 16 --targets llama-bench 2>&1 | grep -v "build: " | tail -4
wait
bash "$repo/.carry/s/gates.sh" curve3 --gates curve --reps 1
cp /tmp/rep/curve3/*.md /tmp/rep/curve3/*.json $OUT/ 2>/dev/null; true
