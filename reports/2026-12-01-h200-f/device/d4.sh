#!/usr/bin/env bash
# call 4 (issue 12): the SM share of the side copies with 0022's device cells on their own stream, f16 and q8_0 at
# depth 16384 (about half of the cells in the tail); choose.py picks the setting; the speed gate at depth 65536 with it,
# then with 0016's copies (device cells on the side stream, 1/4 of the SMs): call 5, d5.sh
source .carry/env.sh
exec > >(tee $OUT/d4.log) 2>&1
stamp start; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current --format=csv
if [ ! -x $P/bin/llama-bench ]; then  # a fresh machine: the build and the model of call 1
  tar xJf .carry/src.tar.xz -C $W; mkdir -p $W/gates/models
  setsid bash -c "nice -n 10 python3 -m rollkv_dist model random -o $M --shape qwen2-1.5b --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m15.json 2> $W/m15.log < /dev/null && mv $W/m15.json ${M%.gguf}.json" > /dev/null 2>&1 < /dev/null &
  stamp build-series; t0=$(date +%s)
  timeout 330 python3 -m rollkv_dist build --source $W/src --prefix $P --variant cuda --cuda-arch 90-real -j 16 --build-dir $W/src/build-cuda 2>&1 | grep -v "^\[" | tail -2
  echo "build series: $(( $(date +%s) - t0 )) s"; wait_file ${M%.gguf}.json 60 > /dev/null
fi
B=$P/bin/llama-bench; X=$REP/d4-smdiv; mkdir -p $X
bench() { # name kv env...
  local name=$1 kv=$2; shift 2
  local vt=$([ $kv = f16 ] && echo 2683 || echo 2594)
  env "$@" $B -m $M -o json -v -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 5 -krm window -vt $vt -kts auto \
    > $X/$name-$kv.json 2> $X/$name-$kv.log
  echo "$name $kv rc=$? $(grep -m1 -o 'position window = [0-9]* / [0-9]*' $X/$name-$kv.log) $(grep -m1 -o 'prefetch copies: .*' $X/$name-$kv.log)"
}
for kv in f16 q8_0; do
  bench before $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=side GGML_CUDA_PREFETCH_SM_DIV=4
  bench stream4 $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_SM_DIV=4
  bench stream8 $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_SM_DIV=8
  bench stream16 $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_SM_DIV=16
  bench side8 $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=side GGML_CUDA_PREFETCH_SM_DIV=8
  bench stream8-again $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_SM_DIV=8
  bench stream4-again $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=stream GGML_CUDA_PREFETCH_SM_DIV=4
  bench before-again $kv GGML_CUDA_PREFETCH_DEVICE_CELLS=side GGML_CUDA_PREFETCH_SM_DIV=4
done
python3 .carry/choose.py $X | tee $X/choice.txt
BEST=$(tail -1 $X/choice.txt)
tar czf $OUT/d4a.tar.gz -C $W rep/d4-smdiv
stamp end
tar czf $OUT/d4.tar.gz -C $W rep/d4-smdiv
