#!/usr/bin/env bash
# call 2 (issue 12): the seed's headline re-measured: the 14B-1M shape at -c 524288, prefill/decode as the tail grows,
# before (-kts off) and after (auto), seed configuration (-ub 4096 -b 4096) then the default ubatch
source .carry/env.sh
exec > >(tee $OUT/d2.log) 2>&1
stamp start; wait_m14 200; free -m | head -2
stamp curve-ub4096
timeout 330 python3 -m rollkv_dist gates --build $P --gates curve --gpu 0 --work $W/gates --reports $REP/d2-curve524k-ub4096 --llama-tree $W/src --curve-shape qwen2.5-14b-1m --curve-ctx 524288 --curve-ubatch 4096 --curve-no-nkvo --curve-fractions 0.75,0.5,0.25 --reps 1 2>&1 | tail -8
stamp curve-ub512
timeout 240 python3 -m rollkv_dist gates --build $P --gates curve --gpu 0 --work $W/gates --reports $REP/d2-curve524k-ub512 --llama-tree $W/src --curve-shape qwen2.5-14b-1m --curve-ctx 524288 --curve-no-nkvo --curve-fractions 0.75,0.25 --reps 1 2>&1 | tail -8
stamp end
tar czf $OUT/d2.tar.gz -C $W rep/d2-curve524k-ub4096 rep/d2-curve524k-ub512
