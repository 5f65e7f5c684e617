#!/usr/bin/env bash
# calls 4 and 5 (issue 12): the seed's configuration at -c 524288 (-ub 4096 -b 4096) on the 14B-1M shape: before
# (-kts off alone, its targets sized for its own reserve: the tails auto gets at the same fractions), then after (auto)
source .carry/env.sh
S=${1:?off or auto}
exec > >(tee $OUT/d4-$S.log) 2>&1
stamp start $S; wait_file ${M14%.gguf}.json 120; free -m | head -2
timeout 400 python3 -m rollkv_dist gates --build $P --gates curve --gpu 0 --work $W/gates --reports $REP/d4-curve524k-ub4096-$S --llama-tree $W/src --curve-shape qwen2.5-14b-1m --curve-ctx 524288 --curve-ubatch 4096 --curve-staging $S --curve-no-nkvo --curve-fractions 0.75,0.5,0.35,0.2 --reps 1 2>&1 | tail -8
stamp end
tar czf $OUT/d4-$S.tar.gz -C $W rep/d4-curve524k-ub4096-$S
