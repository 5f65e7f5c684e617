#!/usr/bin/env bash
# call 2 (issue 12): the gates with 0024's defaults: resident-parity, speed at 16k, speed at 64k alone (f16 and
# q8_0, --reps 2: no depth runs zero-copy, so the gate's decode-only link probe measures the link rate)
source .carry/env.sh
exec > >(tee $OUT/d2.log) 2>&1
stamp start
nvidia-smi --query-gpu=index,name,uuid,driver_version --format=csv,noheader
stamp parity
timeout 150 python3 -m rollkv_dist gates --build $P --gates resident-parity --gpu 0 --work $W/gates --reports $REP/d2-parity --llama-tree $W/src 2>&1 | tail -5
stamp speed-16k
timeout 150 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 16384 --ubatch-sweep none --gpu 0 --work $W/gates --reports $REP/d2-speed-16k --llama-tree $W/src 2>&1 | tail -5
tar czf $OUT/d2a.tar.gz -C $W rep
stamp speed-64k
timeout 260 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 65536 --kv-types f16,q8_0 --ubatch-sweep none --reps 2 --gpu 0 --work $W/gates --reports $REP/d2-speed-64k --llama-tree $W/src 2>&1 | tail -8
stamp end
tar czf $OUT/d2.tar.gz -C $W rep
