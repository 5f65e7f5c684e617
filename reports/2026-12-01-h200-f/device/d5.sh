#!/usr/bin/env bash
# call 5 (issue 12): the speed gate at depth 65536 with call 4's choice, then with 0016's copies
source .carry/env.sh
exec > >(tee $OUT/d5.log) 2>&1
stamp start
BEST=$(tail -1 $REP/d4-smdiv/choice.txt)
stamp speed-64k "$BEST"
env $BEST timeout 200 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 65536 --kv-types f16,q8_0 --ubatch-sweep none --reps 2 --gpu 0 --work $W/gates --reports $REP/d4-speed-64k --llama-tree $W/src 2>&1 | tail -4
tar czf $OUT/d4b.tar.gz -C $W rep/d4-speed-64k
stamp speed-64k-before
GGML_CUDA_PREFETCH_DEVICE_CELLS=side GGML_CUDA_PREFETCH_SM_DIV=4 timeout 200 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 65536 --kv-types f16,q8_0 --ubatch-sweep none --reps 2 --gpu 0 --work $W/gates --reports $REP/d4-speed-64k-before --llama-tree $W/src 2>&1 | tail -4
stamp end
tar czf $OUT/d5.tar.gz -C $W rep/d4-speed-64k rep/d4-speed-64k-before
