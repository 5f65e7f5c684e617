#!/usr/bin/env bash
# run one `rollkv gates` invocation into /tmp/rep/$1 and return everything small under $OUT
set -u
name=$1; shift
cd /tmp/rk
ulimit -l unlimited || true
export CUDA_DEVICE_ORDER=PCI_BUS_ID
start=$(date -u +%FT%TZ)
python3 -m rollkv_dist gates --build /tmp/p-full --work /tmp/gw --llama-tree /tmp/rollkv-src \
  --reports /tmp/rep/$name "$@" 2>&1 | tail -40
echo "rc=${PIPESTATUS[0]} start=$start end=$(date -u +%FT%TZ)"
cd /tmp/rep && tar czf $OUT/rep-$name.tgz $name
cd /tmp/gw && find . \( -name '*.log' -o -name '*.json' -o -name '*.txt' \) -size -2M | tar czf $OUT/work-$name.tgz -T - 2>/dev/null
ls -la $OUT
