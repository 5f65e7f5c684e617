#!/usr/bin/env bash
# call 3 (issue 12): resident-ab, the series' resident mode (no rolling-KV flag) against the unpatched pin
source .carry/env.sh
exec > >(tee $OUT/d3.log) 2>&1
stamp start
timeout 420 python3 -m rollkv_dist gates --build $P --upstream-build $U --gates resident-ab --ab-rounds 4 --gpu 0 --work $W/gates --reports $REP/d3-resident-ab --llama-tree $W/src 2>&1 | tail -12
stamp end
tar czf $OUT/d3.tar.gz -C $W rep/d3-resident-ab
