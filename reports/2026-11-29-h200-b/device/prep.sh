#!/usr/bin/env bash
# call 1: unpack both trees, start both CUDA builds and the random model in the background
set -eu
repo=$(pwd)
rm -rf /tmp/rk && mkdir -p /tmp/rk && tar -C "$repo" --exclude=.carry -cf - . | tar -C /tmp/rk -xf -
tar xJf .carry/src/rollkv-src.tar.xz -C /tmp
tar xJf .carry/src/rollkv-up.tar.xz -C /tmp
cd /tmp/rk
ulimit -l unlimited || true
setsid nohup python3 -m rollkv_dist build --source /tmp/rollkv-src --prefix /tmp/p-full --variant cuda \
  --cuda-arch 90-real --build-dir /tmp/b -j 9 --targets llama-bench,llama-server > /tmp/build-full.log 2>&1 < /dev/null &
setsid nohup python3 -m rollkv_dist build --source /tmp/rollkv-up --prefix /tmp/p-up --variant cuda \
  --cuda-arch 90-real --build-dir /tmp/bu -j 7 --targets llama-bench > /tmp/build-up.log 2>&1 < /dev/null &
setsid nohup python3 -c '
from pathlib import Path
from rollkv_dist.gates.common import GateContext, ensure_random_model
ctx = GateContext(build=Path("/tmp/p-full"), work=Path("/tmp/gw/x"), gpu=None, models_dir=Path("/tmp/gw/models"),
                  llama_tree=Path("/tmp/rollkv-src"))
print(ensure_random_model(ctx, "qwen2-1.5b", "q8_0"))
' > /tmp/model.log 2>&1 < /dev/null &
sleep 2
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.max,pcie.link.width.max --format=csv
command -v ccache || echo "no ccache"
nproc; free -g | head -2
