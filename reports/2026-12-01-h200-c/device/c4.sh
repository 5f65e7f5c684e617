#!/usr/bin/env bash
# call 4 (issue 12): the seed's shape at the default ubatch: prefill before/after staging as the tail grows (depth 16k)
source .carry/env.sh
exec > >(tee $OUT/c4.log) 2>&1
stamp start; cat $W/m14.log | tail -2; ls -la $W/gates/models/
timeout 520 python3 -m rollkv_dist gates --build $C --gates curve --gpu 0 --work $W/gates --reports $REP/c4-curve14b --llama-tree $W/src --curve-shape qwen2.5-14b-1m --curve-no-nkvo --curve-fractions 0.75,0.5,0.25 --reps 1 2>&1 | tail -8
stamp end
tar czf $OUT/c4.tar.gz -C $W rep/c4-curve14b
