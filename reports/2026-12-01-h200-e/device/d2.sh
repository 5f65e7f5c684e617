#!/usr/bin/env bash
# call 2 (issue 12): the prefetch copy settings side by side on one build (env, 0021), f16 and q8_0 KV, depth 16384,
# about half of the cells in the host tail; zero-copy (-kts off) and resident as references. Then the best setting
# (by the geometric mean of the four t/s against 0016's setting) for resident-parity and the speed gate.
source .carry/env.sh
exec > >(tee $OUT/d2.log) 2>&1
stamp start
B=$P/bin/llama-bench; X=$REP/d2-variants; mkdir -p $X
bench() { # name kv vt env... -- args
  local name=$1 kv=$2 vt=$3; shift 3
  env "$@" $B -m $M -o json -v -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 3 -krm window -vt $vt -kts auto \
    > $X/$name-$kv.json 2> $X/$name-$kv.log; echo "$name $kv rc=$? $(grep -m1 -o 'position window = [0-9]* / [0-9]*' $X/$name-$kv.log)"
}
for kv in f16 q8_0; do
  vt=$([ $kv = f16 ] && echo 2683 || echo 2594)
  $B -m $M -o json -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 3 > $X/resident-$kv.json 2> $X/resident-$kv.log; echo "resident $kv rc=$?"
  $B -m $M -o json -v -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 3 -krm window -vt $vt -kts off > $X/zerocopy-$kv.json 2> $X/zerocopy-$kv.log; echo "zerocopy $kv rc=$?"
  bench p0016-normal-div4 $kv $vt GGML_CUDA_PREFETCH_PRIORITY=normal GGML_CUDA_PREFETCH_SM_DIV=4
  bench high-div4 $kv $vt GGML_CUDA_PREFETCH_PRIORITY=high GGML_CUDA_PREFETCH_SM_DIV=4
  bench high-div2 $kv $vt GGML_CUDA_PREFETCH_PRIORITY=high GGML_CUDA_PREFETCH_SM_DIV=2
  bench high-div1 $kv $vt GGML_CUDA_PREFETCH_PRIORITY=high GGML_CUDA_PREFETCH_SM_DIV=1
  bench normal-div2 $kv $vt GGML_CUDA_PREFETCH_PRIORITY=normal GGML_CUDA_PREFETCH_SM_DIV=2
  bench engine $kv $vt GGML_CUDA_PREFETCH_COPY=engine
  bench p0016-normal-div4-again $kv $vt GGML_CUDA_PREFETCH_PRIORITY=normal GGML_CUDA_PREFETCH_SM_DIV=4
done
stamp choose
python3 .carry/choose.py $X > $X/choice.txt; cat $X/choice.txt
BEST=$(tail -1 $X/choice.txt)
tar czf $OUT/d2a.tar.gz -C $W rep
stamp parity "$BEST"
env $BEST timeout 150 python3 -m rollkv_dist gates --build $P --gates resident-parity --gpu 0 --work $W/gates --reports $REP/d2-parity --llama-tree $W/src 2>&1 | tail -5
stamp speed "$BEST"
env $BEST timeout 150 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 16384 --ubatch-sweep none --gpu 0 --work $W/gates --reports $REP/d2-speed-16k --llama-tree $W/src 2>&1 | tail -5
stamp end
tar czf $OUT/d2.tar.gz -C $W rep
