#!/usr/bin/env bash
# call 2 (issue 12): 0022 before/after on one build (env), llama-bench at depth 16384 with about half of the cells
# in the host tail, f16 and q8_0 KV; resident and zero-copy as references; then resident-parity and the speed gate
# with the defaults
source .carry/env.sh
exec > >(tee $OUT/d2.log) 2>&1
stamp start
B=$P/bin/llama-bench; X=$REP/d2-variants; mkdir -p $X
bench() { # name kv env...
  local name=$1 kv=$2; shift 2
  local vt=$([ $kv = f16 ] && echo 2683 || echo 2594)
  env "$@" $B -m $M -o json -v -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 5 -krm window -vt $vt -kts auto \
    > $X/$name-$kv.json 2> $X/$name-$kv.log
  echo "$name $kv rc=$? $(grep -m1 -o 'position window = [0-9]* / [0-9]*' $X/$name-$kv.log) $(grep -m1 -o 'prefetch copies: .*' $X/$name-$kv.log)"
}
for kv in f16 q8_0; do
  $B -m $M -o json -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 5 > $X/resident-$kv.json 2> $X/resident-$kv.log; echo "resident $kv rc=$?"
  $B -m $M -o json -v -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 5 -krm window -vt $([ $kv = f16 ] && echo 2683 || echo 2594) -kts off > $X/zerocopy-$kv.json 2> $X/zerocopy-$kv.log; echo "zerocopy $kv rc=$?"
  bench before $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=side GGML_CUDA_PREFETCH_GROUP=0
  bench join $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=join GGML_CUDA_PREFETCH_GROUP=0
  bench stream $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_GROUP=0
  bench stream-group $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_GROUP=1
  bench join-group $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=join GGML_CUDA_PREFETCH_GROUP=1
  bench before-again $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=side GGML_CUDA_PREFETCH_GROUP=0
  bench default-again $kv
done
python3 .carry/sum.py $X | tee $X/summary.txt
tar czf $OUT/d2a.tar.gz -C $W rep
stamp parity
timeout 150 python3 -m rollkv_dist gates --build $P --gates resident-parity --gpu 0 --work $W/gates --reports $REP/d2-parity --llama-tree $W/src 2>&1 | tail -5
stamp speed
timeout 150 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 16384 --ubatch-sweep none --gpu 0 --work $W/gates --reports $REP/d2-speed-16k --llama-tree $W/src 2>&1 | tail -5
stamp end
tar czf $OUT/d2.tar.gz -C $W rep
