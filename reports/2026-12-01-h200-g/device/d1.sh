#!/usr/bin/env bash
# call 1 (issue 12): build the series (0024 new: a copy engine reads the host tail); the random 1.5B model beside the
# build (niced); llama-window-test with the default and with GGML_CUDA_PREFETCH_COPY=sm; llama-bench at depth 16384,
# about half of the cells in the tail: the engine (default) against the SMs (0023's), alternated, f16 and q8_0 KV
source .carry/env.sh
exec > >(tee $OUT/d1.log) 2>&1
stamp start; nproc; free -m | head -2; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max --format=csv
tar xJf .carry/src.tar.xz -C $W; mkdir -p $W/gates/models
setsid bash -c "nice -n 10 python3 -m rollkv_dist model random -o $M --shape qwen2-1.5b --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m15.json 2> $W/m15.log < /dev/null && mv $W/m15.json ${M%.gguf}.json" > /dev/null 2>&1 < /dev/null &
stamp build-series
t0=$(date +%s)
timeout 420 python3 -m rollkv_dist build --source $W/src --prefix $P --variant cuda --cuda-arch 90-real -j 16 --build-dir $W/src/build-cuda 2>&1 | grep -v "^\[" | tail -4
echo "build series: $(( $(date +%s) - t0 )) s"; ls $P/bin
for cfg in default "GGML_CUDA_PREFETCH_COPY=sm" "GGML_CUDA_PREFETCH_DEVICE_CELLS=side" "GGML_CUDA_PREFETCH_DEVICE_CELLS=join GGML_CUDA_PREFETCH_GROUP=1" "GGML_CUDA_WINDOW_PREFETCH=0"; do
  n=$(echo "$cfg" | tr ' =' '_-')
  stamp window-test $cfg
  env $([ "$cfg" = default ] || echo $cfg) timeout 120 $P/bin/llama-window-test > $REP/window-test-$n.log 2>&1; echo "rc=$?"; grep -c PASS $REP/window-test-$n.log; grep "flash attention\|FAIL\|prefetch copies" $REP/window-test-$n.log
done
GGML_CUDA_PREFETCH_COPY=dma timeout 60 $P/bin/llama-window-test > $REP/window-test-badenv.log 2>&1; echo "rc=$?"; grep "prefetch" $REP/window-test-badenv.log
wait_file ${M%.gguf}.json 90
X=$REP/d1-engine; mkdir -p $X
for kv in f16 q8_0; do
  stamp bench $kv
  $B -m $M -o json -fa on -ngl 99 -ctk $kv -ctv $kv -d 16384 -p 512 -n 64 -r 5 > $X/resident-$kv.json 2> $X/resident-$kv.log; echo "resident $kv rc=$?"
  bench $X before $kv "-kts auto" GGML_CUDA_PREFETCH_COPY=sm
  bench $X engine $kv "-kts auto"
  bench $X sm-again $kv "-kts auto" GGML_CUDA_PREFETCH_COPY=sm
  bench $X engine-again $kv "-kts auto"
done
bench $X zerocopy f16 "-kts off"
python3 .carry/sum.py $X | tee $X/summary.txt
stamp end
tar czf $OUT/d1.tar.gz -C $W rep
